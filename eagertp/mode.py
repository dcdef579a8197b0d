"""``EagerMicroPipeline``: micro-pipelined tensor parallelism at run time.

The mode defers every all-gather on a group it manages and hands the program a
placeholder, and defers every matmul until the next op shows what it feeds
(collectives too small to gain, and matmuls that could only feed those, run at
once: Note [Size rule]). Matmuls on a pending gather join it; a matmul (or a
sum of matmuls) whose output is reduce-scattered becomes the reduce-scatter's
producer. When something needs the data (any other reader, another collective,
``flush()``, leaving the block) the pending work is issued, fused, in program
order::

    >>> with EagerMicroPipeline() as pipe:
    ...     x = funcol.all_gather_single(x_shard, 0, tp_group)    # deferred
    ...     q, k, v = x @ wq, x @ wk, x @ wv                      # deferred
    ...     y = attention(q, k, v)                                # ONE fused call
    ...     out = funcol.reduce_scatter_single(y @ wo, "sum", 0, tp_group)  # fused
    >>> print(pipe.explain())
    all_gather #0 f32[1024, 512] -> f32[2048, 512] on group '1' (2 ranks): fused with mm -> $1, mm -> $2, mm -> $3 [ring]
    reduce_scatter(sum) #0 f32[2048, 512] -> f32[1024, 512] on group '1' (2 ranks): fused with mm -> $5 [ring]

The mode lives on the dispatch-mode stack of the thread that entered it
(``TorchDispatchMode`` state is thread-local): ops from other threads are not
seen. One instance is active at most once at a time; nested blocks need
separate instances, and the inner one sees ops first.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from eagertp._format import dtype_str, group_str, tensor_str
from eagertp.backends import BackendChoice
from eagertp.backends.base import REDUCE_OPS
from eagertp.deferred import (
    GatheredView,
    Operand,
    PendingGather,
    PendingCast,
    PendingMatmul,
    PendingStore,
    PendingSum,
    Product,
    Scaled,
    ScatterView,
    storage_key,
    tensor_leaves,
)
from eagertp.patterns import AllGatherMatmulPlan, Plan, ReduceScatterPlan, gather_signature, scatter_signature
from eagertp.trace import CollectiveRecord, Meta, Reason, Trace

__all__ = ["EagerMicroPipeline", "VerificationError"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d_ops = torch.ops.c10d
_c10d_functional = torch.ops._c10d_functional

# Subclasses that desugar into plain ops we understand: return NotImplemented so
# their __torch_dispatch__ runs first and issues funcol ops on plain tensors.
_DESUGAR_FIRST = (DTensor, AsyncCollectiveTensor)

# Op namespaces whose ops communicate. Any such op not handled below is issued
# only after every pending collective (Invariant 3: same collective order).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "symm_mem"})

# Ops that stay pending: their outputs share the placeholder's storage and read
# no data. Every other view op qualifies too (see _is_metadata_only).
_PENDING_PASSTHROUGH = frozenset({aten._unsafe_view.default})

Handler = Callable[["EagerMicroPipeline", torch._ops.OpOverload, tuple, dict], Any]
_HANDLERS: dict[torch._ops.OpOverload, Handler] = {}


def _register(ops: Sequence[torch._ops.OpOverload]) -> Callable[[Handler], Handler]:
    """Fill the op -> handler table; an op may have one handler only."""

    def decorator(handler: Handler) -> Handler:
        for op in ops:
            if op in _HANDLERS:
                raise RuntimeError(
                    f"eagertp: {op} already handled by {_HANDLERS[op].__name__}; "
                    f"cannot also register {handler.__name__}"
                )
            _HANDLERS[op] = handler
        return handler

    return decorator


class VerificationError(RuntimeError):
    """``verify=True`` found a fused result that differs from plain eager."""


class EagerMicroPipeline:
    """Fuse all-gather + matmul and matmul + reduce-scatter at run time, with no
    compile step.

    Args:
        group: manage only collectives on this process group (e.g. the TP group,
            so FSDP's all-gathers pass through untouched). Default: every group.
        backend: ``"auto"`` (``"symm_mem"`` for CUDA tensors where torch's
            symmetric-memory primitives exist, else ``"ring"``), ``"ring"``
            (micro-pipeline over point-to-point ops, any process group),
            ``"symm_mem"`` (CUDA symmetric memory; an error where it cannot run)
            or ``"reference"`` (plain collective then matmul).
        verify: after each issued collective, recompute it unfused and raise
            ``VerificationError`` naming the op, shapes and difference if the
            results disagree, and first check that every rank issues the same
            collective (shapes, dtype), naming each rank's if not. Costs extra
            collectives; for debugging.
        poison: fill every placeholder with NaN when it is made (debugging: an
            unfilled placeholder that escaped would show up as NaN).
        min_fuse_bytes: fuse a collective only if its per-rank buffer (the
            all-gather's shard, the reduce-scatter's output) has at least this
            many bytes; smaller ones are not deferred but issued as the program
            wrote them, and ``explain()`` says so. Default (``None``): per device,
            ``eagertp.backends.MIN_FUSE_BYTES`` (on CPU, measured: 1 MiB for
            all-gathers, 512 KiB for reduce-scatters; 0 on CUDA). ``0`` fuses
            every size. A dict sets it per kind (``{"all_gather": ...,
            "reduce_scatter": ...}``, as ``calibrate_min_fuse_bytes`` returns
            it); a kind left out keeps its default.
        max_records: bound on the trace and ``explain()`` records kept.

    Attributes:
        stats: counters. ``all_gather_matmul`` and ``matmul_reduce_scatter``
            (fused calls issued), ``fused_matmuls`` (matmuls inside the fused
            all-gathers), ``unfused_all_gather`` and ``unfused_reduce_scatter``
            (issued alone, each with a reason in ``explain()``).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        verify: bool = False,
        poison: bool = False,
        min_fuse_bytes: int | Mapping[str, int] | None = None,
        max_records: int = 10_000,
    ) -> None:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"EagerMicroPipeline(group=...) takes a torch.distributed.ProcessGroup "
                f"or None, got {type(group).__name__}; for a DeviceMesh pass "
                f"mesh.get_group('tp')"
            )
        self.group = group
        self.verify = verify
        self.poison = poison
        self.stats: collections.Counter[str] = collections.Counter()
        self._backend = BackendChoice(backend, min_fuse_bytes)
        self._max_records = max_records
        self._trace = Trace(max_records=max_records)
        self._store = PendingStore()
        self._mode: _EagerTPMode | None = None
        # True while this instance issues work: its own ops pass through it.
        self._issuing = False

    # -- context manager ---------------------------------------------------

    def __enter__(self) -> EagerMicroPipeline:
        if self._mode is not None:
            raise RuntimeError(
                "EagerMicroPipeline is already active; nest a new instance instead "
                "of re-entering this one"
            )
        self.stats.clear()
        self._trace = Trace(max_records=self._max_records)
        self._store.reset()
        self._mode = _EagerTPMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        mode, self._mode = self._mode, None  # break the pipeline <-> mode cycle
        assert mode is not None, "__exit__ without __enter__"
        # NB: leave the mode first: what the last flush issues then dispatches
        # straight to outer modes and kernels, not through our own pass-through.
        mode.__exit__(None, None, None)
        try:
            reason = "block exited" if exc is None else f"block exited by {exc_type.__name__}"
            self._flush(reason)
        except Exception:
            if exc is None:
                raise
            # The block's own exception is the one the user must see.
            log.exception("eagertp: flush while leaving the block after %r failed", exc)

    # -- public API --------------------------------------------------------

    def flush(self) -> None:
        """Issue everything deferred now (fused where a pattern matched)."""
        self._flush("flush() called")

    def explain(self) -> str:
        """One line per all-gather / reduce-scatter: what it fused with, or why not."""
        return self._trace.explain()

    def debug_string(self) -> str:
        """The ordered trace, with short stable tensor ids (``$0``) and shapes."""
        return self._trace.debug_string()

    @property
    def backend(self) -> str:
        return self._backend.name

    # -- dispatch ----------------------------------------------------------

    def _manages(self, group: dist.ProcessGroup) -> bool:
        return self.group is None or group.group_name == self.group.group_name

    def _flush_if_needed(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        """Flush before ``func`` if it communicates, reads pending data, or writes
        a tensor that pending work will read."""
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self._flush(Reason("{} issued", func))
            return
        tensors = tensor_leaves(args, kwargs)
        touched = self._store.touched(tensors)
        if touched is not None:
            if _is_metadata_only(func):
                return
            self._flush(Reason("{} read ${}", func, self._store.tid_of(touched)))
        elif func._schema.is_mutable and any(self._store.is_input(t) for t in tensors):
            self._flush(Reason("{} wrote an input of pending work", func))

    def _flush(self, reason: str | Reason) -> None:
        items = self._store.drain()
        if not items:
            return
        self._trace.event("flush: {}", reason)
        self._issuing = True
        try:
            # Issue every item even if one fails, so that peers waiting on the
            # later collectives are not left hanging; then raise the first failure.
            failure: BaseException | None = None
            # NB: placeholders are filled below autograd (see _issue).
            with torch._C._AutoDispatchBelowADInplaceOrView():
                for item in items:
                    try:
                        if isinstance(item, PendingGather):
                            plan = AllGatherMatmulPlan(item)
                            self._issue(plan, f"no matmul consumed it before {reason}")
                        elif item.absorbed and item.unobserved():
                            # Its fused consumer already produced what it needed
                            # and nothing else can read it: computing it is waste.
                            self._trace.event("skip ${}: nothing can read it", item.tid)
                        else:
                            item.issue_standalone()
                    except BaseException as e:  # noqa: B036 - re-raised below
                        failure = failure or e
            if failure is not None:
                raise failure
        finally:
            self._issuing = False

    def _issue(self, plan: Plan, unfused_reason: str) -> None:
        """Run one collective's plan on the backend and account for it."""
        was_issuing, self._issuing = self._issuing, True
        try:
            # NB: placeholders are filled below autograd: tensors autograd saved for
            # backward are these same storages, and their version counters must not move.
            with _profiler_range(f"eagertp::{plan.name}"), torch._C._AutoDispatchBelowADInplaceOrView():
                if self.verify:
                    # NB: before the backend is chosen: symm_mem's first use of a
                    # group rendezvouses, a collective that mismatched ranks would hang in.
                    _check_ranks_agree(plan.signature(), plan.group)
                backend, note = self._backend.for_collective(plan.buffer, plan.group)
                plan.run(backend)
                if self.verify:
                    for what, got, want, exact in plan.checks():
                        _check_equal(what, got, want, plan.group, exact=exact)
        finally:
            self._issuing = was_issuing
        label = backend.name if note is None else f"{backend.name}; {note}"
        if plan.fused:
            self.stats[plan.name] += 1
            if isinstance(plan, AllGatherMatmulPlan):
                self.stats["fused_matmuls"] += len(plan.gather.consumers)
            self._trace.mark_fused(plan.record, plan.fused_with(), label)
        else:
            self.stats[f"unfused_{plan.kind}"] += 1
            self._trace.mark_unfused(plan.record, unfused_reason, label)
        self._trace.event(f"{plan.render()} [{label}]")

    # -- deferral ----------------------------------------------------------

    def _placeholder(self, like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer that the pending work fills before anything can read it; with
        ``poison=True`` it starts as NaN (integers: the dtype's max) so a bug that
        let an unfilled one escape shows up in the results."""
        out = like.new_empty(shape, dtype=dtype or like.dtype)
        if self.poison:
            out.fill_(float("nan") if out.is_floating_point() else torch.iinfo(out.dtype).max)
        return out

    def _defer_gather(
        self, shard: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Record the gather; ``out`` (contiguous, gathered shape) is the
        caller's output buffer, else a new placeholder is made."""
        shard = shard.contiguous()
        if out is None:
            out = self._placeholder(shard, (shard.shape[0] * group.size(), *shard.shape[1:]))
        record = self._new_record("all_gather", shard, out, group)
        gather = PendingGather(shard, out, group, self._store.next_tid(), record)
        self._store.add_gather(gather)
        self._trace.event(f"${gather.tid}: {record.dst} = all_gather({record.src}, {record.group})")
        return out

    def _defer_matmul(
        self,
        func: torch._ops.OpOverload,
        args: tuple,
        kwargs: dict,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None = None,
        scaled: Scaled | None = None,
    ) -> torch.Tensor:
        """Defer a matmul: as a consumer of the pending gather it reads, or
        standalone (a reduce-scatter may follow: Note [Deferral boundary])."""
        if not self._store.items and a.dim() == 2 and b.dim() == 2:
            # Too small for any reduce-scatter of it to fuse: run it now
            # (Note [Deferral boundary]). NB: the hot path of small matmuls.
            never_fused = self._backend.min_bytes(a.device.type, "reduce_scatter")
            if a.shape[0] * b.shape[1] * _WIDEST_CAST < never_fused:
                return func(*args, **kwargs)
        out_dtype, rejected = _matmul_out_dtype(a, b, bias, scaled)
        if out_dtype is None:
            # Plain eager raises its own error, or (FP8 shapes the meta kernel's
            # stricter rules reject) runs it: unfused, and explain() says why.
            if self._store and self._store.touched(tensor_leaves(args, kwargs)) is not None:
                self._flush(Reason("{} reads it with operands that do not defer ({})", func, rejected))
            elif self._store:
                self._flush_if_needed(func, args, kwargs)
            return func(*args, **kwargs)
        gather, view, operand = None, None, None
        if self._store:
            gather, view, operand, why_not = self._match_gather_operand(a, b, bias, scaled)
            if why_not is not None:
                self._flush(f"{func} {why_not}")
            elif gather is None:
                self._flush_if_needed(func, args, kwargs)
        mm = PendingMatmul(
            func,
            None if operand in (Operand.ROWS, Operand.ROWS_T, Operand.COLS) else a,
            None if operand is Operand.B_ROWS else b,
            self._placeholder(a, (a.shape[0], b.shape[1]), out_dtype),
            self._store.next_tid(),
            bias,
            beta=kwargs.get("beta", 1),
            alpha=kwargs.get("alpha", 1),
            operand=operand,
            view=view,
            scaled=scaled,
            gathered_dtype=None if view is None or operand is Operand.B_ROWS else a.dtype,
        )
        if gather is None:
            self._store.add_product(mm)
        else:
            self._store.add_consumer(gather, mm)
        self._trace.event(*mm.trace_event())
        return mm.out

    def _match_gather_operand(
        self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scaled: Scaled | None = None
    ) -> tuple[PendingGather | None, GatheredView | None, Operand | None, str | None]:
        """Which pending gather a matmul consumes and how, or why it cannot."""
        found_a, found_b = self._store.gathered_view_of(a), self._store.gathered_view_of(b)
        if found_a is None and found_b is None:
            return None, None, None, None
        if found_a is not None and found_b is not None:
            return None, None, None, "reads pending gathers as both operands"
        gather, view = found_a or found_b
        g = a if found_a is not None else b
        if g.numel() == 0:
            return None, None, None, "reads an empty gathered tensor: there is nothing to overlap"
        if g.element_size() != view.tensor.element_size():
            return None, None, None, (
                f"reads the gathered {tensor_str(view.tensor)} as {tensor_str(g)}, another element size"
            )
        if found_a is not None and view.is_rows(a):
            operand = Operand.ROWS
        elif found_a is not None and view.is_rows(a.t()):
            operand = Operand.ROWS_T
        elif found_a is not None and view.is_cols(a):
            operand = Operand.COLS
        elif found_b is not None and view.is_rows(b):
            operand = Operand.B_ROWS
        else:
            return None, None, None, (
                f"reads the gathered tensor (gather dim {view.dim}) as {tensor_str(g)} with strides "
                f"{g.stride()}, which does not split into per-rank blocks"
            )
        if scaled is not None and operand is not Operand.ROWS:
            return None, None, None, f"is a scaled (FP8) matmul reading the gathered tensor as {operand.value}: only A rows fuse"
        if g.dtype != view.tensor.dtype and operand is not Operand.ROWS:
            return None, None, None, f"reads the gathered {tensor_str(view.tensor)} as {g.dtype} in a contraction"
        others = [t for t in (a, b, bias, *([] if scaled is None else scaled.tensors())) if t is not None and t is not g]
        if self._store.touched(others) is not None:
            return None, None, None, "has a second pending operand"
        return gather, view, operand, None

    def _defer_cast(self, gather: PendingGather, source: GatheredView, dtype: torch.dtype) -> torch.Tensor:
        view = GatheredView(
            self._placeholder(source.tensor, source.tensor.shape, dtype), source.dim, source.world,
            self._store.next_tid(), cast=True,
        )
        self._store.add_gathered_view(gather, view)
        self._trace.event("${}: {} = ${}.to({})", view.tid, Meta.of(view.tensor), source.tid, dtype_str(dtype))
        return view.tensor

    def _defer_product_cast(self, source: Product, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Defer ``t.to(dtype)`` of a whole pending product (``t`` views its
        output): a reduce-scatter of the cast can still produce chunk by chunk."""
        cast = PendingCast(source, self._placeholder(source.out, source.out.shape, dtype), self._store.next_tid())
        source.absorbed = True
        self._store.add_product(cast)
        self._trace.event("${}: {} = ${}.to({})", cast.tid, Meta.of(cast.out), source.tid, dtype_str(dtype))
        return cast.out.view(t.shape)

    def _defer_chunk_cat(self, tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
        """Defer ``cat(x.chunk(W, i), dim)`` of a pending ``x``, the reshuffle funcol
        emits around collectives on dims > 0, or return None if that is not it:

        - ``cat(ag.chunk(W), d)``: the all-gather seen along dim ``d`` (a new
          gathered view, filled chunk by chunk when the gather is issued);
        - ``cat(y.chunk(W, d), 0)`` of a matmul output ``y``: the input of a
          reduce-scatter along dim ``d``, which can then produce chunk by chunk.
        """
        owner = self._store.owner(tensors[0]) if tensors else None
        if owner is None or any(self._store.owner(t) is not owner for t in tensors):
            return None
        world = len(tensors)
        if isinstance(owner, PendingGather):
            dim = dim % owner.shard.dim()
            if world != owner.group.size() or dim == 0 or not _same_views(tensors, owner.out.chunk(world)):
                return None
            shape = list(owner.shard.shape)
            shape[dim] *= world
            view = GatheredView(self._placeholder(owner.shard, shape), dim, world, self._store.next_tid())
            self._store.add_gathered_view(owner, view)
            self._trace.event(f"${view.tid}: {tensor_str(view.tensor)} = cat(${owner.tid}.chunk({world}), {dim})")
            return view.tensor
        if dim != 0 or owner not in self._store.items:
            return None
        mm = owner
        for split_dim in range(1, tensors[0].dim()):
            shape = list(tensors[0].shape)
            shape[split_dim] *= world
            if math.prod(shape) != mm.out.numel() or shape[-1] != mm.out.shape[1]:
                continue
            if _same_views(tensors, mm.out.view(shape).chunk(world, split_dim)):
                cat_shape = (world * tensors[0].shape[0], *tensors[0].shape[1:])
                sv = ScatterView(self._placeholder(mm.out, cat_shape), torch.Size(shape), split_dim, world)
                self._store.add_scatter_view(mm, sv)
                self._trace.event(f"${mm.tid}': {tensor_str(sv.tensor)} = cat(${mm.tid}.chunk({world}, {split_dim}), 0)")
                return sv.tensor
        return None

    def _reduce_scatter(
        self,
        func: torch._ops.OpOverload,
        args: tuple,
        kwargs: dict,
        inp: torch.Tensor,
        reduce_op: str,
        group: dist.ProcessGroup,
        out: torch.Tensor | None = None,
    ) -> Any:
        """Issue a reduce-scatter (scatter dim 0) on a managed group, fused with
        the pending product that makes its input where there is one. ``out`` is
        the caller's output buffer (raw c10d), else a new tensor is returned."""
        world = group.size()
        kind = f"reduce_scatter({reduce_op})"
        if reduce_op not in REDUCE_OPS or inp.dim() == 0 or inp.shape[0] % world:
            # Plain eager either runs it (an op we have no ring for) or raises.
            why = f"reduce_op {reduce_op!r} has no point-to-point implementation"
            signature = scatter_signature(reduce_op, f"{world} ranks from {tensor_str(inp)}")
            return self._issue_as_is(func, args, kwargs, kind, inp, group, why, signature)
        too_small = self._backend.size_rule(inp.device.type, "reduce_scatter", inp.nbytes // world)
        if too_small is not None:
            out_str = f"{dtype_str(inp.dtype)}{[inp.shape[0] // world, *inp.shape[1:]]}"  # as tensor_str(out)
            signature = scatter_signature(reduce_op, out_str)
            return self._issue_as_is(func, args, kwargs, kind, inp, group, too_small, signature)
        if out is None:
            out = self._placeholder(inp, (inp.shape[0] // world, *inp.shape[1:]))
        record = self._new_record(kind, inp, out, group)
        found = self._store.standalone_output(inp) if self._store else None
        why_not = self._why_not_produce(found, out) if found is not None else (
            "its input is not the pending output of a matmul"
        )
        if found is not None and why_not is None:
            product, scatter_view = found
            self._store.remove(product)
            self._flush(f"{func} issued")  # earlier work first: same collective order
            plan = ReduceScatterPlan(out, reduce_op, group, record, product=product, scatter_view=scatter_view)
            self._issue(plan, "")
            # NB: the producer computed only what the reduce-scatter needs. The
            # program may still read the product's own output: it stays pending,
            # computed in full only if something reads it, skipped otherwise.
            product.absorbed = True
            self._store.add_product(product)
            return out
        if self._store:
            self._flush(f"{func} issued")
        plan = ReduceScatterPlan(out, reduce_op, group, record, inp=inp.contiguous())
        self._issue(plan, why_not)
        return out

    @staticmethod
    def _why_not_produce(found: tuple[Product, ScatterView | None], out: torch.Tensor) -> str | None:
        """Why a reduce-scatter cannot produce its chunks from this product, if it cannot."""
        product, scatter_view = found
        if scatter_view is None and out.numel() % product.out.shape[1]:
            return (
                f"its chunks {tensor_str(out)} are not whole rows of the matmul output "
                f"{tensor_str(product.out)}"
            )
        return None

    def _defer_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Defer ``x + y`` of two whole pending products (autograd accumulating an
        input gradient): a reduce-scatter of the sum can then produce each chunk
        as a sum of matmul rows. None if that is not it."""
        found_x, found_y = self._store.standalone_output(x), self._store.standalone_output(y)
        if found_x is None or found_y is None or found_x[1] is not None or found_y[1] is not None:
            return None
        (px, _), (py, _) = found_x, found_y
        if px is py or x.shape != y.shape or x.dtype != y.dtype or px.out.shape != py.out.shape:
            return None
        terms = [t for p in (px, py) for t in (p.terms if isinstance(p, PendingSum) else [p])]
        px.absorbed = py.absorbed = True
        total = PendingSum(terms, self._placeholder(px.out, px.out.shape), self._store.next_tid())
        self._store.add_product(total)
        self._trace.event(total.render())
        return total.out.view(x.shape)

    def _issue_as_is(
        self,
        func,
        args: tuple,
        kwargs: dict,
        kind: str,
        src: torch.Tensor,
        group: dist.ProcessGroup,
        reason: str,
        signature: str,
    ) -> Any:
        """Run a collective exactly as the program issued it (after everything
        pending: collective order) and record why it was not fused. ``signature``
        is what ``verify=True`` compares across ranks first, as for a plan."""
        if self._store:
            self._flush(f"{func} issued")
        if self.verify:
            _check_ranks_agree(signature, group)
        result = func(*args, **kwargs)
        dst = result[0] if isinstance(result, tuple) else result  # raw c10d: (output, work)
        record = self._new_record(kind, src, dst, group)
        self.stats[f"unfused_{kind.split('(')[0]}"] += 1
        self._trace.mark_unfused(record, reason)
        self._trace.event(f"{record.dst} = {kind}({record.src}, {record.group}) [as written]")
        return result

    def _new_record(
        self, kind: str, src: torch.Tensor, dst: torch.Tensor, group: dist.ProcessGroup
    ) -> CollectiveRecord:
        """The explain() record of a collective, with its tensors and group rendered."""
        return self._trace.new_collective(kind, src=tensor_str(src), dst=tensor_str(dst), group=group_str(group))


class _EagerTPMode(TorchDispatchMode):
    """The private dispatch mode behind ``EagerMicroPipeline``."""

    def __init__(self, pipeline: EagerMicroPipeline) -> None:
        super().__init__()
        self.pipeline = pipeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # NB: the hot path. Plain ops while nothing is pending cost one dict
        # lookup and two attribute reads on top of an empty mode.
        pipeline = self.pipeline
        if kwargs is None:
            kwargs = {}
        if types:  # tensor subclasses are involved
            if any(issubclass(t, _DESUGAR_FIRST) for t in types):
                return NotImplemented
            if any(_has_dispatch_override(t) for t in types):
                # Other subclasses (the FakeTensor of DTensor's sharding propagation)
                # never hold our placeholders: pass them through untouched.
                return func(*args, **kwargs)
        if pipeline._issuing:
            return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if handler is None:
            if not pipeline._store.items:
                return func(*args, **kwargs)
            handler = _passthrough
        return handler(pipeline, func, args, kwargs)


def _profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A named range in profiler traces; nothing (not even two dispatched ops)
    when no profiler runs."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


# Bytes per element of the widest output a fused reduce-scatter takes from a
# matmul: float32, also after autocast's cast of a half-precision one. (A cast
# to float64 of a matmul small by this bound is issued unfused: still right.)
_WIDEST_CAST = 4


def _has_dispatch_override(t: type) -> bool:
    return t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and not issubclass(
        t, torch.nn.Parameter
    )


@functools.cache
def _is_metadata_only(func: torch._ops.OpOverload) -> bool:
    return func in _PENDING_PASSTHROUGH or (func.is_view and not func._schema.is_mutable)


def _same_views(tensors: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
    """True if ``tensors`` are exactly the views ``expected``: the same storage,
    offsets, shapes and strides."""
    return len(tensors) == len(expected) and all(
        t.shape == e.shape
        and t.stride() == e.stride()
        and t.storage_offset() == e.storage_offset()
        and storage_key(t) == storage_key(e)
        for t, e in zip(tensors, expected)
    )


def _matmul_out_dtype(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scaled: Scaled | None
) -> tuple[torch.dtype | None, str]:
    """The output dtype of the matmul, or None and why if these operands do not
    defer (plain eager rejects them, or, for FP8, its meta kernel does)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or b.device != a.device:
        return None, f"{tensor_str(a)} @ {tensor_str(b)}"
    if scaled is not None:
        # FP8 rules (dtypes, layouts, scale shapes, alignment) are many: ask the
        # meta kernel, which applies CUDA's (stricter than CPU's).
        try:
            meta = torch._scaled_mm(
                *(t.to("meta") for t in (a, b, scaled.scale_a, scaled.scale_b)),
                bias=None if bias is None else bias.to("meta"),
                scale_result=None if scaled.scale_result is None else scaled.scale_result.to("meta"),
                out_dtype=scaled.out_dtype,
                use_fast_accum=scaled.use_fast_accum,
            )
        except (RuntimeError, ValueError, NotImplementedError) as e:
            return None, f"_scaled_mm's meta kernel: {str(e).splitlines()[0]}"
        return meta.dtype, ""
    if b.dtype != a.dtype or (bias is not None and (bias.dtype != a.dtype or bias.device != a.device)):
        return None, "mixed dtypes or devices"
    if bias is None:
        return a.dtype, ""
    out_shape = (a.shape[0], b.shape[1])
    try:
        if torch.broadcast_shapes(bias.shape, out_shape) == out_shape:
            return a.dtype, ""
    except RuntimeError:
        pass
    return None, f"bias {tensor_str(bias)} does not broadcast to {list(out_shape)}"


def _resolve_group(group_name: Any) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


def _check_ranks_agree(signature: str, group: dist.ProcessGroup) -> None:
    """verify=True: every rank issues the same collective, or all raise the same
    clear error (instead of mismatched messages, which gloo answers by aborting
    the process and NCCL by hanging or corrupting)."""
    signatures: list[str | None] = [None] * group.size()
    dist.all_gather_object(signatures, signature, group=group)
    if any(s != signature for s in signatures):
        per_rank = "; ".join(f"rank {r}: {s}" for r, s in enumerate(signatures))
        raise VerificationError(
            f"eagertp verify: ranks of {group_str(group)} issue different collectives at the "
            f"same point ({per_rank}). Every rank must issue the same collectives with the "
            f"same shapes in the same order."
        )


def _check_equal(
    what: str, got: torch.Tensor, want: torch.Tensor, group: dist.ProcessGroup, *, exact: bool
) -> None:
    try:
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(got, want, equal_nan=True)
    except AssertionError:
        diff = (got.double() - want.double()).abs()
        rel = diff / want.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
        raise VerificationError(
            f"eagertp verify: {what} differs from plain eager on rank {group.rank()}: "
            f"max abs diff {diff.max().item():.3g}, max rel diff {rel.max().item():.3g}. "
            f"Run with backend='reference' to take eagertp's pipeline out of the picture, "
            f"and report this with the shapes above."
        ) from None


# -- handlers ------------------------------------------------------------------
# NB: only the native _c10d_functional overloads: the legacy c10d_functional
# ones (tag, ranks, group_size) are gone from every torch eagertp supports
# (>= 2.11), so there is nothing there to intercept.


@_register([_c10d_functional.all_gather_into_tensor.default])
def _all_gather(p: EagerMicroPipeline, func, args, kwargs):
    shard, group_size, group_name = args
    group = _managed_group(p, func, group_size, group_name)
    if group is None:
        return func(*args, **kwargs)
    too_small = p._backend.size_rule(shard.device.type, "all_gather", shard.nbytes)
    if too_small is not None:
        return p._issue_as_is(func, args, kwargs, "all_gather", shard, group, too_small, gather_signature(shard))
    if p._store:
        p._flush(f"{func} issued")  # Note [Deferral boundary]: one pending collective
    return p._defer_gather(shard, group)


def _managed_group(p: EagerMicroPipeline, func, group_size: int, group_name: Any) -> dist.ProcessGroup | None:
    """The collective's group if the mode manages it; otherwise None, after
    issuing everything pending (the collective passes through in program order)."""
    group = _resolve_group(group_name)
    if not p._manages(group):
        if p._store:
            p._flush(f"{func} issued on unmanaged {group_str(group)}")
        return None
    if group_size != group.size():
        raise ValueError(
            f"{func}: group_size={group_size} but {group_str(group)} has "
            f"{group.size()} ranks; pass the group's size"
        )
    return group


@_register([_c10d_functional.wait_tensor.default])
def _wait(p: EagerMicroPipeline, func, args, kwargs):
    (t,) = args
    if p._store and p._store.touched([t]) is not None:
        return t  # a placeholder: its data arrives when the gather is issued
    return func(*args, **kwargs)


@_register([_c10d_functional._wrap_tensor_autograd.default])
def _wrap_async(p: EagerMicroPipeline, func, args, kwargs):
    # funcol wraps every collective's result in an AsyncCollectiveTensor; the
    # wrapper reads nothing and communicates nothing, so a placeholder stays pending.
    return func(*args, **kwargs)


@_register([_c10d_functional.reduce_scatter_tensor.default])
def _reduce_scatter(p: EagerMicroPipeline, func, args, kwargs):
    inp, reduce_op, group_size, group_name = args
    group = _managed_group(p, func, group_size, group_name)
    if group is None:
        return func(*args, **kwargs)
    return p._reduce_scatter(func, args, kwargs, inp, reduce_op.lower(), group)


# -- raw c10d (Megatron-style code): the caller's output buffer is the placeholder


def _work(output: torch.Tensor) -> Any:
    """The ``Work`` a raw c10d collective returns under the mode: a finished one.

    The collective is either deferred (its output buffer is a placeholder whose
    data arrives before anything can read it) or already complete, so waiting
    is immediate and the future holds the output buffer, as a real one does.
    """
    # NB: a Python subclass of dist.Work would die with its last Python reference
    # while C++ still holds the Work (whose wait() then blocks forever); a Work
    # wrapping a completed future is a plain C++ object. A c10d op returns Work
    # as a TorchBind object: boxed() makes one.
    future: torch.futures.Future = torch.futures.Future()
    future.set_result([output])
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


_REDUCE_OP_NAMES = {
    int(dist.ReduceOp.RedOpType.SUM): "sum",
    int(dist.ReduceOp.RedOpType.AVG): "avg",
    int(dist.ReduceOp.RedOpType.MAX): "max",
    int(dist.ReduceOp.RedOpType.MIN): "min",
    int(dist.ReduceOp.RedOpType.PRODUCT): "product",
}


def _c10d_group(p: EagerMicroPipeline, func, process_group: Any) -> dist.ProcessGroup | None:
    """Like _managed_group, for a raw c10d op's TorchBind ProcessGroup."""
    group = dist.ProcessGroup.unbox(process_group)
    return _managed_group(p, func, group.size(), group)


@_register([c10d_ops._allgather_base_.default])
def _c10d_all_gather(p: EagerMicroPipeline, func, args, kwargs):
    """``dist.all_gather_into_tensor`` / ``all_gather_single`` / ``_all_gather_base``."""
    output, shard, process_group = args[:3]
    group = _c10d_group(p, func, process_group)
    if group is None:
        return func(*args, **kwargs)
    world = group.size()
    if shard.dim() == 0 or not output.is_contiguous() or output.numel() != world * shard.numel():
        return _passthrough(p, func, args, kwargs)  # plain eager accepts it or raises
    too_small = p._backend.size_rule(shard.device.type, "all_gather", shard.nbytes)
    if too_small is not None:
        return p._issue_as_is(func, args, kwargs, "all_gather", shard, group, too_small, gather_signature(shard))
    if p._store:
        p._flush(f"{func} issued")  # Note [Deferral boundary]: one pending collective
    p._defer_gather(shard, group, out=output.view(world * shard.shape[0], *shard.shape[1:]))
    return output, _work(output)


@_register([c10d_ops._reduce_scatter_base_.default])
def _c10d_reduce_scatter(p: EagerMicroPipeline, func, args, kwargs):
    """``dist.reduce_scatter_tensor`` / ``reduce_scatter_single`` / ``_reduce_scatter_base``."""
    output, inp, process_group, reduce_op = args[:4]
    group = _c10d_group(p, func, process_group)
    if group is None:
        return func(*args, **kwargs)
    world = group.size()
    name = _REDUCE_OP_NAMES.get(reduce_op.op(), f"c10d reduce op {reduce_op.op()}")
    if inp.dim() == 0 or inp.shape[0] % world or not output.is_contiguous() or output.numel() * world != inp.numel():
        return _passthrough(p, func, args, kwargs)  # plain eager accepts it or raises
    out = output.view(inp.shape[0] // world, *inp.shape[1:])
    result = p._reduce_scatter(func, args, kwargs, inp, name, group, out=out)
    return result if isinstance(result, tuple) else (output, _work(output))


@_register([aten.add.Tensor])
def _add(p: EagerMicroPipeline, func, args, kwargs):
    if p._store and len(args) == 2 and kwargs.get("alpha", 1) == 1 and all(isinstance(t, torch.Tensor) for t in args):
        deferred = p._defer_sum(*args)
        if deferred is not None:
            return deferred
    return _passthrough(p, func, args, kwargs)


def _passthrough(p: EagerMicroPipeline, func, args, kwargs):
    """What an op without a handler gets while work is pending."""
    if p._store.items and func.namespace not in _COLLECTIVE_NAMESPACES and _is_composite(func):
        if p._store.touched(tensor_leaves(args, kwargs)) is not None:
            # NB: composite ops (matmul, linear) reach the mode whole when autograd
            # is off (inference_mode); their decomposition (view -> mm ->
            # _unsafe_view) is what the handlers understand. Re-enter the mode so
            # the decomposed ops come back here.
            assert p._mode is not None, "dispatch outside the block"
            with p._mode:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
    if p._store.items:
        p._flush_if_needed(func, args, kwargs)
    return func(*args, **kwargs)


@functools.cache
def _is_composite(func: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


@_register([aten._to_copy.default])
def _to_copy(p: EagerMicroPipeline, func, args, kwargs):
    """A dtype cast of a whole gathered tensor (autocast before a linear) becomes
    a cast view, filled chunk by chunk: the linear on it still fuses."""
    dtype = kwargs.get("dtype")
    if p._store and len(args) == 1 and set(kwargs) <= _CAST_KWARGS and dtype is not None:
        (t,) = args
        if _only_changes_dtype(t, kwargs):
            found = p._store.gathered_view_of(t)
            if found is not None and _same_views([t], [found[1].tensor]):
                return p._defer_cast(*found, dtype)
            product = p._store.standalone_output(t)  # only whole outputs
            if product is not None and product[1] is None:
                return p._defer_product_cast(product[0], t, dtype)
    return _passthrough(p, func, args, kwargs)


# _to_copy's keywords a plain dtype cast may carry.
_CAST_KWARGS = frozenset({"dtype", "layout", "device", "non_blocking", "memory_format"})


def _only_changes_dtype(t: torch.Tensor, kwargs: dict) -> bool:
    """True if ``_to_copy(t, **kwargs)`` changes nothing but the dtype."""
    return (
        kwargs.get("layout", torch.strided) == torch.strided
        and torch.device(kwargs.get("device", t.device)) == t.device
        and kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format)
    )


@_register([aten.cat.default])
def _cat(p: EagerMicroPipeline, func, args, kwargs):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if p._store:
        deferred = p._defer_chunk_cat(tensors, dim)
        if deferred is not None:
            return deferred
    return _passthrough(p, func, args, kwargs)


@_register([aten.mm.default])
def _mm(p: EagerMicroPipeline, func, args, kwargs):
    a, b = args
    return p._defer_matmul(func, args, kwargs, a, b)


@_register([aten.addmm.default])
def _addmm(p: EagerMicroPipeline, func, args, kwargs):
    bias, a, b = args
    return p._defer_matmul(func, args, kwargs, a, b, bias)


_SCALED_MM_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")


@_register([aten._scaled_mm.default])
def _scaled_mm(p: EagerMicroPipeline, func, args, kwargs):
    """FP8 linears (float8 training): fused like mm, the scales riding along."""
    bound = {**dict(zip(_SCALED_MM_ARGS, args)), **kwargs}
    scaled = Scaled(
        bound["scale_a"],
        bound["scale_b"],
        bound.get("scale_result"),
        bound.get("out_dtype"),
        bool(bound.get("use_fast_accum", False)),
    )
    return p._defer_matmul(func, args, kwargs, bound["self"], bound["mat2"], bound.get("bias"), scaled)
