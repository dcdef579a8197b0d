"""funcol's all-gather: started where the program issues it (Note [Deferral
boundary]); its placeholder waits for the matmuls that consume it. A shard
that a pending matmul makes is made piece by piece as it is sent (Note
[Matmul + all-gather] below)."""

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


# Note [Matmul + all-gather]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A column-parallel linear whose output is gathered (HuggingFace's
# "colwise_rep" lm_head and "colwise_gather_output", DTensor's
# ``ColwiseParallel(output_layouts=Replicate())``) runs its matmul whole, then
# sends the product. Fuse::
#
#     C = mm(A, B)                          # or addmm, _scaled_mm, a sum of them, their cast
#     G = all_gather(C, group)              # funcol (any gather_dim), raw c10d
#
# into one backend call at the program point (``Backend.produce_all_gather``):
# the messages the shard travels in (Note [Pieces] and Note [Wire pieces] in
# eagertp.backends.ring: on 2 ranks over gloo, up to 2 per piece) are C's
# rows, each made (``A[rows] @ B``) straight into this rank's chunk of G and
# sent from there at once while the next is made: no copy. C's own
# placeholder stays pending, computed only if the program reads it (as after
# a fused reduce-scatter). On 2 ranks, rank 0, C in 2 messages::
#
#     program: C = A @ B   all_gather(C) ............................ read(G)
#     compute:             [ C[0] ][ C[1] ]   (other work)
#     comm:                        [ -> C[0] ][ -> C[1] ]
#                          [ <- peer's C[0] ][ <- peer's C[1] ]
#
# The messages are the gather's own (the same rows of the same shard), so
# a peer that made C first, or read it, interoperates (Invariant 2). This
# rank's chunk of G is complete when the call returns; the gather stays in
# flight like any other and matmuls on G still bind to it. Where nothing can
# overlap (one piece, a backend that sends a shard whole: symm_mem,
# reference), C is made first, and explain() adds why to the gather's line
# if nothing fused with it.


@register([_c10d_functional.wait_tensor.default])
def _wait(engine: Engine, func, args, kwargs):
    (t,) = args
    if engine.store.items and engine.store.touched([t]) is not None:
        return t  # a placeholder: its data arrives before anything reads it
    return func._op(*args, **kwargs)  # NB: the C++ entry point, as the mode calls plain ops


@register([_c10d_functional._wrap_tensor_autograd.default])
def _wrap_async(engine: Engine, func, args, kwargs):
    # funcol wraps every collective's result in an AsyncCollectiveTensor; the
    # wrapper reads nothing and communicates nothing, so a placeholder stays pending.
    return func._op(*args, **kwargs)
