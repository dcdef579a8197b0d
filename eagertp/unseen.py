"""Communication on a managed group that the mode never saw.

Note [Collectives the mode did not see]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A tensor subclass's ``__torch_dispatch__`` runs after the mode hands it an op
(Note [Subclasses desugar first] in eagertp.mode), and the ops it issues
come back to the mode: unless it issues them with dispatch turned off
(``torch._C._DisableTorchDispatch``, ``no_dispatch()``), where a collective
goes straight to the process group. Another thread's ops, too, never reach
this thread's mode. Such a collective is neither fused nor in explain()
(Invariant 4), and the mode cannot intercept it; but the group counts it.
gloo and NCCL number the operations issued on a group
(``ProcessGroup._get_sequence_number_for_group``: gloo counts collectives and
point-to-point messages, NCCL its collectives), so the count moving while
eagertp did not issue anything on the group, and the mode saw no
communication op on it, is communication the mode did not see.

The watch reads a managed group's count whenever eagertp is about to
communicate (a collective the mode sees on the group, the start of eagertp's
outermost issuing, any other communication op the mode sees), and again once
it has (``refresh``). A count that moved in between is recorded in explain()
with the tensor subclass the mode last handed an op to, if any (the likely
culprit), counted in ``stats["unseen_operations"]`` and logged as a warning.
The block's exit checks once more. A group is watched from the first
collective the mode sees on it; groups whose backend does not number its
operations are not watched. Every block starts the watch afresh and drops it
at its exit.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from eagertp._format import group_str

log = logging.getLogger("eagertp")


def _sequence_number(group: dist.ProcessGroup) -> int | None:
    try:
        return group._get_sequence_number_for_group()
    except (RuntimeError, AttributeError):  # a backend that does not number its operations
        return None


class Unseen:
    """The watch (Note [Collectives the mode did not see]): per managed group
    that numbers its operations, the count eagertp last knew of."""

    def __init__(self) -> None:
        self.known: dict[dist.ProcessGroup, int] = {}
        self._unnumbered: set[dist.ProcessGroup] = set()
        # (types, op) of the last op the mode handed to a tensor subclass since
        # unseen communication was last found: what likely issued the next.
        self.handed: tuple | None = None

    def reset(self) -> None:
        """Forget every group: at the block's entry and exit, so that the watch
        holds no ProcessGroup between blocks (a group destroyed after the block
        is freed with its threads)."""
        self.known.clear()
        self._unnumbered.clear()
        self.handed = None

    def check(self, group: dist.ProcessGroup) -> list[tuple[int, str]] | None:
        """Before eagertp issues anything on ``group`` (watched from now on):
        the operations that ran on it unseen since its count was last known,
        as ``(how many, explain()'s line)``, or None."""
        known = self.known.get(group)
        if known is None:
            if group not in self._unnumbered:
                now = _sequence_number(group)
                if now is None:
                    self._unnumbered.add(group)
                else:
                    self.known[group] = now
            return None
        now = self.known[group] = group._get_sequence_number_for_group()
        return None if now == known else [self._found(group, now - known)]

    def check_all(self) -> list[tuple[int, str]] | None:
        """Before eagertp issues anything: every watched group."""
        found = None
        known = self.known
        for group, count in known.items():
            now = known[group] = group._get_sequence_number_for_group()
            if now != count:
                found = (found or []) + [self._found(group, now - count)]
        return found

    def refresh(self) -> None:
        """eagertp communicated (or the mode saw a communication op): the
        counts from now on are known."""
        known = self.known
        for group in known:
            known[group] = group._get_sequence_number_for_group()

    def _found(self, group: dist.ProcessGroup, n: int) -> tuple[int, str]:
        if self.handed is not None:
            types, func = self.handed
            names = ", ".join(sorted({t.__name__ for t in types}))
            after = f"after the mode handed {func} to {names}, whose __torch_dispatch__ may run ops with dispatch off"
        else:
            after = "from another thread, or issued with dispatch off"
        line = (
            f"{n} operation(s) on {group_str(group)} that the mode did not see ({after}): "
            "neither fused nor explained (Note [Collectives the mode did not see])"
        )
        log.warning("eagertp: %s", line)
        self.handed = None
        return n, line
