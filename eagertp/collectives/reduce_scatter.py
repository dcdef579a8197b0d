"""funcol's reduce-scatter: run where the program issues it, fused with the
pending matmul (or sum of matmuls) that makes its input. Raw c10d's
``dist.reduce_scatter_tensor`` (``eagertp.collectives.c10d``) runs it the same
way, and the all-reduce (``eagertp.collectives.all_reduce``) produces its
reduce-scatter half by the same rule (``why_not_produce``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from eagertp._format import dtype_str, tensor_str
from eagertp.backends.base import REDUCE_OPS
from eagertp.deferred import Product, ScatterView
from eagertp.engine import Engine
from eagertp.issuing import profiler_range
from eagertp.patterns import ReduceScatterPlan, scatter_signature
from eagertp.table import register
from eagertp.verify import check_equal, check_ranks_agree

_c10d_functional = torch.ops._c10d_functional


@register([_c10d_functional.reduce_scatter_tensor.default])
def _reduce_scatter(engine: Engine, func, args, kwargs):
    inp, reduce_op, group_size, group_name = args
    group = engine.managed_group(func, group_size, group_name)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    return reduce_scatter(engine, func, args, kwargs, inp, reduce_op.lower(), group)


def reduce_scatter(
    engine: Engine,
    func: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    inp: torch.Tensor,
    reduce_op: str,
    group: dist.ProcessGroup,
    out: torch.Tensor | None = None,
) -> Any:
    """Run a reduce-scatter (scatter dim 0) on a managed group now, fused with
    the pending product that makes its input where there is one. ``out`` is
    the caller's output buffer (raw c10d), else a new tensor is returned.
    Gathers in flight stay in flight: they started earlier, in program order."""
    world = group.size()
    kind = f"reduce_scatter({reduce_op})"
    if reduce_op not in REDUCE_OPS or inp.dim() == 0 or inp.shape[0] % world:
        # Plain eager either runs it (an op we have no ring for) or raises.
        why = f"reduce_op {reduce_op!r} has no point-to-point implementation"
        signature = scatter_signature(reduce_op, f"{world} ranks from {tensor_str(inp)}")
        return engine.issue_as_is(func, args, kwargs, kind, inp, group, why, signature)
    too_small = engine.backend.size_rule(inp.device.type, "reduce_scatter", inp.nbytes // world)
    if too_small is not None:
        out_str = f"{dtype_str(inp.dtype)}{[inp.shape[0] // world, *inp.shape[1:]]}"  # as tensor_str(out)
        signature = scatter_signature(reduce_op, out_str)
        return engine.issue_as_is(func, args, kwargs, kind, inp, group, too_small, signature)
    engine.unbind_consumer(inp, func)
    if out is None:
        out = engine.placeholder(inp, (inp.shape[0] // world, *inp.shape[1:]))
    # NB: one that reads no pending product marks none past its collective.
    record = engine.new_record(kind, inp, out, group, marks_past=engine.store.touched([inp]) is not None)
    found = engine.store.standalone_output(inp) if engine.store.items else None
    why_not = why_not_produce(found, out, world) if found is not None else engine.not_pending_reason(inp)
    if found is not None and why_not is None:
        product, scatter_view = found
        engine.complete_before(func, product)  # NB: before the scatter allocates its buffers
        plan = ReduceScatterPlan(out, reduce_op, group, record, product=product, scatter_view=scatter_view)
        _issue(engine, plan, "")
        # NB: the producer computed only what the reduce-scatter needs. The
        # program may still read the product's own output: it stays pending,
        # computed in full only if something reads it, skipped otherwise.
        product.absorbed = True
        return out
    if engine.store.touched([inp]) is not None:
        engine.complete_owners([inp], func)
    plan = ReduceScatterPlan(out, reduce_op, group, record, inp=inp.contiguous())
    _issue(engine, plan, why_not)
    return out


def _issue(engine: Engine, plan: ReduceScatterPlan, unfused_reason: str) -> None:
    """Run a reduce-scatter's plan on the backend now, and account for it."""
    fused, name = plan.fused, plan.name
    if fused:
        engine.count_matmul_work()
    if torch.autograd._profiler_enabled():
        with profiler_range(f"eagertp::{name}"):
            label = _run_scatter(engine, plan)
    else:  # NB: the hot path: no profiler, no context manager
        label = _run_scatter(engine, plan)
    if fused:
        engine.stats[name] += 1
        engine.trace.mark_fused(plan.record, plan.fused_with(), label)
    else:
        engine.stats[f"unfused_{plan.kind}"] += 1
        engine.trace.mark_unfused(plan.record, unfused_reason, label)
    if engine.trace.recording:
        engine.trace.event(*plan.trace_event(label))


def _run_scatter(engine: Engine, plan: ReduceScatterPlan) -> str:
    """Run a reduce-scatter's plan on the backend now (verified with
    ``verify=True``); the backend's label for explain()."""
    with engine.issuing_work():
        if engine.verify:
            # NB: before the backend is chosen (see Engine.start_gather).
            check_ranks_agree(plan.signature(), plan.group)
        backend, label = engine.backend.for_collective(plan.buffer, plan.group)
        plan.run(backend)
        if engine.verify:
            for what, got, want, exact in plan.checks():
                check_equal(what, got, want, plan.group, exact=exact)
    return label


def why_not_produce(found: tuple[Product, ScatterView | None], out: torch.Tensor, world: int) -> str | None:
    """Why a reduce-scatter over ``world`` ranks cannot produce its chunks from
    this product, if it cannot."""
    product, scatter_view = found
    if scatter_view is not None and scatter_view.world != world:
        # NB: cat(y.chunk(W, d), 0) is funcol's reshuffle for W ranks; chunk()
        # makes fewer pieces where dim d is short (a batch of one: one piece).
        if scatter_view.world == 1:
            return f"its input is a copy of the matmul output {tensor_str(product.out)}, not cut into {world} chunks"
        return (
            f"its input is the matmul output {tensor_str(product.out)} cut into {scatter_view.world} "
            f"chunks along dim {scatter_view.dim} and concatenated, not into the group's {world}"
        )
    if scatter_view is None and out.numel() % product.out.shape[1]:
        return (
            f"its chunks {tensor_str(out)} are not whole rows of the matmul output "
            f"{tensor_str(product.out)}"
        )
    return None
