"""funcol's reduce-scatter: run where the program issues it, fused with the
pending matmul (or sum of matmuls) that makes its input."""

from __future__ import annotations

import torch

from eagertp.engine import Engine
from eagertp.table import register

_c10d_functional = torch.ops._c10d_functional


@register([_c10d_functional.reduce_scatter_tensor.default])
def _reduce_scatter(engine: Engine, func, args, kwargs):
    inp, reduce_op, group_size, group_name = args
    group = engine.managed_group(func, group_size, group_name)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    return engine.reduce_scatter(func, args, kwargs, inp, reduce_op.lower(), group)
