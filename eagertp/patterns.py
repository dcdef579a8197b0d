"""Patterns: turn one ready piece of pending work into a plan for a backend.

A plan is what a flush hands a backend: the buffers, the group, and the
per-chunk callable (a *consumer* of each gathered chunk, or a *producer* of each
chunk to reduce-scatter). Every plan also keeps the unfused program it replaces
as real code (``reference``), which ``verify=True`` and the tests compare against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from eagertp._format import group_str, tensor_str
from eagertp.backends import Backend
from eagertp.backends.base import (
    ChunkConsumer, ChunkProducer, GatherHandle, OrderedConsumer, RowsConsumer, ShardProducer, chunk_rows, piece_dim,
    whole_rows,
)
from eagertp.backends.reference import ReferenceBackend
from eagertp.deferred import (
    GatheredView, Operand, PendingGather, PendingMatmul, Product, RowSelect, ScatterView, all_rows, rows_as_runs,
)
from eagertp.trace import CollectiveRecord, Meta, Reason, Text

aten = torch.ops.aten


# Note [Landed gathers]
# A gather whose chunks have all landed by the time its consumers run (other
# work hid the whole transfer) has nothing left to overlap: its matmuls run on
# the whole gathered tensor, one call each, as plain eager runs them, instead of
# W smaller calls (each a little less efficient: ~3% for two [512, 1024] @
# [1024, 2048] against one [1024, 1024] one on these CPUs). Only the host's view
# counts, where it is cheap to ask: NCCL's and gloo's collective Work tell
# (the ring on NCCL, the reference backend, the ring's helper thread on gloo),
# and symm_mem never says so (its consumers are enqueued behind events, costing
# the host nothing). gloo's point-to-point Work says it completed only once
# waited for, so the 2-rank ring on gloo is watched: when matmul work is about
# to run while a gather is in flight (a prefetch), a thread starts waiting for
# its receives (``Engine.count_matmul_work``), and the consumers see which have
# landed. A gather that nothing overlapped is not watched and stays chunked.
# (Before, a prefetch on gloo was taken as landed: plain eager's schedule, the
# work, the wait, one matmul, which threw away the overlap of the consumer
# with the transfer's tail: 1.2-1.3x the hand schedule at comm > compute.)
# The tests switch it off by default, so that they prove the chunked path, which
# a transfer of test-sized tensors would otherwise almost always skip.
WHOLE_WHEN_LANDED = True


@dataclasses.dataclass(eq=False)
class AllGatherMatmulPlan:
    """Fuse the pattern::

        ag = all_gather_into_tensor(shard, group)     # gather dim 0
        G = ag.view(W*r, C)                           # r rows per rank
        out_j = mm(G, B_j) | mm(G.t(), H_j) | mm(H_j, G)   (or addmm, any number)

    into one micro-pipelined call whose consumer runs, for the chunk of rank i,
    each matmul's share of the work (Note [Matmul operands of a gather]),
    writing into the placeholders. The gather started where the program issued
    it; the plan binds the consumers to it and completes it. With no consumers
    this is the gather alone: the same messages.
    """

    gather: PendingGather
    # Scale gathers in flight whose rows the consumers read as scale_a: rank i's
    # chunk of each is waited for before rank i's first piece and read from
    # there; the engine completes them after the run (Note [Gathered row-wise
    # scales]).
    scales: list[PendingGather] = dataclasses.field(default_factory=list)
    whole: bool = False  # every chunk had landed: consumers ran on whole tensors
    kind = "all_gather"
    # NB: attributes, not properties: read several times per fused call. The
    # consumers are bound by then: the plan completes the gather.
    fused: bool = dataclasses.field(init=False)
    name: str = dataclasses.field(init=False)  # the stats key and profiler range
    handle: GatherHandle = dataclasses.field(init=False)  # the gather's, started

    def __post_init__(self) -> None:
        self.fused = bool(self.gather.consumers)
        self.name = "all_gather_matmul" if self.fused else "all_gather"
        self.handle = self.gather.handle
        assert self.handle is not None, f"all_gather ${self.gather.tid} completed before it started"

    @property
    def record(self) -> CollectiveRecord:
        return self.gather.record

    @property
    def group(self) -> dist.ProcessGroup:
        return self.gather.group

    @property
    def buffer(self) -> torch.Tensor:
        """A tensor of the collective (its device picks the backend)."""
        return self.gather.shard

    def fused_with(self) -> list[Text]:
        consumers: list[Text] = []
        for mm in self.gather.consumers:  # NB: a loop, not a comprehension's frame: every fused gather
            consumers.append(mm.describe())
        g = self.gather
        if consumers and (g.steps or g.wholes):  # Note [Row-wise ops on gathered rows] in eagertp.rowwise
            parts = [f"{', '.join(step.name for step in g.steps)} (row by row)"] if g.steps else []
            if g.wholes:
                parts.append(f"{', '.join(step.name for step in g.wholes)} (over the rows, once landed)")
            consumers[0] = Reason("{} -> {}", "; ".join(parts), consumers[0])
        return consumers

    def scale_of(self) -> list[str]:
        """The fused matmuls whose row-wise ``scale_a`` this gather is (asked
        only of a gather that is one: ``gather.scale_of``)."""
        return [mm.describe() for mm in self.gather.scale_of]

    def lands_whole(self) -> bool:
        """True if every chunk has landed already (a prefetch that other work
        hid), so the consumers should run on the whole tensors at once: one
        matmul each, as plain eager runs them, with nothing left to overlap
        (Note [Landed gathers])."""
        return WHOLE_WHEN_LANDED and self.fused and bool(self.handle.landed())

    def run(self, *, whole: bool = False, own_chunk_unread: bool = False) -> None:
        """Bind the consumers to the gather in flight and complete it: chunk by
        chunk, or on the whole tensors (``lands_whole``; then ``scales`` must
        be empty: the whole matmuls read whole scales). ``own_chunk_unread``:
        nothing reads the gathered tensor after the consumers (Note [This
        rank's chunk, unread] in eagertp.engine)."""
        handle = self.handle
        assert not (whole and self.scales), "whole consumers read scales completed first"
        self.whole = whole
        if self.whole:
            handle.consume(None)
            g = self.gather
            self._compute_whole(g.out, [v.tensor for v in g.views[1:]], [mm.out for mm in g.consumers], _landed)
        else:
            handle.consume(self.consumer(), own_chunk_unread=own_chunk_unread)

    def signature(self) -> str:
        """What every rank must agree on for the messages to match."""
        return gather_signature(self.gather.shard)

    def checks(self) -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
        """(what, got, plain eager, exact?) for every tensor this plan wrote."""
        g = self.gather
        assert g.reference is not None, "verify=True gathers plain eager's result when the gather starts"
        view_refs, mm_refs = self.reference(g.reference)
        what = f"all_gather {tensor_str(g.shard)} -> {tensor_str(g.out)} on {group_str(g.group)}"
        checks = [
            (what if v.dim == 0 else f"{what}, seen along dim {v.dim}", v.tensor, ref, True)
            for v, ref in zip(g.views, view_refs)
        ]
        for mm, ref in zip(g.consumers, mm_refs):
            checks.append((f"{mm.op} of {what} with B {_b_str(mm)}", mm.out, ref, False))
        return checks

    def consumer(self) -> ChunkConsumer | None:
        g = self.gather
        # Views gathered along dim > 0 are filled piece by piece too (the copy
        # plain eager's cat would do, overlapped with the transfers), unless the
        # program can no longer see them (a cat that only fed the matmuls). Cast
        # views hold the data their consumers read; verify checks every view.
        # NB: loops, not comprehensions: once per gather, most lists empty.
        steps = []
        for view in g.views[1:]:
            if not view.derived and (view.cast or g.reference is not None or view.observed()):
                steps.append(view.fill)
        # Row-wise ops on the rows, in program order, before the matmuls that
        # read their results (Note [Row-wise ops on gathered rows] in eagertp.rowwise).
        for step in g.steps:
            steps.append(step.run)
        accumulates = False  # a contraction over the gathered rows adds every chunk's product into one output
        if g.consumers:
            whole = g.out.view(g.group.size(), *g.shard.shape)  # whole[i]: rank i's shard, once arrived
            for mm in g.consumers:
                steps.append(_chunk_step(mm, whole, None if mm.scale_gather is None else self._scale_rows(mm)))
                accumulates = accumulates or mm.operand is not Operand.ROWS
        if not steps:
            return None

        kind = OrderedConsumer if accumulates else RowsConsumer
        if len(steps) == 1 and not self.scales:  # NB: the step itself, one frame shorter per piece: most gathers
            return kind(steps[0])
        # NB: no comprehension's frame where there are no scales (most gathers).
        scale_handles, scales_landed = [s.handle for s in self.scales] if self.scales else [], set()

        def consume(piece: torch.Tensor, src: int, rows: slice) -> None:
            if scale_handles and src not in scales_landed:
                for scale in scale_handles:  # rank src's scale rows, before its data rows' matmuls
                    scale.wait_chunk(src)
                scales_landed.add(src)
            for step in steps:
                step(piece, src, rows)

        return kind(consume)

    def _scale_rows(self, mm: PendingMatmul) -> ScaleRows | None:
        """Where ``mm``'s consumer reads its ``scale_a`` rows, if from a scale
        gather in flight: rank src's chunk of it, as soon as that has landed
        (a view gathered along dim > 0 is filled only when the scale gather
        completes). Its rows follow the data shard's (``eagertp.operands``)."""
        scale = mm.scale_gather
        if scale is None or not any(scale is s for s in self.scales):
            return None
        per_rank = scale.out.view(scale.group.size(), -1)  # [W, rows of one data shard]
        per_shard_row = _rows_per_piece_row(self.gather.shard, self.gather.shard.shape[-1])  # rows of A per shard row

        def scale_rows(src: int, rows: slice) -> torch.Tensor:
            return per_rank[src, rows.start * per_shard_row : rows.stop * per_shard_row].view(-1, 1)

        return scale_rows

    def trace_event(self, backend: str) -> tuple:
        """``(render, *args)`` for ``Trace.event``, once run: no tensors kept,
        formatted when read (Note [Formatted when read] in eagertp.trace)."""
        g = self.gather
        consumers = [mm.tid for mm in g.consumers] if g.consumers else []
        scale_of = [mm.tid for mm in g.scale_of] if g.scale_of else []
        return _render_gather_plan, self.name, g.tid, consumers, scale_of, self.whole, backend

    def reference(self, ag: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Plain eager, given its gathered tensor ``ag``: the cats, then every
        matmul on whole tensors."""
        g = self.gather
        views = [torch.empty_like(v.tensor) for v in g.views[1:]]
        results = [torch.empty_like(mm.out) for mm in g.consumers]
        self._compute_whole(ag, views, results, _reference)
        return [ag, *views], results

    def _compute_whole(
        self,
        ag: torch.Tensor,
        views: list[torch.Tensor],
        results: list[torch.Tensor],
        other: Callable[[PendingGather], torch.Tensor],
    ) -> None:
        """Plain eager from the whole gathered tensor ``ag``: each view but the
        first (the gather itself) into ``views`` (derived views by the row-wise
        steps, which read another gather's whole tensor as ``other`` gives it),
        each consumer into ``results``."""
        g = self.gather
        data = {id(g.views[0]): ag}
        for v, target in zip(g.views[1:], views):
            if not v.derived:
                target.copy_(torch.cat(ag.chunk(v.world), v.dim) if v.dim else ag)  # NB: copy_ casts
            data[id(v)] = target
        for step in g.steps:
            for op in step.operands:
                if op.other is not None and id(op.other) not in data:
                    data[id(op.other)] = other(op.other)
            step.run_whole(data)
        for mm, target in zip(g.consumers, results):
            a, b = _whole_operands(mm, data[id(mm.view)])
            mm.compute(a, b, target)


@dataclasses.dataclass(eq=False)
class ReduceScatterPlan:
    """``out = reduce_scatter_tensor(inp, reduce_op, group)`` (scatter dim 0),
    where ``inp`` is either a tensor or the output of a deferred matmul.

    Fused, it replaces::

        C = mm(A, B)                                  # or addmm(bias, A, B)
        out = reduce_scatter_tensor(C, op, group)     # rank i keeps rows i*m:(i+1)*m

    with a producer that computes only the rows of chunk ``c`` when the ring
    needs them, ``C[c*m:(c+1)*m] = A[c*m:(c+1)*m] @ B``, so the matmul of one
    chunk overlaps the transfer of the previous partial sum. ``C`` itself is
    computed only if the program reads it afterwards (its placeholder exists,
    as plain eager's output would).
    """

    out: torch.Tensor  # [M / W, ...]
    reduce_op: str
    group: dist.ProcessGroup
    record: CollectiveRecord
    inp: torch.Tensor | None = None  # unfused: the tensor to reduce-scatter
    product: Product | None = None  # fused: the matmul (or sum of matmuls) to produce
    scatter_view: ScatterView | None = None  # fused, scattering along dim > 0
    kind = "reduce_scatter"
    # NB: attributes, not properties: read several times per fused call.
    fused: bool = dataclasses.field(init=False)
    name: str = dataclasses.field(init=False)  # the stats key and profiler range

    def __post_init__(self) -> None:
        self.fused = self.product is not None
        self.name = "matmul_reduce_scatter" if self.fused else "reduce_scatter"

    @property
    def buffer(self) -> torch.Tensor:
        """A tensor of the collective (its device picks the backend)."""
        return self.out

    def fused_with(self) -> list[str]:
        assert self.product is not None, "an unfused reduce-scatter fused with nothing"
        return [self.product.describe()]

    def run(self, backend: Backend) -> None:
        """The whole reduce-scatter, now."""
        backend.produce_reduce_scatter(self.producer(), self.out, self.group, self.reduce_op)

    def signature(self) -> str:
        """What every rank must agree on for the messages to match."""
        return scatter_signature(self.reduce_op, tensor_str(self.out))

    def checks(self) -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
        what = f"reduce_scatter({self.reduce_op}) -> {tensor_str(self.out)} on {group_str(self.group)}"
        if self.product is not None:
            what = f"{self.product.describe()} then {what}"
        return [(what, self.out, self.reference(), self.product is None)]

    def producer(self) -> ChunkProducer:
        if self.product is None:
            assert self.inp is not None, "a reduce-scatter plan needs an input or a matmul"
            return _copy_chunks(self.inp.view(self.group.size(), *self.out.shape))
        product, sv = self.product, self.scatter_view
        n = product.out.shape[1]
        if sv is not None and sv.dim == len(sv.shape) - 1:
            # Scattering the output's columns: chunk c is out[:, block c], made
            # from B's columns (as torch's fused op does for the last dim).
            block = n // sv.world

            def produce_chunk(c: int, buf: torch.Tensor, select: RowSelect) -> None:
                product.compute_cols(slice(c * block, (c + 1) * block), buf.view(-1, block), select)

            return self._in_pieces(produce_chunk, block)
        runs = 1  # runs of contiguous operand rows that make one chunk
        if sv is None:
            m = self.out.numel() // n  # rows per chunk
            flat = chunk_rows(self.out)
            per_row, odd = divmod(flat.shape[1], n)  # product rows per row of flat
            if not odd:
                # NB: the hot path (a reduce-scatter along dim 0): each piece is
                # a range of the product's rows, computed with no selector's frames.
                total = flat.shape[0]

                def produce(c: int, buf: torch.Tensor, rows: slice) -> None:
                    start, stop, _ = rows.indices(total)
                    product.compute_row_range(
                        c * m + start * per_row, c * m + stop * per_row,
                        buf if buf.dim() == 2 and buf.shape[1] == n else buf.view(-1, n),
                    )

                return produce

            def select_for(c: int) -> RowSelect:
                return lambda t: t[c * m : (c + 1) * m]

        else:
            # Chunk c holds the rows of out.view(sv.shape) whose index along
            # sv.dim lies in block c: select the same rows of every operand.
            # They are `runs` runs of contiguous rows, one per index of the
            # dims before sv.dim ([B, S/W, K] of [B, S, K]: B runs).
            lead, block = sv.shape[:-1], sv.shape[sv.dim] // sv.world
            runs = math.prod(lead[: sv.dim])
            # In rows of the operands seen as [M, X] (Note [Runs as one view]
            # in eagertp.deferred): runs of block * inner rows, stride apart.
            inner = math.prod(lead[sv.dim + 1 :])
            length, stride, total = block * inner, lead[sv.dim] * inner, math.prod(lead)

            def runs_for(c: int) -> RowSelect:  # [runs, rows per run, X]: views, no copy
                def runs_of(t: torch.Tensor) -> torch.Tensor:
                    found = rows_as_runs(t, total, runs, length, stride, c * length)  # NB: one view, not three
                    if found is not None:
                        return found
                    return t.reshape(*lead, t.shape[-1]).narrow(sv.dim, c * block, block).reshape(runs, -1, t.shape[-1])

                return runs_of

            def select_for(c: int) -> RowSelect:  # the runs as one matrix: a copy
                return lambda t: runs_for(c)(t).reshape(-1, t.shape[-1])

        def produce_chunk(c: int, buf: torch.Tensor, select: RowSelect) -> None:
            if runs > 1 and select is all_rows:
                # NB: one matmul per run of rows, written in place, rather than
                # copying the strided rows of every operand into one matrix.
                product.compute_rows(runs_for(c), buf.view(runs, -1, n))
                return
            chunk = select_for(c)
            rows = buf if buf.dim() == 2 and buf.shape[1] == n else buf.view(-1, n)
            product.compute_rows(chunk if select is all_rows else lambda t: select(chunk(t)), rows)

        return self._in_pieces(produce_chunk, n)

    def _in_pieces(self, produce_chunk: Callable[[int, torch.Tensor, RowSelect], None], width: int) -> ChunkProducer:
        """The producer of rows ``rows`` of chunk c (``chunk_rows``: [-1, last
        dim] of ``out``) from ``produce_chunk(c, buf, select)``, which computes
        the product's rows ``select`` picks out of chunk c's, each ``width`` wide."""
        flat = chunk_rows(self.out)
        per_row, odd = divmod(flat.shape[1], width)  # product rows per row of flat

        n = flat.shape[0]

        def produce(c: int, buf: torch.Tensor, rows: slice) -> None:
            start, stop, _ = rows.indices(n)
            if start == 0 and stop == n:
                produce_chunk(c, buf, all_rows)
            elif not odd:
                produce_chunk(c, buf, lambda t: t[start * per_row : stop * per_row])
            else:  # a row of out does not hold whole rows of the product: make the chunk, keep the piece
                whole = torch.empty_like(flat)
                produce_chunk(c, whole, all_rows)
                buf.copy_(whole[rows])

        return produce

    def trace_event(self, backend: str) -> tuple:
        """``(render, *args)`` for ``Trace.event``, once run: no tensors kept."""
        src = self.product.tid if self.product is not None else Meta.of(self.inp)
        return _render_scatter_plan, self.name, self.reduce_op, src, backend

    def reference(self) -> torch.Tensor:
        """Plain eager: the whole matmul, then the collective."""
        if self.product is None:
            full = self.inp
        else:
            sv = self.scatter_view
            full = torch.empty_like(self.product.out)
            self.product.compute_all(full)
            if sv is not None:
                full = torch.cat(full.view(sv.shape).chunk(sv.world, sv.dim), 0)
        out = torch.empty_like(self.out)
        chunks = full.reshape(self.group.size(), *self.out.shape)
        ReferenceBackend().produce_reduce_scatter(_copy_chunks(chunks), out, self.group, self.reduce_op)
        return out


Plan = AllGatherMatmulPlan | ReduceScatterPlan

# scale_rows(src, rows): the scale_a rows [r, 1] of rows ``rows`` of rank src's shard.
ScaleRows = Callable[[int, slice], torch.Tensor]


def _landed(gather: PendingGather) -> torch.Tensor:
    """``gather``'s whole tensor, once every chunk has landed: another gather
    that a row-wise step reads (Note [Row-wise ops on gathered rows] in
    eagertp.rowwise), waited for chunk by chunk and left in flight."""
    if not gather.completed:
        for src in range(gather.group.size()):
            gather.handle.wait_chunk(src)
    return gather.out


def _reference(gather: PendingGather) -> torch.Tensor:
    assert gather.reference is not None, "verify=True gathers plain eager's result when the gather starts"
    return gather.reference


def _render_gather_plan(
    name: str, tid: int, consumers: list[int], scale_of: list[int], whole: bool, backend: str
) -> str:
    arrow = f" -> {', '.join(f'${t}' for t in consumers)}" if consumers else ""
    scale = f", scale_a of {', '.join(f'${t}' for t in scale_of)}" if scale_of else ""
    landed = ", landed: whole" if whole else ""  # NB: also a prefetch taken as landed
    return f"{name}(${tid}{arrow}{scale}{landed}) [{backend}]"


def _render_scatter_plan(name: str, reduce_op: str, src: int | Meta, backend: str) -> str:
    """``src``: the id of the product it was fused with, else its input's shape."""
    return f"{name}({reduce_op}, {f'${src}' if isinstance(src, int) else src}) [{backend}]"


def gathered_product(found: tuple[Product, ScatterView | None] | None, shard: torch.Tensor) -> Product | None:
    """The pending product that makes ``shard``, an all-gather's input, if the
    gather can make it piece by piece as it sends it (Note [Matmul +
    all-gather] in eagertp.collectives.all_gather): ``found`` is the store's
    ``standalone_output(shard)``; each row of ``shard`` must hold whole rows of
    the product's output (the pieces are rows of ``shard``)."""
    if found is None or found[1] is not None:
        return None
    product = found[0]
    if shard.dim() < 2 or _rows_per_piece_row(shard, product.out.shape[1]) is None:
        return None
    return product


def shard_producer(product: Product, shard: torch.Tensor) -> ShardProducer:
    """The producer of rows ``rows`` of ``shard``, the whole output of
    ``product`` in a row-major view: the product's rows they hold, written in
    place (``gathered_product`` checked that they are whole rows)."""
    n = product.out.shape[1]
    per_row = _rows_per_piece_row(shard, n)  # product rows per row of shard
    assert per_row is not None, "gathered_product checked that a shard row holds whole product rows"
    shard_rows = whole_rows(shard).stop

    def produce(piece: torch.Tensor, rows: slice) -> None:
        start, stop, _ = rows.indices(shard_rows)  # ALL_ROWS too: every row
        product.compute_rows(lambda t: t[start * per_row : stop * per_row], piece.view(-1, n))

    return produce


def _rows_per_piece_row(shard: torch.Tensor, width: int) -> int | None:
    """How many rows ``width`` wide one row of ``shard`` (along its
    ``piece_dim``) holds, if whole rows."""
    per_row, odd = divmod(math.prod(shard.shape[piece_dim(shard.shape) + 1 :]), width)
    return None if odd else per_row


def gather_signature(shard: torch.Tensor) -> str:
    """An all-gather as ``verify=True`` compares it across ranks."""
    return f"all_gather of {tensor_str(shard)}"


def scatter_signature(reduce_op: str, out: str) -> str:
    """A reduce-scatter (to ``out``, rendered) as ``verify=True`` compares it."""
    return f"reduce_scatter({reduce_op}) to {out}"


def _copy_chunks(chunks: torch.Tensor) -> ChunkProducer:
    """The producer of an unfused reduce-scatter: chunk c is a slice of the input."""

    def copy_chunk(c: int, buf: torch.Tensor, rows: slice) -> None:
        piece = chunk_rows(chunks[c])[rows]
        buf.view(piece.shape).copy_(piece)

    return copy_chunk


def _b_str(mm: PendingMatmul) -> str:
    return "gathered" if mm.b is None else tensor_str(mm.b)


def _chunk_step(mm: PendingMatmul, whole: torch.Tensor, scale_rows: ScaleRows | None = None) -> ChunkConsumer:
    """The part of ``mm`` that rows ``rows`` of rank ``src``'s shard enable, as a
    consumer (Note [Matmul operands of a gather]). ``whole[src]`` is rank src's
    shard: a consumer whose rows do not split along the pieces waits for it.
    ``scale_rows``: where a ROWS consumer reads its ``scale_a`` rows, if not
    from ``scale_a`` itself."""
    view = mm.view
    assert view is not None, "only gather consumers have chunk steps"
    part = _rows_part(mm, view, scale_rows) if mm.operand is Operand.ROWS else _accumulate_part(mm, view)
    # The [M, X] operand whose rows follow the gathered rows (COLS splits columns).
    # NB: by identity: Enum's __hash__ (a dict of operands) is a Python frame.
    operand = mm.operand
    if operand is Operand.ROWS:
        rows_view = mm.out
    elif operand is Operand.ROWS_T:
        rows_view = mm.b
    elif operand is Operand.B_ROWS:
        rows_view = mm.a.t()
    else:
        return part
    if view.aligned(rows_view):
        return part
    shard_rows = view.shard_rows

    def whole_shard_part(piece: torch.Tensor, src: int, rows: slice) -> None:
        if rows.stop == shard_rows:  # the last piece: the shard is complete
            # NB: a shard delivered whole is the piece itself (the contract lets a
            # backend hand over a shard before ag_out holds it); pieces are views
            # of whole[src] (the ring).
            part(piece if rows.start == 0 else whole[src], src, slice(0, shard_rows))

    return whole_shard_part


def _rows_part(mm: PendingMatmul, view: GatheredView, scale_rows: ScaleRows | None = None) -> ChunkConsumer:
    """ROWS: out[R] = G[R] @ B for the rows R the piece makes (disjoint writes)."""
    n = mm.out.shape[1]
    c = mm.b.shape[0]
    lead = view.tensor.shape[:-1]

    def rows_part(piece: torch.Tensor, src: int, rows: slice) -> None:
        # NB: the hot path (every piece of every fused gather): no view op that
        # changes nothing (each is a dispatched op, about 0.5 us), no frame for
        # the plain matmul.
        if view.cast or view.derived:  # view.data()'s, one frame shorter
            piece = view.piece_of(src, rows)
        g = piece if mm.gathered_dtype is None or mm.gathered_dtype is piece.dtype else piece.view(mm.gathered_dtype)
        if g.dim() != 2 or g.shape[1] != c:
            g = g.reshape(-1, c)
        scale_a = None if scale_rows is None else scale_rows(src, rows)
        if view.dim == 0:  # rows R are contiguous in mm.out
            out = view.rows_of(mm.out, src, rows)
            if scale_a is None and mm.bias is None and mm.scaled is None and not mm.epilogues:
                torch.mm(g, mm.b, out=out)  # NB: mm.compute()'s plain case
            else:
                mm.compute(g, mm.b, out, lambda t: view.rows_of(t, src, rows), scale_a=scale_a)
        elif scale_a is None:
            # Rows R are runs of contiguous rows in mm.out (and in g): one
            # matmul per run, written in place.
            out_runs = view.runs_of(mm.out, src, rows)
            mm.compute(g.view(out_runs.shape[0], -1, c), mm.b, out_runs, lambda t: view.runs_of(t, src, rows))
        else:  # computed as one matrix, then placed
            res = torch.empty((g.shape[0], n), dtype=mm.out.dtype, device=g.device)
            mm.compute(g, mm.b, res, lambda t: view.rows_of(t, src, rows), scale_a=scale_a)
            out_rows = view.block_of(mm.out.view(*lead, n), src, rows)
            out_rows.copy_(res.view(out_rows.shape))

    return rows_part


def _accumulate_part(mm: PendingMatmul, view: GatheredView) -> ChunkConsumer:
    """ROWS_T, B_ROWS, COLS: out (or its rows, for COLS) += one partial product
    per piece. The first piece to arrive starts out at ``beta * bias`` (or 0),
    or, with neither bias nor alpha, writes out when it covers all of it.

    NB: half-precision outputs accumulate in float32 and round once when the
    last piece is in, as one plain matmul does: rounding every partial sum to
    bf16 would drift from plain eager.
    """
    out = mm.out
    acc = out if out.dtype in (torch.float32, torch.float64) else torch.empty_like(out, dtype=torch.float32)
    if mm.operand is Operand.ROWS_T:

        def factors(piece: torch.Tensor, src: int, rows: slice):
            return acc, piece.reshape(-1, out.shape[0]).t(), view.rows_of(mm.b, src, rows)

    elif mm.operand is Operand.B_ROWS:

        def factors(piece: torch.Tensor, src: int, rows: slice):
            return acc, view.rows_of(mm.a.t(), src, rows).t(), piece.reshape(-1, out.shape[1])

    else:
        assert mm.operand is Operand.COLS, f"unknown operand {mm.operand}"
        out_rows_per_shard_row = out.shape[0] // view.shard_rows  # the dims before the rows are 1

        def factors(piece: torch.Tensor, src: int, rows: slice):
            acc_rows = acc[rows.start * out_rows_per_shard_row : rows.stop * out_rows_per_shard_row]
            return acc_rows, piece.reshape(-1, view.block), mm.b[src * view.block : (src + 1) * view.block]

    rows_total = view.world * view.shard_rows
    rows_done = 0

    def accumulate_part(piece: torch.Tensor, src: int, rows: slice) -> None:
        nonlocal rows_done
        target, x, y = factors(view.data(piece, src, rows), src, rows)
        x, y = x.to(acc.dtype), y.to(acc.dtype)
        if rows_done == 0 and mm.bias is None and mm.alpha == 1 and target.shape == acc.shape:
            # NB: a first partial product that covers all of out (a whole shard,
            # as the rings deliver this rank's own first) is written, not added
            # to zeros: a memset and a read of out saved.
            torch.mm(x, y, out=acc)
        else:
            if rows_done == 0:
                if mm.bias is None:
                    acc.zero_()
                else:
                    acc.copy_(mm.bias.expand(*out.shape))
                    if mm.beta != 1:
                        acc.mul_(mm.beta)
            target.addmm_(x, y, alpha=mm.alpha)
        rows_done += rows.stop - rows.start
        if rows_done == rows_total and acc is not out:
            out.copy_(acc)

    return accumulate_part


def _whole_operands(mm: PendingMatmul, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands plain eager multiplies, given the whole gathered view."""
    gathered = gathered.view(mm.gathered_dtype or gathered.dtype)
    if mm.operand is Operand.B_ROWS:
        return mm.a, gathered.reshape(mm.a.shape[1], -1)
    if mm.operand is Operand.ROWS_T:
        return gathered.reshape(mm.b.shape[0], -1).t(), mm.b
    return gathered.reshape(mm.out.shape[0], -1), mm.b
