"""Note [Deferrals that gained nothing]: a pipeline entered once a step runs at
once the matmuls that the block before read whole, and nothing it could have
fused with; a block that fuses otherwise than the one before, or ends by an
exception, makes the next one defer every matmul again.

Each test asserts the results equal plain eager's, which matmuls ran at once
(``stats["matmuls_run_at_once"]``) and that every fusion of the first block
happened again, or, where the program changed, the reason explain() gives.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from helpers import all_reduce, integer_tensor
from torch.distributed.device_mesh import DeviceMesh

from eagertp import EagerMicroPipeline, demo


def _steps_worker(rank, group, sequence_parallel):
    """Three training steps of the demo's model, one pipeline entered once a
    step, each against the same step in plain eager."""
    world = group.size()
    mesh = DeviceMesh.from_group(group, "cpu")
    model = demo.build_model(
        argparse.Namespace(layers=2, batch=2, seq=16, dim=64, heads=4, sequence_parallel=sequence_parallel), mesh
    )
    torch.manual_seed(1)
    x, target = (demo.local_input(torch.randn(2, 16, 64), sequence_parallel, rank, world) for _ in range(2))

    def step():
        model.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
        return [loss.detach()] + [g.clone() for g in grads]

    pipe = EagerMicroPipeline()
    blocks = []
    for _ in range(3):
        expected = step()
        with pipe:
            got = step()
        same = all(torch.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(got, expected, strict=True))
        blocks.append({"same": same, "stats": dict(pipe.stats)})
    return blocks


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["SP", "no SP"])
def test_a_repeated_step_runs_at_once_what_it_read_whole_and_fuses_as_before(pool, sequence_parallel):
    for blocks in pool.run(_steps_worker, 2, sequence_parallel):
        first = blocks[0]["stats"]
        assert all(b["same"] for b in blocks), blocks
        assert "matmuls_run_at_once" not in first and first["fused_matmuls"] > 0, first
        ran = [b["stats"].pop("matmuls_run_at_once", 0) for b in blocks[1:]]
        # The same matmuls every step (the first layer's q, k and v read by
        # attention without SP, weight gradients computed at the block's exit).
        assert ran[0] == ran[1] > 0, ran
        assert all(b["stats"] == first for b in blocks[1:]), blocks


def _changed_worker(rank, group):
    """One pipeline, one matmul of the same shapes in each block, read in
    different ways: whole (relu), all-reduced, all-reduced after a cast."""
    a = integer_tensor((8, 8), torch.float32, seed=rank).clamp(-2, 2)
    b = integer_tensor((8, 8), torch.float32, seed=100 + rank).clamp(-2, 2)
    programs = {
        "read whole": lambda: (a @ b).relu(),
        "all-reduced": lambda: all_reduce(a @ b, group),
        "cast, all-reduced": lambda: all_reduce((a @ b).to(torch.bfloat16), group),
    }
    pipe = EagerMicroPipeline(trace=True)
    blocks = []
    for name in ("read whole", "read whole", "all-reduced", "all-reduced",
                 "read whole", "cast, all-reduced", "cast, all-reduced"):
        expected = programs[name]()
        with pipe:
            got = programs[name]()
        blocks.append((name, torch.equal(got, expected), dict(pipe.stats), pipe.explain(), pipe.debug_string()))
    return blocks


def test_a_matmul_run_at_once_that_a_collective_takes_defers_from_the_next_block(pool):
    for blocks in pool.run(_changed_worker, 2):
        assert all(same for _, same, *_ in blocks), blocks
        stats = [s for _, _, s, *_ in blocks]
        assert stats == [
            {},
            {"matmuls_run_at_once": 1},  # the block before read it whole
            {"matmuls_run_at_once": 1, "unfused_all_reduce": 1},  # so it ran at once: the program changed
            {"matmul_all_reduce": 1},  # deferred again, and fused
            {},
            {"matmuls_run_at_once": 1, "unfused_all_reduce": 1},
            {"matmul_all_reduce": 1},
        ], blocks
        # The ordered trace (trace=True) says which ran at once, and why.
        assert blocks[1][4].splitlines()[0] == "aten.mm.default #0 of the block run at once: the block before read it whole"
        assert "run at once" not in blocks[0][4] and "run at once" not in blocks[3][4], blocks
        assert blocks[2][3].endswith(
            "not fused [ring]: its input is the output of a matmul run at once, since the block before read it "
            "whole (Note [Deferrals that gained nothing]); from the next block on it defers"
        ), blocks[2][3]
        # Through a cast the collective cannot tell which matmul made its
        # input, only that some ran at once; the block's stats tell the
        # pipeline (they differ from the block before's).
        assert blocks[5][3].endswith(
            "not fused [ring]: its input is not the pending output of a matmul (1 matmuls ran at once in this "
            "block, as the block before read them whole: Note [Deferrals that gained nothing])"
        ), blocks[5][3]


def _reused_address_worker(rank, group):
    """Each block: a matmul read whole (from the second block on it runs at
    once), its output freed, then an all-reduce of a new tensor of its size,
    which the allocator tends to place at the freed output's address."""
    from eagertp.deferred import storage_key

    a = integer_tensor((8, 8), torch.float32, seed=rank)
    b = integer_tensor((8, 8), torch.float32, seed=100 + rank)
    pipe = EagerMicroPipeline()
    blocks = []
    for _ in range(8):
        with pipe:
            y = a @ b
            y.relu()
            freed = storage_key(y)
            del y
            tried = []  # NB: kept, so each try is a new allocation
            while len(tried) < 16 and (not tried or storage_key(tried[-1]) != freed):
                tried.append(torch.full((8, 8), float(rank)))
            all_reduce(tried[-1], group)
        blocks.append((storage_key(tried[-1]) == freed, dict(pipe.stats), pipe.explain()))
    return blocks


def test_a_new_tensor_at_a_freed_output_address_is_not_that_matmuls_output(pool):
    """The matmul run at once is told apart by its storage's lifetime, not
    its address alone: a collective on another tensor, where the freed
    output was, neither names it in its reason nor makes it defer again
    (which it would from then on every other block)."""
    for blocks in pool.run(_reused_address_worker, 2):
        assert any(reused for reused, _, _ in blocks[1:]), "the allocator never reused the freed output's address"
        assert [stats for _, stats, _ in blocks] == [{"unfused_all_reduce": 1}] + [
            {"matmuls_run_at_once": 1, "unfused_all_reduce": 1}
        ] * 7, blocks
        for _, _, explained in blocks[1:]:
            assert "not fused [ring]: its input is not the pending output of a matmul (1 matmuls ran at once" in (
                explained
            ), explained


def _exception_worker(rank, group):
    a = integer_tensor((8, 8), torch.float32, seed=rank)
    b = integer_tensor((8, 8), torch.float32, seed=100 + rank)
    pipe = EagerMicroPipeline()
    stats = []
    for fail in (False, True, False, False):
        try:
            with pipe:
                y = (a @ b).relu()
                if fail:
                    raise KeyError("the program's own error")
        except KeyError:
            pass
        assert torch.equal(y, (a @ b).relu())
        stats.append(dict(pipe.stats))
    return stats


def test_a_block_left_by_an_exception_teaches_nothing(pool):
    for stats in pool.run(_exception_worker, 2):
        assert stats == [{}, {"matmuls_run_at_once": 1}, {}, {"matmuls_run_at_once": 1}], stats
