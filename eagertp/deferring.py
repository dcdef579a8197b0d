"""The engine's operations that make pending work: start a gather, defer a
matmul (as a gather's consumer, or standalone), defer what a product's
collective can still take chunk by chunk (casts, epilogues, sums, funcol's
reshuffles). Note [Deferral boundary] in ``eagertp.deferred`` says when each
happens.

``Deferring`` is one of ``Engine``'s parts (``eagertp.engine``): it works on the
engine's state (``store``, ``trace``, ``stats``, ``backend``, ``verify``,
``poison``, ``matmul_work``, ``before_collective``, ``_deferral_bytes``,
``matmul_ordinal``, ``read_whole``, ``read_whole_now``, ``ran_at_once``),
completes what it must through the engine's completion (``complete``,
``complete_owners``, ``complete_for``, ``complete_before``,
``complete_work_past``) and records through ``Accounting`` (``new_record``,
``count_matmul_work``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from eagertp._format import dtype_str
from eagertp.backends import Backend
from eagertp.backends.base import all_gather_consume
from eagertp.backends.reference import ReferenceBackend
from eagertp.deferred import (
    GatheredView,
    Operand,
    PendingCast,
    PendingGather,
    PendingMatmul,
    PendingPointwise,
    PendingSum,
    Product,
    Scaled,
    ScatterView,
    operand_str,
    storage_key,
    storage_uses,
    tensor_leaves,
)
from eagertp.issuing import IssuingWork, profiler_range
from eagertp.operands import OTHER_PENDING_OPERAND, match_gather_operand, matmul_out_dtype, same_views
from eagertp.patterns import gather_signature, gathered_product, shard_producer
from eagertp.trace import CollectiveRecord, Meta, Reason
from eagertp.verify import check_equal, check_ranks_agree

# Bytes per element of the widest output a fused reduce-scatter takes from a
# matmul: float32, also after autocast's cast of a half-precision one. (A cast
# to float64 of a matmul small by this bound is issued unfused: still right.)
_WIDEST_CAST = 4

# Note [Deferrals that gained nothing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A matmul is deferred because what follows may take it chunk by chunk (a
# reduce-scatter or all-reduce of its output, a sum or cast of it, a gather
# started behind which it runs). Most matmuls of a training step are instead
# read whole by the next op with no collective issued since (attention reading
# q, k and v; autograd accumulating a weight gradient): the deferral, about 25
# Python frames between recording it and computing it at the read, gained
# nothing, since the matmul then ran with the same communication in flight
# as when the program issued it, or less.
#
# Training loops issue the same matmuls in the same order every step, and
# enter the same pipeline once a step. So the engine remembers, for the
# block just ended, each standalone matmul computed whole with no collective
# issued since its deferral (on any group), by its place among the block's
# matmuls, its op and its operands' shapes; in the next block a matmul that
# matches one runs at once (``stats["matmuls_run_at_once"]``), unless an
# operand is pending. Nothing but when the matmul runs changes: its result is
# plain eager's either way, and no collective's messages depend on it
# (Invariant 2).
#
# Where the program changed between blocks, a collective may now take the
# output of a matmul that ran at once, and cannot fuse with it. Its reason
# says so, naming that matmul where the collective reads its output itself
# (which then defers again from the next block), or that matmuls ran at once
# where it reads something made from one (a cast, a sum). And a block that
# ran matmuls at once must end with the stats of the block before (every
# block of an unchanged step does: what fused and what did not); one that
# does not teaches nothing, so the next block defers every matmul, as a
# pipeline's first block does, and remembers again. A block left by an
# exception teaches nothing either. At most _MAX_REMEMBERED matmuls a block:
# a program that never leaves its block gains nothing and holds nothing more.
_MAX_REMEMBERED = 1 << 16


class Deferring:
    """Making pending work: gathers started, matmuls and epilogues deferred."""

    def placeholder(self, like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer that the pending work fills before anything can read it; with
        ``poison=True`` it starts as NaN (integers: the dtype's max) so a bug that
        let an unfilled one escape shows up in the results."""
        # NB: no dtype argument where it is like's: one fewer to parse, about 10% of
        # the call (benchmarks/NOTES.md, "2026-12-04 at 83dc4f9"; one per deferred op).
        # The sizes as separate arguments: torch's parser first tries a sequence
        # of them as one int, raising (and catching) a TypeError, a third of the
        # call (benchmarks/NOTES.md, "2026-12-05 at 6498d38").
        sizes = shape or ((),)  # NB: no size at all is a 0-dim tensor's: new_empty() needs one argument
        out = like.new_empty(*sizes) if dtype is None or dtype is like.dtype else like.new_empty(*sizes, dtype=dtype)
        if self.poison:
            out.fill_(float("nan") if out.is_floating_point() else torch.iinfo(out.dtype).max)
        return out

    # -- all-gather --------------------------------------------------------

    def start_gather(
        self, shard: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Start the gather now and return its placeholder: ``out`` (contiguous,
        gathered shape), the caller's output buffer, or a new one. A shard that
        a pending product makes is made as it is sent, where the backend can
        (Note [Matmul + all-gather] in eagertp.collectives.all_gather)."""
        product = None
        if self.store.items and self.store.touched([shard]) is not None:
            self.unbind_consumer(shard, "all_gather_into_tensor")
            product = gathered_product(self.store.standalone_output(shard), shard)
            if product is None:
                self.complete_owners([shard], "all_gather_into_tensor")
        shard = shard.contiguous()
        placeholder = out is None  # else the caller's own buffer, the program's to read
        if placeholder:
            out = self.placeholder(shard, (shard.shape[0] * group.size(), *shard.shape[1:]))
        record = self.new_record("all_gather", shard, out, group)
        if self.store.sending and product is None:
            self._note_gathered(shard, group, record)
        gather = PendingGather(shard, out, group, self.store.next_tid(), record, work_at_start=self.matmul_work)
        with IssuingWork(self):  # NB: issuing_work(), one frame shorter
            if self.verify:
                # NB: before the backend is chosen: symm_mem's first use of a
                # group rendezvouses, a collective that mismatched ranks would hang in.
                check_ranks_agree(gather_signature(shard), group)
            backend, gather.backend = self.backend.for_collective(shard, group)
            record.backend = gather.backend
            why_not = None if product is None else backend.why_not_produce_all_gather(shard, group)
            if why_not is not None:
                gather.made_first = Reason("{} made its shard first: {}", product.describe(), why_not)
                self.complete_owners([shard], "all_gather_into_tensor", f"made ${product.tid} first: {why_not}")
                gather.work_at_start = self.matmul_work  # NB: it ran before the gather, not behind it
                product = None
            if product is None:
                gather.handle = backend.start_all_gather(shard, out, group)
            else:
                self._produce_gather(gather, product, backend)
            if self.verify:
                # Plain eager's result, gathered in program order on every rank
                # (after the start, which may make the shard), for the comparison
                # when the gather completes.
                self.gather_reference(gather)
        if placeholder:
            gather.storage_uses_at_start = storage_uses(out)  # Note [This rank's chunk, unread]
        self.add_gather(gather)
        return out

    def _note_gathered(self, shard: torch.Tensor, group: dist.ProcessGroup, record: CollectiveRecord) -> None:
        """Say so if a gather in flight sends this very tensor, unwritten since,
        on the same group (Note [One shard gathered twice] in eagertp.trace)."""
        for gather in self.store.sending_from(shard):
            if gather.shard is shard and gather.group is group:
                self.trace.note_regathered(gather.record.index, record)
                return

    def unbind_consumer(self, shard: torch.Tensor, func: Any) -> None:
        """If ``shard`` is the whole output of a matmul bound to a gather in
        flight (as A rows), and a collective or an epilogue is about to take
        it, take the matmul out of that gather and complete the gather: the
        matmul, now a standalone product of the completed tensor, is made as
        its collective needs it (an all-gather sending it, a reduce-scatter or
        all-reduce producing from it: Note [Matmul + all-gather] in
        eagertp.collectives.all_gather, Note [Matmul + all-reduce]), its scale
        kept with it (Note [Epilogues] in eagertp.deferred), as before it
        bound. A column-parallel matmul after a norm run row by row (Note
        [Row-wise ops on gathered rows] in eagertp.rowwise) whose output is
        gathered (HF's ``colwise_rep``, ``colwise_gather_output``); float8's
        input gradient scaled row-wise by an all-reduced amax, then reduced."""
        bound = self._bound_output(shard)
        if bound is None:
            return
        gather, mm = bound
        self.store.remove_consumer(gather, mm)
        view = mm.view
        mm.a = view.tensor.view(mm.gathered_dtype or view.tensor.dtype).reshape(mm.out.shape[0], -1)
        mm.operand, mm.view, mm.gathered_dtype = None, None, None
        self.complete_owners([mm.a], func, f"takes ${mm.tid} whole: ${view.tid} completes first")
        self.store.add_product(mm)
        if self.trace.recording:
            self.trace.event("${}: {} unbound: {} takes it whole", mm.tid, mm.describe(), func)

    def _bound_output(self, t: torch.Tensor) -> tuple[PendingGather, PendingMatmul] | None:
        """The gather in flight and the matmul bound to it as A rows whose
        whole output ``t`` is, if it is one that ``unbind_consumer`` can unbind."""
        if not self.store.items:
            return None
        gather = self.store.owner(t)
        if not isinstance(gather, PendingGather):
            return None
        mm = gather.consumer_writing(t)
        if (
            mm is None
            or mm.operand is not Operand.ROWS
            or mm.scale_gather is not None
            or not t.is_contiguous()
            or t.storage_offset() != mm.out.storage_offset()
            or t.numel() != mm.out.numel()
        ):
            return None
        return gather, mm

    def _produce_gather(self, gather: PendingGather, product: Product, backend: Backend) -> None:
        """Start ``gather`` with its shard made by ``product`` as it is sent
        (Note [Matmul + all-gather] in eagertp.collectives.all_gather), and
        account for it as fused."""
        self.complete_before("all_gather_into_tensor", product)
        # NB: made straight into this rank's chunk of the result and sent from
        # there: no copy. The product's own output stays pending, computed only
        # if something reads it (as after a fused reduce-scatter).
        gather.shard = gather.out.view(gather.group.size(), *gather.shard.shape)[gather.group.rank()]
        product.absorbed = True
        self.count_matmul_work()
        with profiler_range("eagertp::matmul_all_gather"):
            gather.handle = backend.produce_all_gather(
                shard_producer(product, gather.shard), gather.shard, gather.out, gather.group
            )
        if self.verify:
            want = torch.empty_like(product.out)
            product.compute_all(want)
            got = gather.shard.view(want.shape)
            check_equal(f"{product.describe()} before all_gather", got, want, gather.group, exact=False)
        gather.produced = True
        self.stats["matmul_all_gather"] += 1
        self.trace.mark_fused(gather.record, [product.describe()], gather.backend)
        if self.trace.recording:
            self.trace.event("matmul_all_gather(${}) [{}]", product.tid, gather.backend)

    def gather_reference(self, gather: PendingGather) -> None:
        """Plain eager's gather of ``gather.shard``, for ``verify=True`` to compare
        with when the gather completes."""
        gather.reference = torch.empty_like(gather.out)
        all_gather_consume(ReferenceBackend(), gather.shard, None, gather.reference, gather.group)

    def add_gather(self, gather: PendingGather) -> None:
        """Hold a started gather in the pending store, traced, until a read or flush completes it."""
        self.store.add_gather(gather)
        record = gather.record
        if self.trace.recording:
            self.trace.event("${}: {} = all_gather({}, {})", gather.tid, record.dst, record.src, record.group)

    # -- matmuls -----------------------------------------------------------

    def never_fused(self, rows: int, cols: int, device: torch.device) -> bool:
        """True if a product of ``rows x cols`` on ``device`` is too small for
        any reduce-scatter or all-reduce of it to fuse: run at once, not
        deferred, while nothing is pending (Note [Deferral boundary])."""
        # NB: by device, not its type: ``.device.type`` costs as much as this call.
        nbytes = self._deferral_bytes.get(device)
        if nbytes is None:  # the smallest matmul output (bytes) a fused collective could take
            nbytes = self._deferral_bytes[device] = min(
                self.backend.min_bytes(device.type, "reduce_scatter"),
                self.backend.min_bytes(device.type, "all_reduce"),
            )
        return rows * cols * _WIDEST_CAST < nbytes

    def run_matmul(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """A matmul run at once (not deferred): counted as work that overlaps
        the gathers in flight."""
        self.count_matmul_work()
        return func._op(*args, **kwargs)  # NB: OpOverload.__call__ is a Python frame

    def _run_at_once(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, ordinal: int, known: tuple) -> Any:
        """Run a matmul the block before read whole at once (Note [Deferrals that
        gained nothing]), after what its deferral would have completed first."""
        if self.store.items:
            self.complete_work_past(func, self.before_collective)
        self.read_whole_now[ordinal] = known
        self.stats["matmuls_run_at_once"] += 1
        if self.trace.recording:  # Note [The ordered trace when asked] in eagertp.trace
            self.trace.event("{} #{} of the block run at once: the block before read it whole", func, ordinal)
        out = self.run_matmul(func, args, kwargs)
        # NB: with its storage's lifetime: a later storage at a freed one's
        # address (the allocator reuses them at once) is none of this matmul's.
        self.ran_at_once[storage_key(out)] = (ordinal, weakref.ref(out.untyped_storage()))
        return out

    def not_pending_reason(self, inp: torch.Tensor) -> str:
        """Why a collective cannot take ``inp`` from a matmul: it is no pending
        product, perhaps since a matmul run at once made it (Note [Deferrals
        that gained nothing]; that one defers again from the next block)."""
        if not self.ran_at_once:
            return "its input is not the pending output of a matmul"
        ran = self.ran_at_once.get(storage_key(inp))
        if ran is not None and ran[1]() is not None:  # NB: that storage is still alive: inp's
            self.read_whole_now.pop(ran[0], None)
            return (
                "its input is the output of a matmul run at once, since the block before read it whole "
                "(Note [Deferrals that gained nothing]); from the next block on it defers"
            )
        return (
            f"its input is not the pending output of a matmul ({len(self.ran_at_once)} matmuls ran at once "
            "in this block, as the block before read them whole: Note [Deferrals that gained nothing])"
        )

    def defer_matmul(
        self,
        func: torch._ops.OpOverload,
        args: tuple,
        kwargs: dict,
        a: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scaled: Scaled | None = None,
    ) -> torch.Tensor:
        """Defer a matmul: as a consumer of the gather in flight it reads, or
        standalone (a reduce-scatter may follow: Note [Deferral boundary]),
        or run it at once where the block before read it whole (Note
        [Deferrals that gained nothing]). ``a @ b``: ``args`` if not given
        (``mm``'s handler, eagertp.matmuls)."""
        if a is None:
            a, b = args
        ordinal = self.matmul_ordinal
        self.matmul_ordinal = ordinal + 1
        if not self.store.items and a.dim() == 2 and b.dim() == 2:
            # NB: the hot path of small matmuls.
            if self.never_fused(a.shape[0], b.shape[1], a.device):
                return self.run_matmul(func, args, kwargs)
        out_dtype, rejected = matmul_out_dtype(a, b, bias, scaled)
        if out_dtype is None:
            # Plain eager raises its own error, or (FP8 shapes the meta kernel's
            # stricter rules reject) runs it: unfused, and explain() says why.
            if self.store.items:
                tensors = tensor_leaves(args, kwargs)
                self.complete_owners(tensors, func, f"reads it with operands that do not defer ({rejected})")
                self.complete_for(func, args, kwargs)
            return self.run_matmul(func, args, kwargs)
        known = self.read_whole.get(ordinal)
        if known is not None and known[0] is func and known[1] == a.shape and known[2] == b.shape:
            if not self.store.items or self.store.touched(tensor_leaves(args, kwargs)) is None:
                return self._run_at_once(func, args, kwargs, ordinal, known)
        gather, view, operand, scale_gather = None, None, None, None
        if self.store.items:
            self.complete_work_past(func, self.before_collective)
        if self.store.items:  # NB: again: what the call above completed may have emptied it
            gather, view, operand, scale_gather, why_not = match_gather_operand(self.store, a, b, bias, scaled)
            if why_not is OTHER_PENDING_OPERAND:
                self._complete_beside(gather, func, args, kwargs)
                gather, view, operand, scale_gather, why_not = match_gather_operand(self.store, a, b, bias, scaled)
            if why_not is not None:
                self.complete_owners(tensor_leaves(args, kwargs), func, why_not)
            elif gather is None:
                self.complete_for(func, args, kwargs)
        out = self.placeholder(a, (a.shape[0], b.shape[1]), out_dtype)
        if gather is None and scaled is None:  # NB: the hot path: a standalone matmul, fewer arguments to parse
            mm = PendingMatmul(func, a, b, out, self.store.next_tid(), bias)
        else:
            mm = PendingMatmul(
                func,
                None if operand in (Operand.ROWS, Operand.ROWS_T, Operand.COLS) else a,
                None if operand is Operand.B_ROWS else b,
                out,
                self.store.next_tid(),
                bias,
                operand=operand,
                view=view,
                scaled=scaled,
                gathered_dtype=None if view is None or operand is Operand.B_ROWS else a.dtype,
                scale_gather=scale_gather,
            )
        if kwargs:  # addmm's
            mm.beta, mm.alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if gather is None:
            if ordinal < _MAX_REMEMBERED:
                mm.ordinal, mm.issued_at = ordinal, self.trace.issued
            self.store.add_product(mm)
        else:
            self.store.add_consumer(gather, mm)
        if scale_gather is not None:
            scale_gather.scale_of.append(mm)
        if self.trace.recording:  # Note [The ordered trace when asked] in eagertp.trace
            self.trace.events.append(mm.trace_event())  # NB: what Trace.event records, one frame shorter
        return mm.out

    def _complete_beside(self, gather: PendingGather, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        """Complete the pending work a matmul on ``gather`` reads beside the
        gathered tensor (``OTHER_PENDING_OPERAND``), and only that: ``gather``
        stays in flight for the matmul to join."""
        others = [p for p in self.store.owners(tensor_leaves(args, kwargs)) if p is not gather]
        reason = Reason("{} reads ${} beside a gather in flight", func, others[-1].tid)
        if self.trace.recording:
            self.trace.event("wait: {}", reason)
        self.complete(others, reason)

    def defer_cast(self, gather: PendingGather, source: GatheredView, dtype: torch.dtype) -> torch.Tensor:
        view = GatheredView(
            self.placeholder(source.tensor, source.tensor.shape, dtype), source.dim, source.world,
            self.store.next_tid(), cast=True,
        )
        self.store.add_gathered_view(gather, view)
        if self.trace.recording:
            self.trace.event("${}: {} = ${}.to({})", view.tid, Meta.of(view.tensor), source.tid, dtype_str(dtype))
        return view.tensor

    def defer_product_cast(self, source: Product, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Defer ``t.to(dtype)`` of a whole pending product (``t`` views its
        output): a reduce-scatter of the cast can still produce chunk by chunk."""
        cast = PendingCast(source, self.placeholder(source.out, source.out.shape, dtype), self.store.next_tid())
        source.absorbed = True
        self.store.add_product(cast)
        if self.trace.recording:
            self.trace.event("${}: {} = ${}.to({})", cast.tid, Meta.of(cast.out), source.tid, dtype_str(dtype))
        return cast.out.view(t.shape)

    def defer_pointwise(
        self, source: Product, op: Callable[..., torch.Tensor], operand: torch.Tensor | float, dtype: torch.dtype
    ) -> torch.Tensor:
        """Defer ``op(source.out, operand)`` of a whole pending product (Note
        [Epilogues] in eagertp.deferred): a collective of the result can still
        produce chunk by chunk."""
        out = self.placeholder(source.out, source.out.shape, dtype)
        pointwise = PendingPointwise(source, out, self.store.next_tid(), op=op, operand=operand)
        source.absorbed = True
        self.store.add_product(pointwise)
        if self.trace.recording:
            self.trace.event("${}: {} = ${} {} {}", pointwise.tid, Meta.of(out), source.tid,
                             "*" if op is torch.mul else "+", operand_str(operand))
        return out

    def defer_chunk_cat(self, tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
        """Defer ``cat(x.chunk(W, i), dim)`` of a pending ``x``, the reshuffle funcol
        emits around collectives on dims > 0, or return None if that is not it:

        - ``cat(ag.chunk(W), d)``: the all-gather seen along dim ``d`` (a new
          gathered view, filled chunk by chunk when the gather completes);
        - ``cat(y.chunk(W, d), 0)`` of a matmul output ``y``: the input of a
          reduce-scatter along dim ``d``, which can then produce chunk by chunk.
        """
        owner = self.store.owner(tensors[0]) if tensors else None
        if isinstance(owner, PendingGather) and dim == 0 and owner.view_of(tensors[0]) is None:
            # A gather consumer's output, reshuffled for a reduce-scatter along dim > 0.
            mm = owner.consumer_writing(tensors[0])
            key = storage_key(tensors[0])
            if mm is not None and len(tensors) > 1 and all(storage_key(t) == key for t in tensors):
                self.unbind_consumer(mm.out, "cat")
                owner = self.store.owner(tensors[0])
        if owner is None:
            return None
        for t in tensors:  # NB: a loop: every cat while work is pending
            if self.store.owner(t) is not owner:
                return None
        world = len(tensors)
        if isinstance(owner, PendingGather):
            dim = dim % owner.shard.dim()
            if world != owner.group.size() or dim == 0 or not same_views(tensors, owner.out.chunk(world)):
                return None
            shape = list(owner.shard.shape)
            shape[dim] *= world
            view = GatheredView(self.placeholder(owner.shard, shape), dim, world, self.store.next_tid())
            self.store.add_gathered_view(owner, view)
            if self.trace.recording:
                self.trace.event("${}: {} = cat(${}.chunk({}), {})", view.tid, Meta.of(view.tensor), owner.tid, world, dim)
            return view.tensor
        if dim != 0:
            return None
        mm = owner
        for split_dim in range(1, tensors[0].dim()):
            shape = list(tensors[0].shape)
            shape[split_dim] *= world
            if math.prod(shape) != mm.out.numel() or shape[-1] != mm.out.shape[1]:
                continue
            if same_views(tensors, mm.out.view(shape).chunk(world, split_dim)):
                cat_shape = (world * tensors[0].shape[0], *tensors[0].shape[1:])
                sv = ScatterView(self.placeholder(mm.out, cat_shape), torch.Size(shape), split_dim, world)
                self.store.add_scatter_view(mm, sv)
                if self.trace.recording:
                    self.trace.event(
                        "${}': {} = cat(${}.chunk({}, {}), 0)", mm.tid, Meta.of(sv.tensor), mm.tid, world, split_dim
                    )
                return sv.tensor
        return None

    def defer_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Defer ``x + y`` of two whole pending products (autograd accumulating an
        input gradient): a reduce-scatter of the sum can then produce each chunk
        as a sum of matmul rows. A term bound to a gather in flight as its rows
        (float8's row-wise input gradients, each scaled by the rows of its own
        amax all-reduce's gather half) is unbound first: the sum is read now,
        which would complete its gather anyway. None if that is not it."""
        whole = [self.store.standalone_output(t) for t in (x, y)]
        if all((found is not None and found[1] is None) or self._bound_output(t) is not None for t, found in zip((x, y), whole)):
            for t in (x, y):
                self.unbind_consumer(t, "aten.add.Tensor")
        found_x, found_y = self.store.standalone_output(x), self.store.standalone_output(y)
        if found_x is None or found_y is None or found_x[1] is not None or found_y[1] is not None:
            return None
        (px, _), (py, _) = found_x, found_y
        if px is py or x.shape != y.shape or x.dtype != y.dtype or px.out.shape != py.out.shape:
            return None
        terms = [t for p in (px, py) for t in (p.terms if isinstance(p, PendingSum) else [p])]
        px.absorbed = py.absorbed = True
        total = PendingSum(terms, self.placeholder(px.out, px.out.shape), self.store.next_tid())
        self.store.add_product(total)
        if self.trace.recording:
            self.trace.event(total.render())
        return total.out.view_as(x)  # NB: not view(x.shape): a torch.Size argument costs twice the view
