"""What eagertp makes for a call is freed by reference counting: no object of
eagertp's and no tensor is left in a reference cycle, which only Python's
garbage collector would free, some time later (Note [Freed without the
garbage collector] in eagertp/deferred.py). Each program runs once to warm
up, then again with the collector saving what it finds instead of freeing
it; whatever of ours it found is a cycle (``helpers.left_in_cycles``).
HuggingFace's Llama without sequence parallel is checked in
tests/test_hf.py."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FP8, NEEDS_ROWWISE_SCALED_MM, all_gather, col_major, corrupt_rank0_gathers, integer_tensor, left_in_cycles,
)

from eagertp import EagerMicroPipeline


def _demo_step(rank, group, sequence_parallel):
    """The demo's transformer (2 blocks, DTensor TP, tiny dims): one training
    step per block. Without sequence parallel the all-reduces' gather halves
    run the residual adds and norms row by row, and q's, k's and v's input
    gradients are added chunk by chunk (Note [Row-wise ops on gathered rows])."""
    from torch.distributed.device_mesh import DeviceMesh

    from eagertp import demo

    mesh = DeviceMesh.from_group(group, "cpu")
    args = argparse.Namespace(layers=2, batch=2, seq=16, dim=64, heads=4, sequence_parallel=sequence_parallel)
    model = demo.build_model(args, mesh)
    g = torch.Generator().manual_seed(0)
    x, target = (
        demo.local_input(torch.randn(2, 16, 64, generator=g), sequence_parallel, rank, group.size()) for _ in range(2)
    )
    pipe = EagerMicroPipeline(min_fuse_bytes=0)

    def step():
        with pipe:
            F.mse_loss(model(x), target).backward()
        return pipe

    return step


def _gathered_scales(rank, group):
    """FP8 rows and their row-wise scales gathered apart, then
    ``_scaled_mm``: the scale's gather rides along with the data's (Note
    [Gathered row-wise scales])."""
    data = integer_tensor((16, 32), torch.float32, seed=rank).to(FP8)
    scale = 2.0 ** torch.randint(-1, 2, (16, 1), generator=torch.Generator().manual_seed(100 + rank)).float()
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)
    pipe = EagerMicroPipeline(min_fuse_bytes=0)

    def step():
        with pipe:
            x = all_gather(data.view(torch.uint8), group).view(FP8)
            s = all_gather(scale, group)
            torch._scaled_mm(x, w, s, one, out_dtype=torch.float32).sum()
        return pipe

    return step


def _fused_forms(rank, group):
    """An all-gather + matmul, a matmul + reduce-scatter and a matmul +
    all-reduce, as funcol code writes them."""
    from eagertp._compat import funcol_all_gather, funcol_reduce_scatter
    import torch.distributed._functional_collectives as funcol

    a, b = integer_tensor((8, 8), torch.float32, seed=rank), integer_tensor((8, 8), torch.float32, seed=9)
    pipe = EagerMicroPipeline(min_fuse_bytes=0)

    def step():
        with pipe:
            (funcol_all_gather(a, 0, group) @ b).sum()
            funcol_reduce_scatter(a @ b, "sum", 0, group).wait().sum()
            funcol.all_reduce(a @ b, "sum", group).wait().sum()
        return pipe

    return step


_PROGRAMS = {
    "demo_no_sp": lambda rank, group: _demo_step(rank, group, False),
    "demo_sp": lambda rank, group: _demo_step(rank, group, True),
    "gathered_scales": _gathered_scales,
    "fused_forms": _fused_forms,
}


def _cycles_worker(rank, group, program):
    step = _PROGRAMS[program](rank, group)
    step()  # first uses: caches, the run-at-once memory (Note [Deferrals that gained nothing])
    pipe, left = left_in_cycles(step)
    return {"left": left, "stats": dict(pipe.stats)}


@pytest.mark.parametrize(
    "program, fused",
    [
        ("demo_no_sp", ("matmul_all_reduce", "rowwise_ops")),
        ("demo_sp", ("all_gather_matmul", "matmul_reduce_scatter")),
        pytest.param("gathered_scales", ("all_gather_matmul", "fused_scale_gathers"), marks=NEEDS_ROWWISE_SCALED_MM),
        ("fused_forms", ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")),
    ],
)
def test_nothing_of_ours_is_left_in_reference_cycles(pool, program, fused):
    for r in pool.run(_cycles_worker, 2, program):
        assert all(r["stats"].get(k, 0) > 0 for k in fused), r["stats"]  # what it checks did run fused
        assert r["left"] == {}, f"left in reference cycles after one step of {program}: {r['left']}"


def _failed_verify_worker(rank, group):
    from eagertp import VerificationError

    x, w = integer_tensor((4, 8), torch.float32, seed=rank), integer_tensor((8, 6), torch.float32, seed=5)
    pipe = EagerMicroPipeline(verify=True, min_fuse_bytes=0)
    corrupt_rank0_gathers(pipe)

    def step():
        try:
            with pipe:
                (all_gather(x, group) @ w).sum()
        except VerificationError as e:
            return str(e)
        return None

    step()
    return left_in_cycles(step)


def test_a_failed_completion_leaves_nothing_in_reference_cycles(pool):
    """A failure raised while completing pending work (here verify's, on rank 0)
    is raised once every item is complete, by frames that no longer hold it:
    the traceback holds their frames, and through them the block's pending
    work, tensors and mode (Note [Freed without the garbage collector] in
    eagertp/deferred.py). torch.testing's own cycle is cleared by
    eagertp.verify. A helper thread's failures: tests/test_reliability.py."""
    (error0, left0), (error1, left1) = pool.run(_failed_verify_worker, 2)
    assert error0 is not None and "differs from plain eager on rank 0" in error0, error0
    assert error1 is None, error1
    assert left0 == {} and left1 == {}, (left0, left1)
