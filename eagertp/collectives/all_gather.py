"""funcol's all-gather: started where the program issues it (Note [Deferral
boundary]); its placeholder waits for the matmuls that consume it."""

from __future__ import annotations

import torch

from eagertp.engine import Engine
from eagertp.patterns import gather_signature
from eagertp.table import register

_c10d_functional = torch.ops._c10d_functional

# NB: only the native _c10d_functional overloads: the legacy c10d_functional
# ones (tag, ranks, group_size) are gone from every torch eagertp supports
# (>= 2.11), so there is nothing there to intercept.


@register([_c10d_functional.all_gather_into_tensor.default])
def _all_gather(engine: Engine, func, args, kwargs):
    shard, group_size, group_name = args
    group = engine.managed_group(func, group_size, group_name)
    if group is None:
        return engine.run_plain(func, args, kwargs)
    too_small = engine.backend.size_rule(shard.device.type, "all_gather", shard.nbytes)
    if too_small is not None:
        return engine.issue_as_is(func, args, kwargs, "all_gather", shard, group, too_small, gather_signature(shard))
    return engine.start_gather(shard, group)


@register([_c10d_functional.wait_tensor.default])
def _wait(engine: Engine, func, args, kwargs):
    (t,) = args
    if engine.store.items and engine.store.touched([t]) is not None:
        return t  # a placeholder: its data arrives before anything reads it
    return func(*args, **kwargs)


@register([_c10d_functional._wrap_tensor_autograd.default])
def _wrap_async(engine: Engine, func, args, kwargs):
    # funcol wraps every collective's result in an AsyncCollectiveTensor; the
    # wrapper reads nothing and communicates nothing, so a placeholder stays pending.
    return func(*args, **kwargs)
