"""funcol's all-reduce, out of place and in place: run where the program
issues it, fused with the pending matmul (or sum of matmuls) that makes its
input as a reduce-scatter produced chunk by chunk, then an all-gather of the
reduced shard left in flight for the matmuls that read the result (Note
[Matmul + all-reduce] below). DTensor's ``Partial -> Replicate``
redistributes desugar to the out-of-place op; raw c10d's ``dist.all_reduce``
is in ``eagertp.collectives.c10d``, which runs it the same way."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from eagertp._format import tensor_str
from eagertp.backends.base import REDUCE_OPS
from eagertp.collectives.reduce_scatter import why_not_produce
from eagertp.deferred import PendingGather, Product, ScatterView
from eagertp.engine import Engine
from eagertp.issuing import profiler_range
from eagertp.patterns import ReduceScatterPlan
from eagertp.table import register
from eagertp.trace import Text
from eagertp.verify import check_equal, check_ranks_agree

_c10d_functional = torch.ops._c10d_functional


@register([_c10d_functional.all_reduce.default, _c10d_functional.all_reduce_.default])
def _all_reduce(engine: Engine, func, args, kwargs):
    inp, reduce_op, group_name = args
    # NB: funcol's all-reduce names no group size: the group's own is right by definition.
    # isinstance(x, ProcessGroup) is a Python __instancecheck__; funcol passes a name.
    group = c10d._resolve_process_group(group_name) if isinstance(group_name, str) else group_name
    group = engine.managed_group(func, group.size(), group)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    in_place = func is _c10d_functional.all_reduce_.default
    return all_reduce(engine, func, args, kwargs, inp, reduce_op.lower(), group, in_place=in_place)


# Note [Matmul + all-reduce]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# TP without sequence parallel all-reduces a row-parallel linear's output
# (and, in backward, a column-parallel linear's input gradient). Fuse::
#
#     C = mm(A, B)                          # or addmm, _scaled_mm, a sum of them, their cast
#     C = all_reduce(C, op, group)          # funcol, all_reduce_, dist.all_reduce
#
# into its two halves, both started at the program point by one backend
# call (``Backend.start_all_reduce``), with the result viewed as rows [M, N]:
#
#     shard = reduce_scatter(C, op)         # produced chunk by chunk: ReduceScatterPlan
#                                           # with C's product as producer, written into
#                                           # rows [rank*m, (rank+1)*m) of the result
#     result = all_gather(shard)            # started at once: a gather in flight into
#                                           # the result itself
#
# Each element is reduced once, by the rank that owns its rows, then copied
# to every rank: all ranks hold the same bits. The gather half is a gather
# in flight like any other: a following matmul on the all-reduced tensor
# binds to it and runs chunk by chunk as the reduced shards land. On 2
# ranks, rank 0 (``P[c]``: C's rows of chunk c; ``mm[i]``: a following
# matmul on rank i's reduced rows)::
#
#     program: C = A @ B   all_reduce(C)  ....................... D = C @ W   read(D)
#     comm:                [ send P[1] ][ recv ][ AG: -> 1, <- 1 ........ ]
#     compute:             [ P[1] ]  [ P[0] ][+]       (other work)     [ mm[0] ][ mm[1] ]
#
# On 2 ranks the ring interleaves the halves, in pieces: each reduced piece
# of this rank's rows goes out as soon as it is added (Note [Interleaved
# all-reduce] in eagertp.backends.ring). The messages depend on the shapes
# only, whatever fuses with either half (Invariant 2): an input that is not
# a pending product takes the same messages with its chunks copied, unfused
# with the reason, as a peer may fuse its own. (Reduced in place, an input
# that pending work reads completes that work first, as any write does.)
# Issued as written (with the reason), for reasons every rank
# shares: rows that do not split over the ranks, a reduce op without a
# point-to-point implementation, the size rule.


def all_reduce(
    engine: Engine,
    func: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    inp: torch.Tensor,
    reduce_op: str,
    group: dist.ProcessGroup,
    *,
    in_place: bool,
) -> Any:
    """Run an all-reduce on a managed group now: fused with the pending
    product that makes its input where there is one (Note [Matmul +
    all-reduce]), else as the program wrote it. ``in_place``: the result is
    ``inp`` itself (``all_reduce_``, raw c10d), else a new tensor."""
    world = group.size()
    kind = f"all_reduce({reduce_op})"
    as_written = _why_all_reduce_as_written(engine, inp, reduce_op, world, in_place)
    if as_written is not None:
        signature = f"{kind} of {tensor_str(inp)}"
        return engine.issue_as_is(func, args, kwargs, kind, inp, group, as_written, signature)
    engine.unbind_consumer(inp, func)
    if in_place:  # Note [Every write is seen] in eagertp.engine: its product is ours to take
        engine.before_write(func, [inp], owners=False, takes=inp)
    result = inp if in_place else engine.placeholder(inp, inp.shape)
    rows = result.view(-1, result.shape[-1])  # [M, N]: a product's rows, whatever view it is reduced in
    m = rows.shape[0] // world
    shard = rows[group.rank() * m : (group.rank() + 1) * m]  # this rank's reduced rows
    # NB: one that reads no pending product marks none past its collective
    # (Note [Products past their collective]: float8's amax all-reduces).
    record = engine.new_record(kind, inp, result, group, marks_past=engine.store.touched([inp]) is not None)
    found = engine.store.standalone_output(inp) if engine.store.items else None
    why_not = engine.not_pending_reason(inp) if found is None else _why_not_fuse_all_reduce(found, shard, world)
    if why_not is None:
        product, _ = found
        if in_place:  # the all-reduce overwrites its output: nothing reads the product after
            engine.store.remove(product)
        plan = ReduceScatterPlan(shard, reduce_op, group, record, product=product)
    else:
        # NB: still the ring's messages (Invariant 2): a peer may fuse its own.
        if engine.store.touched([inp]) is not None:
            engine.complete_owners([inp], func)
        # In place, the ring overwrites inp as it goes: verify's reference reads a copy.
        src = inp.clone() if in_place and engine.verify else inp.contiguous()
        plan = ReduceScatterPlan(shard, reduce_op, group, record, inp=src.view(rows.shape))
    if plan.fused:
        engine.count_matmul_work()
    # The gather half: a gather in flight into the result, sharing the record.
    gather = PendingGather(
        shard, rows, group, engine.store.next_tid(), record, work_at_start=engine.matmul_work, half_of_all_reduce=True
    )
    if torch.autograd._profiler_enabled():
        with profiler_range(f"eagertp::{'matmul_' if plan.fused else ''}all_reduce"):
            _start(engine, plan, gather, kind)
    else:  # NB: the hot path: no profiler, no context manager
        _start(engine, plan, gather, kind)
    engine.add_gather(gather)
    if not plan.fused:
        engine.stats["unfused_all_reduce"] += 1
        engine.trace.mark_unfused(record, why_not, gather.backend)
        if engine.trace.recording:
            engine.trace.event("all_reduce({}, {}) [{}]", reduce_op, record.src, gather.backend)
        return result
    if not in_place:
        # NB: as after a fused reduce-scatter, the product's own output
        # stays readable (computed in full only if read). In place, the
        # all-reduce overwrote it: nothing can read it any more.
        product.absorbed = True
    # NB: after the start: the gather half is in flight behind them.
    engine.complete_before(func, product)
    engine.stats["matmul_all_reduce"] += 1
    engine.trace.mark_fused(record, plan.fused_with(), gather.backend)
    if engine.trace.recording:
        engine.trace.event("matmul_all_reduce({}, ${}) [{}]", reduce_op, product.tid, gather.backend)
    return result


def _start(engine: Engine, plan: ReduceScatterPlan, gather: PendingGather, kind: str) -> None:
    """Start the all-reduce of ``plan`` (its reduce-scatter half) and ``gather``
    (its all-gather half) on the backend."""
    with engine.issuing_work():
        rows, group = gather.out, plan.group
        if engine.verify:
            check_ranks_agree(f"{kind} of {tensor_str(rows)}", group)  # NB: before the backend is chosen
        backend, gather.backend = engine.backend.for_collective(gather.shard, group)
        gather.handle = backend.start_all_reduce(plan.producer(), rows, group, plan.reduce_op)
        if engine.verify:
            for what, got, want, exact in plan.checks():  # this rank's reduced rows
                check_equal(what, got, want, group, exact=exact)
            engine.gather_reference(gather)


def _why_all_reduce_as_written(
    engine: Engine, inp: torch.Tensor, reduce_op: str, world: int, in_place: bool
) -> Text | None:
    """Why an all-reduce of ``inp`` is issued as the program wrote it, if it
    is: reasons that read shapes only, so that every rank decides alike."""
    if reduce_op not in REDUCE_OPS:
        return f"reduce_op {reduce_op!r} has no point-to-point implementation"
    too_small = engine.backend.size_rule(inp.device.type, "all_reduce", inp.nbytes // world)
    if too_small is not None:
        return too_small
    if inp.numel() == 0:
        return "it is empty"
    if inp.dim() < 2:
        return f"{tensor_str(inp)} is one row (all dims but the last), which does not split over {world} ranks"
    if inp.numel() // inp.shape[-1] % world:
        return f"the rows of {tensor_str(inp)} (all dims but the last) do not split over {world} ranks"
    if in_place and not inp.is_contiguous():
        return f"it reduces a non-contiguous {tensor_str(inp)} in place"
    return None


def _why_not_fuse_all_reduce(found: tuple[Product, ScatterView | None], shard: torch.Tensor, world: int) -> str | None:
    """Why the ring all-reduce of ``inp``, a pending product's output (or a
    view of one), cannot produce its chunks from it, if it cannot (then it
    copies them from ``inp``)."""
    if found[1] is not None:
        return "its input is not the pending output of a matmul"
    return why_not_produce(found, shard, world)
