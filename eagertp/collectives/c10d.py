"""Raw c10d collectives (Megatron-style code): ``dist.all_gather_into_tensor``,
``dist.reduce_scatter_tensor``, ``dist.all_reduce`` and their aliases, sync or
``async_op=True``.
The caller's output buffer is the placeholder."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from eagertp.collectives.all_reduce import all_reduce
from eagertp.collectives.reduce_scatter import reduce_scatter
from eagertp.engine import Engine
from eagertp.patterns import gather_signature
from eagertp.table import register

c10d_ops = torch.ops.c10d


def _work(output: torch.Tensor) -> Any:
    """The ``Work`` a raw c10d collective returns under the mode: a finished one.

    The collective is either in flight (its output buffer is a placeholder whose
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


def _c10d_group(engine: Engine, func, process_group: Any) -> dist.ProcessGroup | None:
    """``Engine.managed_group`` for a raw c10d op's TorchBind ProcessGroup."""
    group = dist.ProcessGroup.unbox(process_group)
    return engine.managed_group(func, group.size(), group)


@register([c10d_ops._allgather_base_.default])
def _c10d_all_gather(engine: Engine, func, args, kwargs):
    """``dist.all_gather_into_tensor`` / ``all_gather_single`` / ``_all_gather_base``."""
    output, shard, process_group = args[:3]
    group = _c10d_group(engine, func, process_group)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    world = group.size()
    if shard.dim() == 0 or not output.is_contiguous() or output.numel() != world * shard.numel():
        return engine.run_plain(func, args, kwargs)  # plain eager accepts it or raises
    too_small = engine.backend.size_rule(shard.device.type, "all_gather", shard.nbytes)
    if too_small is not None:
        return engine.issue_as_is(func, args, kwargs, "all_gather", shard, group, too_small, gather_signature(shard))
    engine.before_write(func, [output], takes=shard)  # Note [Every write is seen] in eagertp.engine
    engine.start_gather(shard, group, out=output.view(world * shard.shape[0], *shard.shape[1:]))
    return output, _work(output)


@register([c10d_ops._reduce_scatter_base_.default])
def _c10d_reduce_scatter(engine: Engine, func, args, kwargs):
    """``dist.reduce_scatter_tensor`` / ``reduce_scatter_single`` / ``_reduce_scatter_base``."""
    output, inp, process_group, reduce_op = args[:4]
    group = _c10d_group(engine, func, process_group)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    world = group.size()
    name = _REDUCE_OP_NAMES.get(reduce_op.op(), f"c10d reduce op {reduce_op.op()}")
    if inp.dim() == 0 or inp.shape[0] % world or not output.is_contiguous() or output.numel() * world != inp.numel():
        return engine.run_plain(func, args, kwargs)  # plain eager accepts it or raises
    out = output.view(inp.shape[0] // world, *inp.shape[1:])
    engine.before_write(func, [output], takes=inp)  # Note [Every write is seen] in eagertp.engine
    result = reduce_scatter(engine, func, args, kwargs, inp, name, group, out=out)
    return result if isinstance(result, tuple) else (output, _work(output))


@register([c10d_ops.allreduce_.default])
def _c10d_all_reduce(engine: Engine, func, args, kwargs):
    """``dist.all_reduce(t, op, group)``, in place (Note [Matmul + all-reduce] in
    ``eagertp.collectives.all_reduce``)."""
    tensors, process_group, reduce_op = args[:3]
    group = _c10d_group(engine, func, process_group)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    name = _REDUCE_OP_NAMES.get(reduce_op.op(), f"c10d reduce op {reduce_op.op()}")
    sparse = args[3] if len(args) > 3 else kwargs.get("sparse_indices")
    if len(tensors) != 1 or sparse is not None:
        return engine.run_plain(func, args, kwargs)  # not dist.all_reduce of one dense tensor
    (t,) = tensors
    result = all_reduce(engine, func, args, kwargs, t, name, group, in_place=True)
    return result if isinstance(result, tuple) else (tensors, _work(t))
