"""What eagertp saw and did: an ordered trace, counters, and ``explain()``.

The trace is designed for inline expectations (expecttest): tensors that eagertp
created are named by short ids in creation order (``$0``, ``$1``), other tensors
by dtype and shape only, and nothing prints an address. A forward pass of a
column-parallel linear on 2 ranks renders as::

    $0: f32[8, 16] = all_gather(f32[4, 16], group '1' (2 ranks))
    $1: f32[8, 32] = mm($0, f32[16, 32])
    flush: aten.gelu.default read $1
    all_gather_matmul($0 -> $1) [ring]

Every record holds strings, numbers and shapes only, never tensors, and both
logs are bounded (``max_records``), so a mode left on for thousands of steps does
not grow.

Note [Formatted when read]
--------------------------
Every collective and every deferred matmul records something, on the hot path,
and most of it is never read. So events, reasons and the explain() records keep
what they will say (shapes as ``Meta``, ids, op names) and format it when
someone reads the trace: ``Trace.event(render, *args)``, ``Lazy``, ``Reason``.
Formatting everything when it happened cost up to 8% of the instructions
eagertp adds to a fused call (the all-reduce's; ``benchmarks/call_instructions.py``,
benchmarks/NOTES.md, 2026-12-02 at ea603cc).

Note [The ordered trace when asked]
-----------------------------------
The records behind ``explain()`` and the counters are always kept: they are
what says that a collective fused, or why not (Invariant 4). The ordered
trace of events (every deferred matmul, wait and flush: ``debug_string()``)
is a debugging tool, kept only under ``EagerMicroPipeline(trace=True)``, as
torch's DebugMode records only while it is on. Even unformatted, recording
it cost 4-7% of the instructions eagertp adds to a fused call and 15% of a
deferred matmul's (reading shapes and dtypes for its line), every call of
every step (``benchmarks/call_instructions.py``; benchmarks/results/
call_instructions_2cpu_2026-12-04_83dc4f9.md). So the hot paths ask
``Trace.recording`` before they build an event's arguments.

Note [Sums of all-reduced tensors]
----------------------------------
A plan that makes several linears column-parallel on one input, each taking
it alone (DTensor's ``ColwiseParallel`` on q, k and v; HF's ``"colwise"``),
all-reduces each one's input gradient in backward, and autograd then adds
the results: n all-reduces of a full activation where one all-reduce of the
sum would do (the sum-reduction is linear). eagertp cannot merge them (a rank
that read one of them first would send other messages than its peer:
Invariant 2), so ``explain()`` says so once, in a hint line, where a
row-wise ``add`` on the gather halves of two sum-all-reduces on one group
shows it: how many all-reduces were added to each other, how many fewer a
plan that sums first issues, the first such sum by its records' numbers,
and the fix (docs/tuning.md, "One collective per region").

Note [One shard gathered twice]
-------------------------------
The same plans with sequence parallelism (``ColwiseParallel(input_layouts=
Shard(1))`` on q, k and v) gather the same shard once per linear: n
all-gathers of one tensor in forward, and n reduce-scatters of its gradient
in backward. A gather that starts while another gather in flight on the
same group may still send from the same tensor is noted
(``Deferring._note_gathered``), and ``explain()`` says so in a hint line, as
for sums of all-reduces: q's gather is still in flight when k's starts
(nothing reads q's product before attention). The tensor itself, and only
while a gather in flight holds it and has not seen it written
(``PendingStore.sending``: a write to a shard in flight takes its gather out,
Note [Sends from the shard] in eagertp.engine). eagertp keeps no reference
of its own for this (a weak one would count as a reader of an absorbed
product's output, and keep weight gradients' inputs from being found
orphaned), and compares no storages (one freed and reused holds other
data). Gathers of one tensor that do not overlap (an MLP's gate, read by its
activation before the up projection's gather) go unnoticed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from eagertp._format import group_str, tensor_str

log = logging.getLogger(__name__)

# A tensor id in the trace ($12): which tensor, not what happened to it.
_TENSOR_ID = re.compile(r"\$\d+")


class Meta(NamedTuple):
    """What the trace keeps of a tensor: enough for ``f32[8, 32]``."""

    dtype: torch.dtype
    shape: torch.Size

    @staticmethod
    def of(t: torch.Tensor) -> Meta:
        # NB: tuple.__new__, as NamedTuple's own __new__ (a Python frame) would.
        return _new_tuple(Meta, (t.dtype, t.shape))

    def __str__(self) -> str:
        return tensor_str(self)


_new_tuple = tuple.__new__


class Metas(tuple):
    """What the trace keeps of the tensors of a list or coalesced collective,
    rendered ``[f32[4, 8], f32[4, 8]]``."""

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self))}]"


def metas_of(tensors: list[torch.Tensor]) -> Meta | Metas:
    """``Meta`` of one tensor alone, else ``Metas`` of each."""
    return Meta.of(tensors[0]) if len(tensors) == 1 else Metas(Meta.of(t) for t in tensors)


# One line of the ordered trace: ``render(*args)``, formatted when read. A plain
# tuple: one is recorded per deferred matmul, on the hot path.
Event = tuple[Callable[..., str], tuple]


class Lazy:
    """``render(*args)``, formatted only when someone reads it (Note [Formatted
    when read]); ``args`` hold no tensors."""

    __slots__ = ("render", "args")

    def __init__(self, render: Callable[..., str], *args: Any) -> None:
        self.render, self.args = render, args

    def __str__(self) -> str:
        return self.render(*self.args)


class Reason(Lazy):
    """Why something happened: ``template.format(*args)``, formatted only when
    someone reads it."""

    __slots__ = ()

    def __init__(self, template: str, *args: Any) -> None:
        self.render, self.args = template.format, args


Text = str | Lazy  # what renders as text when read


def _join(texts: list[Text]) -> str:
    return ", ".join(map(str, texts))


@dataclasses.dataclass
class CollectiveRecord:
    """One all-gather, reduce-scatter or all-reduce the mode saw, and what became of it.

    ``fused_with`` names the consumers it was fused with (and ``scale_of`` the
    fused matmuls a gathered FP8 scale fed); otherwise ``reason`` says why it
    was not fused. Exactly one of the two is set once the
    collective has completed; before, it is in flight.
    """

    kind: str  # "all_gather" | "reduce_scatter(op)" | "all_reduce(op)"
    index: int  # per-kind sequence number within the block
    src: Meta | Metas  # the input, rendered "f32[4, 16]" (a list form's: each)
    dst: Meta | Metas  # the output
    group: str
    backend: str | None = None
    # What the records below hold renders as text (``str``, ``Lazy``, ``Reason``):
    # Note [Formatted when read].
    fused_with: list[Text] | None = None
    reason: Text | None = None
    # A gathered row-wise FP8 scale: the fused matmuls it is scale_a of.
    scale_of: list[Text] | None = None
    # A fused all-reduce, or a gather of a product: the matmuls its gathered
    # tensor fed, once completed (Note [Matmul + all-reduce] in
    # eagertp.collectives.all_reduce, Note [Matmul + all-gather] in
    # eagertp.collectives.all_gather).
    then_fused_with: list[Text] | None = None

    def outcome(self) -> str:
        """What became of it, without which one it was: ``fused [ring]``,
        ``not fused [ring]: <reason>`` with tensor ids as ``$…``, ``in flight``;
        what ``explain(summary=True)`` counts."""
        if self.fused_with is not None:
            return f"fused [{self.backend}]"
        if self.reason is None:
            return "in flight"
        via = f" [{self.backend}]" if self.backend else ""
        return f"not fused{via}: {_TENSOR_ID.sub('$…', str(self.reason))}"

    def render(self) -> str:
        head = f"{self.kind} #{self.index} {self.src} -> {self.dst} on {self.group}"
        if self.fused_with is not None:
            roles = [f"fused with {_join(self.fused_with)}"] if self.fused_with else []
            if self.scale_of:
                roles.append(f"fused as scale_a of {_join(self.scale_of)}")
            roles += self._then()
            return f"{head}: {'; '.join(roles)} [{self.backend}]"
        if self.reason is None:
            return f"{head}: in flight" + (f" [{self.backend}]" if self.backend else "")
        via = f" [{self.backend}]" if self.backend else ""
        # NB: an all-reduce whose input is no product still leaves its gather
        # half in flight, which later ops may fuse with (HF's embedding
        # all-reduce, read by the first norm and q, k, v).
        return "; ".join([f"{head}: not fused{via}: {self.reason}", *self._then()])

    def _then(self) -> list[str]:
        """What the gathered tensor fused with, once completed."""
        if not self.then_fused_with:
            return []
        what = "its all-gather half" if self.kind.startswith("all_reduce") else "then the gathered tensor"
        return [f"{what} fused with {_join(self.then_fused_with)}"]

    __str__ = render


# Terms kept per sum of all-reduced tensors (Note [Sums of all-reduced
# tensors]): a running sum of every all-reduce in a long block stays bounded
# (later terms go uncounted).
_MAX_SUMMED = 64

# What the hints of Note [Sums of all-reduced tensors] and Note [One shard
# gathered twice] advise: one fix for both.
_HINT_FIX = (
    "with DTensor, PrepareModuleInput on the module whose input their linears share "
    "(docs: tuning, 'One collective per region')"
)


class Trace:
    """Bounded, ordered trace of events plus the per-collective records.

    The records (``explain()``) are always kept; the ordered events only when
    ``events`` (Note [The ordered trace when asked])."""

    def __init__(self, *, max_records: int, events: bool) -> None:
        # NB: the hot paths ask this before they build an event's arguments.
        self.recording = events
        self.events: collections.deque[Event] = collections.deque(maxlen=max_records)
        self.collectives: collections.deque[CollectiveRecord] = collections.deque(
            maxlen=max_records
        )
        self.dropped = 0  # collective records pushed out of the bounded log
        # Collectives issued in the block, on any group (Note [Deferrals that
        # gained nothing] in eagertp.deferring).
        self.issued = 0
        self._next_index: collections.Counter[str] = collections.Counter()
        # (op, group) -> count: collectives on groups the pipeline does not
        # manage, passed through untouched (bounded by the program's ops x groups).
        self.passed_through: collections.Counter[tuple[str, str]] = collections.Counter()
        # Communication on managed groups the mode did not see (Note
        # [Collectives the mode did not see] in eagertp.unseen), one line each.
        self.unseen: list[str] = []
        self._groups: dict[str, str] = {}  # group name -> group_str(group)
        # Sum-all-reduces whose results the program added to each other, as
        # (group, their numbers), one entry per sum: Note [Sums of all-reduced
        # tensors]. Bounded as the records are.
        self.summed: collections.deque[tuple[str, list[int]]] = collections.deque(maxlen=max_records)
        # (the gather that sent a shard first, a later one of the same shard,
        # its group): Note [One shard gathered twice]. Bounded as the records are.
        self.regathered: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=max_records)

    def event(self, render: str | Callable[..., str], *args: Any) -> None:
        """Record ``render(*args)`` (or ``render.format(*args)`` for a template);
        ``args`` must hold no tensors (use ``Meta.of``). Nothing unless the
        trace records events."""
        if not self.recording:
            return
        if isinstance(render, str):
            render, args = (render.format, args) if args else (str, (render,))
        self.events.append((render, args))

    def new_collective(
        self, kind: str, *, src: Meta | Metas, dst: Meta | Metas, group: dist.ProcessGroup
    ) -> CollectiveRecord:
        # NB: rendered once per group and block; keyed by name, so that the
        # trace holds no group (a destroyed group's threads end with it).
        group_text = self._groups.get(group.group_name)
        if group_text is None:
            group_text = self._groups[group.group_name] = group_str(group)
        record = CollectiveRecord(
            kind, self._next_index[kind], src=src, dst=dst, group=group_text
        )
        self._next_index[kind] += 1
        self.issued += 1
        if len(self.collectives) == self.collectives.maxlen:
            self.dropped += 1
        self.collectives.append(record)
        return record

    def mark_unfused(
        self, record: CollectiveRecord, reason: Text, backend: str | None = None
    ) -> None:
        record.reason = reason
        record.backend = backend
        if log.isEnabledFor(logging.DEBUG):  # NB: Logger.debug asks it too, one frame deeper: every record
            log.debug("eagertp: %s", record)

    def mark_fused(
        self, record: CollectiveRecord, fused_with: list[Text], backend: str, *, scale_of: list[Text] | None = None
    ) -> None:
        record.fused_with = fused_with
        record.scale_of = scale_of or None
        record.backend = backend
        if log.isEnabledFor(logging.DEBUG):  # NB: Logger.debug asks it too, one frame deeper: every record
            log.debug("eagertp: %s", record)

    def pass_through(self, func: Any, group: str) -> None:
        """Count a collective on ``group``, which the pipeline does not manage."""
        self.issued += 1
        key = (str(func), group)
        if key not in self.passed_through:
            log.debug("eagertp: %s on %s passes through: not a managed group", *key)
        self.passed_through[key] += 1

    def note_summed(self, a: CollectiveRecord, b: CollectiveRecord) -> None:
        """The results of sum-all-reduces ``a`` and ``b`` (one group) were
        added to each other (Note [Sums of all-reduced tensors])."""
        # NB: a sum's terms are added one after another, so a term joins one of
        # the latest sums; look back a few only (off the hot path: rare adds).
        joined = None
        for i in range(len(self.summed) - 1, max(len(self.summed) - 8, 0) - 1, -1):
            group, indices = self.summed[i]
            if group == a.group and (a.index in indices or b.index in indices):
                if joined is None:
                    joined = indices
                    indices = [a.index, b.index]
                else:  # both already in sums of their own: one sum now
                    del self.summed[i]
                for n in indices:  # NB: a loop, not a generator's frames
                    if n not in joined and len(joined) < _MAX_SUMMED:
                        joined.append(n)
        if joined is None:
            self.summed.append((a.group, [a.index, b.index]))
        else:
            joined.sort()

    def note_regathered(self, earlier: int, record: CollectiveRecord) -> None:
        """All-gather ``record`` sends the shard that all-gather number
        ``earlier`` sent (Note [One shard gathered twice])."""
        self.regathered.append((earlier, record.index, record.group))

    def _hint_regathered(self) -> list[str]:
        """The hint line of Note [One shard gathered twice], if any."""
        if not self.regathered:
            return []
        earlier, index, group = self.regathered[0]
        n = len(self.regathered)
        return [
            f"hint: {n} all-gather{'s' if n > 1 else ''} sent a shard an earlier all-gather had sent, unchanged "
            f"(the first: all_gather #{index}, what #{earlier} sent, on {group}); gathering each shard once would "
            f"issue {n} fewer: {_HINT_FIX}"
        ]

    def _hint_summed(self) -> list[str]:
        """The hint line of Note [Sums of all-reduced tensors], if any."""
        if not self.summed:
            return []
        terms, sums = sum(len(indices) for _, indices in self.summed), len(self.summed)
        group, first = self.summed[0]
        numbers = ", ".join(f"#{n}" for n in first)
        return [
            f"hint: {terms} all-reduces were added to each other, in {sums} sum{'s' if sums > 1 else ''} "
            f"(the first: all_reduce(sum) {numbers} on {group}); summing before all-reducing would issue "
            f"{terms - sums} fewer: {_HINT_FIX}"
        ]

    def debug_string(self) -> str:
        if not self.recording:
            raise RuntimeError(
                "debug_string(): this EagerMicroPipeline records no ordered trace; construct it with "
                "EagerMicroPipeline(trace=True) to record one (explain() and stats are always kept)"
            )
        return "\n".join(render(*args) for render, args in self.events)

    def explain(self, *, summary: bool = False, managed: str | None = None) -> str:
        """``managed``: the group the pipeline manages (None: every group)."""
        if not self.collectives and not self.dropped:
            head = "eagertp: no all-gather, reduce-scatter or all-reduce seen on a managed group"
            lines = [head if managed is None else f"{head} ({managed})"]
        else:
            lines = self._summary() if summary else [r.render() for r in self.collectives]
        if self.dropped:
            lines.insert(0, f"({self.dropped} earlier records dropped)")
        lines += self._hint_regathered()
        lines += self._hint_summed()
        lines += self.unseen
        # NB: a group= that names another group than the program's collectives
        # use fuses nothing; these lines say which groups those were.
        lines += [
            f"{n} x {op} on {group}: passed through, not a managed group"
            for (op, group), n in self.passed_through.items()
        ]
        return "\n".join(lines)

    def _summary(self) -> list[str]:
        """A line per kind of collective and what became of it, with its count,
        in the order each first happened."""
        counts = collections.Counter((r.kind, r.outcome()) for r in self.collectives)
        fused = sum(n for (_, outcome), n in counts.items() if outcome.startswith("fused"))
        in_flight = sum(n for (_, outcome), n in counts.items() if outcome == "in flight")
        total = len(self.collectives)
        head = f"{total} collectives on managed groups: {fused} fused, {total - fused - in_flight} not fused"
        if in_flight:
            head += f", {in_flight} in flight"
        return [head, *(f"{n:>6} x {kind} {outcome}" for (kind, outcome), n in counts.items())]
