"""What the engine counts and records of the collectives it runs: the
``stats``, explain()'s records and the ordered trace's events (``eagertp.trace``),
and the matmul work that overlapped each gather (Note [Overlap accounting]).

``Accounting`` is one of ``Engine``'s parts (``eagertp.engine``): it works on
the engine's ``stats``, ``trace``, ``store``, ``matmul_work`` and
``before_collective``; ``issue_as_is`` completes what the collective reads
through the engine's completion first (``product_read``, ``complete_for``,
``complete_work_past``), checks ranks under ``verify`` and refreshes the
``unseen`` watch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from eagertp.deferred import PendingGather, tensors_in
from eagertp.patterns import AllGatherMatmulPlan
from eagertp.trace import CollectiveRecord, Meta, Reason, Text, metas_of
from eagertp.verify import check_ranks_agree


class Accounting:
    """Counting and recording the collectives the engine runs."""

    def record_unseen(self, found: list[tuple[int, str]]) -> None:
        """explain()'s lines and the stats for communication the mode did not
        see (Note [Collectives the mode did not see] in eagertp.unseen)."""
        for n, line in found:
            self.trace.unseen.append(line)
            self.stats["unseen_operations"] += n

    def count_matmul_work(self, n: int = 1) -> None:
        """``n`` matmuls are about to run while the gathers in the store are in
        flight: counted (explain() says a gather overlapped them), and each of
        those gathers watched, so that its consumers can tell whether it has
        landed by then (Note [Landed gathers]). The gather half of an
        all-reduce only once a matmul consumes it: in TP code an elementwise
        op reads the reduced tensor first (the residual add), and a watch
        costs a thread."""
        self.matmul_work += n
        for item in self.store.items:
            if isinstance(item, PendingGather) and (item.consumers or not item.half_of_all_reduce):
                assert item.handle is not None, f"all_gather ${item.tid} is pending but was never started"
                item.handle.watch()

    def _count_fused(self, gather: PendingGather, plan: AllGatherMatmulPlan) -> None:
        self.stats[plan.name] += 1
        self.stats["fused_matmuls"] += len(gather.consumers)

    def _account_gather(self, gather: PendingGather, plan: AllGatherMatmulPlan, reason: str | Reason) -> None:
        """Stats, explain() record and trace event of a completed gather."""
        overlapped = self.matmul_work - gather.work_at_start
        if gather.half_of_all_reduce or gather.produced:
            # Accounted for where it was issued (Note [Matmul + all-reduce] in
            # eagertp.collectives.all_reduce, Note [Matmul + all-gather] in
            # eagertp.collectives.all_gather); only its consumers are new.
            if plan.fused:
                self._count_fused(gather, plan)
                gather.record.then_fused_with = plan.fused_with()
            elif gather.read_by:  # its rows read chunk by chunk by another gather's steps
                gather.record.then_fused_with = [step.describe() for step in gather.read_by]
            if self.trace.recording:
                self.trace.event(*plan.trace_event(gather.backend))
            return
        if gather.scale_of:
            self.stats["fused_scale_gathers"] += 1
        if plan.fused:
            self._count_fused(gather, plan)
            scale_of = plan.scale_of() if gather.scale_of else None  # NB: most gathers are no scale's
            self.trace.mark_fused(gather.record, plan.fused_with(), gather.backend, scale_of=scale_of)
        elif gather.scale_of:
            self.trace.mark_fused(gather.record, [], gather.backend, scale_of=plan.scale_of())
        elif overlapped:
            self.stats["overlapped_all_gather"] += 1
            why = Reason("no matmul consumed it before {}; {} ran while it was in flight", reason, _matmuls(overlapped))
            self.trace.mark_unfused(gather.record, _and_made_first(why, gather), gather.backend)
        else:
            self.stats["unfused_all_gather"] += 1
            why = Reason("no matmul consumed it before {}, and none ran while it was in flight", reason)
            self.trace.mark_unfused(gather.record, _and_made_first(why, gather), gather.backend)
        if self.trace.recording:
            self.trace.event(*plan.trace_event(gather.backend))

    # -- collectives issued as written -------------------------------------

    def issue_as_is(
        self,
        func,
        args: tuple,
        kwargs: dict,
        kind: str,
        src: torch.Tensor,
        group: dist.ProcessGroup,
        reason: Text,
        signature: str,
        *,
        inputs: Sequence[torch.Tensor] = (),
    ) -> Any:
        """Run a collective exactly as the program issued it, now (after
        completing the pending work it reads), and record why it was not fused.
        ``signature`` is what ``verify=True`` compares across ranks first, as
        for a plan. ``inputs``: every input of a list or coalesced form (``src``
        is the first), each shown in explain(), as each of its outputs is."""
        if self.store.items:
            read = self.product_read(src)
            self.complete_for(func, args, kwargs)
            self.complete_work_past(func, -1 if read is None else read - 1)
        if self.verify:
            with self.issuing_work():
                check_ranks_agree(signature, group)
        result = func(*args, **kwargs)
        self.unseen.refresh()  # NB: the group counted it
        # raw c10d: (output, work), its all-reduce ([tensor], work), its list forms' outputs Tensor[][].
        outputs = tensors_in(result[0] if isinstance(result, tuple) else result)
        sources = list(inputs) or [src]
        # NB: marks no product past its collective: one issued as written
        # took none (Note [Products past their collective]). A coalesced form
        # returns a Work: its tensors are written in place.
        record = self.trace.new_collective(
            kind, src=metas_of(sources), dst=metas_of(outputs or sources), group=group
        )
        self.stats[f"unfused_{kind.split('(')[0]}"] += 1
        self.trace.mark_unfused(record, reason)
        self.trace.event("{} = {}({}, {}) [as written]", record.dst, kind, record.src, record.group)
        return result

    def new_record(
        self, kind: str, src: torch.Tensor, dst: torch.Tensor, group: dist.ProcessGroup, *, marks_past: bool = True
    ) -> CollectiveRecord:
        """The explain() record of a collective eagertp runs, with its tensors
        and group shapes (Note [Formatted when read]); also where the products
        recorded so far are marked past their collective (Note [Products past
        their collective]), unless ``marks_past`` is False. One issued as
        written records in ``issue_as_is`` and marks none."""
        if marks_past:
            self.before_collective = self.store.last_tid
        return self.trace.new_collective(kind, src=Meta.of(src), dst=Meta.of(dst), group=group)


def _and_made_first(why: Reason, gather: PendingGather) -> Reason:
    """An unfused gather's reason, with why its product did not make its shard
    as it was sent, if one could have (Note [Matmul + all-gather])."""
    return why if gather.made_first is None else Reason("{}; {}", why, gather.made_first)


def _matmuls(n: int) -> str:
    return f"{n} matmul{'s' if n != 1 else ''}"
