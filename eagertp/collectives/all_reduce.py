"""funcol's all-reduce, out of place and in place: run where the program
issues it, fused with the pending matmul (or sum of matmuls) that makes its
input as a reduce-scatter produced chunk by chunk, then an all-gather of the
reduced shard left in flight for the matmuls that read the result (Note
[Matmul + all-reduce] in ``eagertp.engine``). DTensor's ``Partial ->
Replicate`` redistributes desugar to the out-of-place op; raw c10d's
``dist.all_reduce`` is in ``eagertp.collectives.c10d``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from eagertp.engine import Engine
from eagertp.table import register

_c10d_functional = torch.ops._c10d_functional


@register([_c10d_functional.all_reduce.default, _c10d_functional.all_reduce_.default])
def _all_reduce(engine: Engine, func, args, kwargs):
    inp, reduce_op, group_name = args
    # NB: funcol's all-reduce names no group size: the group's own is right by definition.
    group = group_name if isinstance(group_name, dist.ProcessGroup) else c10d._resolve_process_group(group_name)
    group = engine.managed_group(func, group.size(), group)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    in_place = func is _c10d_functional.all_reduce_.default
    return engine.all_reduce(func, args, kwargs, inp, reduce_op.lower(), group, in_place=in_place)
