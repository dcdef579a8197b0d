"""``EagerMicroPipeline``: micro-pipelined tensor parallelism at run time.

The mode defers every all-gather on a group it manages and hands the program a
placeholder. Matmuls whose ``A`` is that placeholder are deferred too (their
outputs are placeholders). When something needs the data (any other reader, a
collective, ``flush()``, leaving the block) the pending work is issued, each
gather fused with its matmuls, in the order the program issued it::

    >>> with EagerMicroPipeline() as pipe:
    ...     x = funcol.all_gather_tensor(x_shard, 0, tp_group)   # deferred
    ...     q, k, v = x @ wq, x @ wk, x @ wv                     # deferred
    ...     y = attention(q, k, v)                               # flush: ONE fused call
    >>> print(pipe.explain())
    all_gather #0 f32[4, 16] -> f32[8, 16] on group '1' (2 ranks): fused with mm -> $1, mm -> $2, mm -> $3 [ring]

The mode lives on the dispatch-mode stack of the thread that entered it
(``TorchDispatchMode`` state is thread-local): ops from other threads are not
seen. One instance is active at most once at a time; nested blocks need
separate instances, and the inner one sees ops first.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from eagertp._format import group_str, tensor_str
from eagertp.backends import resolve_backend
from eagertp.deferred import PendingGather, PendingMatmul, PendingStore, tensor_leaves
from eagertp.patterns import AllGatherMatmulPlan
from eagertp.trace import Trace

__all__ = ["EagerMicroPipeline", "VerificationError"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
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
    """Fuse all-gather + matmul at run time, with no compile step.

    Args:
        group: manage only collectives on this process group (e.g. the TP group,
            so FSDP's all-gathers pass through untouched). Default: every group.
        backend: ``"auto"`` (currently ``"ring"``), ``"ring"`` (micro-pipeline over
            point-to-point ops, any process group) or ``"reference"`` (plain
            collective then matmul).
        verify: after each issued collective, recompute it unfused and raise
            ``VerificationError`` naming the op, shapes and difference if the
            results disagree. Costs one extra collective per gather.
        max_records: bound on the trace and ``explain()`` records kept.

    Attributes:
        stats: counters. ``all_gather_matmul`` (fused calls issued),
            ``fused_matmuls`` (matmuls inside them), ``unfused_all_gather``,
            ``unfused_reduce_scatter``, ``matmul_reduce_scatter`` (fused; not yet).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        verify: bool = False,
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
        self.stats: collections.Counter[str] = collections.Counter()
        self._backend = resolve_backend(backend)
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
        try:
            reason = "block exited" if exc is None else f"block exited by {exc_type.__name__}"
            self._flush(reason)
        except Exception:
            if exc is None:
                raise
            # The block's own exception is the one the user must see.
            log.exception("eagertp: flush while leaving the block after %r failed", exc)
        finally:
            mode, self._mode = self._mode, None  # break the pipeline <-> mode cycle
            assert mode is not None, "__exit__ without __enter__"
            mode.__exit__(None, None, None)

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

    def _dispatch(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self, func, args, kwargs)
        if self._store:
            self._flush_if_needed(func, args, kwargs)
        return func(*args, **kwargs)

    def _manages(self, group: dist.ProcessGroup) -> bool:
        return self.group is None or group.group_name == self.group.group_name

    def _flush_if_needed(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        """Flush before ``func`` if it communicates, reads pending data, or writes
        a tensor that pending work will read."""
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self._flush(f"{func} issued")
            return
        tensors = tensor_leaves((args, kwargs))
        touched = self._store.touched(tensors)
        if touched is not None:
            if _is_metadata_only(func):
                return
            self._flush(f"{func} read ${self._store.tid_of(touched)}")
        elif func._schema.is_mutable and any(self._store.is_input(t) for t in tensors):
            self._flush(f"{func} wrote an input of pending work")

    def _flush(self, reason: str) -> None:
        gathers = self._store.drain()
        if not gathers:
            return
        self._trace.event(f"flush: {reason}")
        self._issuing = True
        try:
            # Issue every gather even if one fails, so that peers waiting on the
            # later ones are not left hanging; then raise the first failure.
            failure: BaseException | None = None
            for gather in gathers:
                try:
                    self._issue(AllGatherMatmulPlan(gather), reason)
                except BaseException as e:  # noqa: B036 - re-raised below
                    failure = failure or e
            if failure is not None:
                raise failure
        finally:
            self._issuing = False

    def _issue(self, plan: AllGatherMatmulPlan, reason: str) -> None:
        g = plan.gather
        backend = self._backend
        # NB: placeholders are filled below autograd: tensors autograd saved for
        # backward are these same storages, and their version counters must not move.
        with torch.profiler.record_function(f"eagertp::{plan.name}"), torch._C._AutoDispatchBelowADInplaceOrView():
            backend.all_gather_consume(g.shard, plan.consumer(), g.out, g.group)
            if self.verify:
                self._verify(plan)
        if plan.fused:
            self.stats["all_gather_matmul"] += 1
            self.stats["fused_matmuls"] += len(g.consumers)
            self._trace.mark_fused(g.record, [mm.describe() for mm in g.consumers], backend.name)
        else:
            self.stats["unfused_all_gather"] += 1
            self._trace.mark_unfused(g.record, f"no matmul consumed it before {reason}", backend.name)
        self._trace.event(f"{plan.render()} [{backend.name}]")

    def _verify(self, plan: AllGatherMatmulPlan) -> None:
        g = plan.gather
        ag_ref, mm_refs = plan.reference()
        what = f"all_gather {tensor_str(g.shard)} -> {tensor_str(g.out)} on {group_str(g.group)}"
        _check_equal(what, g.out, ag_ref, g.group, exact=True)
        for mm, ref in zip(g.consumers, mm_refs):
            _check_equal(
                f"{mm.op} of {what} with B {tensor_str(mm.b)}", mm.out, ref, g.group, exact=False
            )

    # -- deferral ----------------------------------------------------------

    def _defer_gather(self, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        shard = shard.contiguous()
        out = shard.new_empty((shard.shape[0] * group.size(), *shard.shape[1:]))
        record = self._trace.new_collective(
            "all_gather", src=tensor_str(shard), dst=tensor_str(out), group=group_str(group)
        )
        gather = PendingGather(shard, out, group, self._store.next_tid(), record)
        self._store.add_gather(gather)
        self._trace.event(
            f"${gather.tid}: {tensor_str(out)} = all_gather({tensor_str(shard)}, {group_str(group)})"
        )
        return out

    def _defer_matmul(
        self,
        func: torch._ops.OpOverload,
        args: tuple,
        kwargs: dict,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        gather = self._store.gather_output_of(a) if self._store else None
        if gather is None:
            if self._store:
                self._flush_if_needed(func, args, kwargs)
            return func(*args, **kwargs)
        why_not = self._why_not_fusable(gather, a, b, bias)
        if why_not is not None:
            self._flush(f"{func} {why_not}")
            return func(*args, **kwargs)
        mm = PendingMatmul(
            func,
            b,
            a.new_empty((a.shape[0], b.shape[1])),
            self._store.next_tid(),
            bias,
            beta=kwargs.get("beta", 1),
            alpha=kwargs.get("alpha", 1),
        )
        self._store.add_matmul(gather, mm)
        operands = f"${gather.tid}, {tensor_str(b)}"
        if bias is not None:
            operands = f"{tensor_str(bias)}, {operands}"
        self._trace.event(f"${mm.tid}: {tensor_str(mm.out)} = {func.__name__.split('.')[0]}({operands})")
        return mm.out

    def _why_not_fusable(
        self, gather: PendingGather, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
    ) -> str | None:
        if a.numel() == 0:
            return "reads an empty gathered tensor: there is nothing to overlap"
        if gather.rows_per_rank(a) is None:
            return (
                f"reads the gathered tensor as {tensor_str(a)} with strides {a.stride()}, "
                f"which does not split into per-rank row blocks"
            )
        others = [b] if bias is None else [b, bias]
        if self._store.touched(others) is not None:
            return "has a second pending operand"
        if b.dim() != 2 or b.shape[0] != a.shape[1] or any(
            t.dtype != a.dtype or t.device != a.device for t in others
        ):
            return f"has operands {tensor_str(a)} and {tensor_str(b)} that plain mm would reject"
        if bias is not None and torch.broadcast_shapes(bias.shape, (a.shape[0], b.shape[1])) != (
            a.shape[0],
            b.shape[1],
        ):
            return f"has bias {tensor_str(bias)} that does not broadcast to the output"
        return None


class _EagerTPMode(TorchDispatchMode):
    """The private dispatch mode behind ``EagerMicroPipeline``."""

    def __init__(self, pipeline: EagerMicroPipeline) -> None:
        super().__init__()
        self.pipeline = pipeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.pipeline._issuing:
            return func(*args, **kwargs)
        if any(issubclass(t, _DESUGAR_FIRST) for t in types):
            return NotImplemented
        if any(_has_dispatch_override(t) for t in types):
            # Other subclasses (the FakeTensor of DTensor's sharding propagation)
            # never hold our placeholders: pass them through untouched.
            return func(*args, **kwargs)
        return self.pipeline._dispatch(func, args, kwargs)


def _has_dispatch_override(t: type) -> bool:
    return t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and not issubclass(
        t, torch.nn.Parameter
    )


def _is_metadata_only(func: torch._ops.OpOverload) -> bool:
    return func in _PENDING_PASSTHROUGH or (func.is_view and not func._schema.is_mutable)


def _resolve_group(group_name: Any) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


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
    return _maybe_defer_gather(p, func, args, kwargs, shard, group_size, _resolve_group(group_name))


def _maybe_defer_gather(p, func, args, kwargs, shard, group_size, group):
    if not p._manages(group):
        if p._store:
            p._flush(f"{func} issued on unmanaged {group_str(group)}")
        return func(*args, **kwargs)
    if group_size != group.size():
        raise ValueError(
            f"{func}: group_size={group_size} but {group_str(group)} has "
            f"{group.size()} ranks; pass the group's size"
        )
    if p._store:
        # The shard must hold data when the gather is eventually issued, and
        # earlier pending work must be issued first in any case (same order).
        p._flush_if_needed(func, (shard,), {})
    return p._defer_gather(shard, group)


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
    inp, reduce_op, _, group_name = args
    return _pass_reduce_scatter(p, func, args, kwargs, inp, reduce_op, _resolve_group(group_name))


def _pass_reduce_scatter(p, func, args, kwargs, inp, reduce_op, group):
    if p._store:
        p._flush(f"{func} issued")
    out = func(*args, **kwargs)
    if p._manages(group):
        record = p._trace.new_collective(
            f"reduce_scatter({reduce_op})",
            src=tensor_str(inp),
            dst=tensor_str(out),
            group=group_str(group),
        )
        p.stats["unfused_reduce_scatter"] += 1
        p._trace.mark_unfused(record, "matmul + reduce-scatter fusion is not implemented yet")
        p._trace.event(f"{tensor_str(out)} = reduce_scatter({reduce_op}, {tensor_str(inp)}) [unfused]")
    return out


@_register([aten.mm.default])
def _mm(p: EagerMicroPipeline, func, args, kwargs):
    a, b = args
    return p._defer_matmul(func, args, kwargs, a, b)


@_register([aten.addmm.default])
def _addmm(p: EagerMicroPipeline, func, args, kwargs):
    bias, a, b = args
    return p._defer_matmul(func, args, kwargs, a, b, bias)
