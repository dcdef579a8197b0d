"""Pipeline parallel x tensor parallel, as torchtitan trains: each stage of
``torch.distributed.pipelining`` holds the demo's TP blocks on the tp group of
a (pp, tp) mesh, stages pass plain activations and their gradients over the
pp group (``batch_isend_irecv``), and the schedule's forwards and backwards of
every microbatch run inside ``EagerMicroPipeline``: the same losses and
gradients as plain eager, every TP collective of every microbatch fused, the
pipeline's own point-to-point traffic untouched; four steps in one pipeline,
as a training loop keeps it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from helpers import OpCounter, device_mesh, explained_collectives

from eagertp import EagerMicroPipeline

DIM, HEADS, SEQ, BATCH, MICROBATCHES, BLOCKS_PER_STAGE = 16, 4, 8, 4, 2, 2
LATER_STEPS = 3  # after the first, in the same pipeline


def _pp_tp_worker(rank, group, schedule_name, sequence_parallel, manage):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    assert group.size() == dist.get_world_size() == 4
    mesh = device_mesh((2, 2), ("pp", "tp"))
    pp_rank, tp_rank, tp_group = mesh.get_local_rank("pp"), mesh.get_local_rank("tp"), mesh.get_group("tp")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    target = torch.randn(BATCH, SEQ, DIM, generator=g)
    if sequence_parallel:  # the stages pass this tp rank's part of the sequence
        rows = SEQ // mesh["tp"].size()
        x, target = (t[:, tp_rank * rows : (tp_rank + 1) * rows].contiguous() for t in (x, target))

    def loss_fn(out, tgt):
        return ((out - tgt) ** 2).mean()

    def train(use_eagertp: bool):
        torch.manual_seed(0)
        blocks = [TransformerBlock(DIM, HEADS) for _ in range(2 * BLOCKS_PER_STAGE)]
        stage_module = nn.Sequential(*blocks[pp_rank * BLOCKS_PER_STAGE : (pp_rank + 1) * BLOCKS_PER_STAGE])
        for block in stage_module:
            parallelize_module(block, mesh["tp"], tensor_parallel_plan(sequence_parallel))
        stage = PipelineStage(stage_module, pp_rank, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
        schedule = schedule_cls(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
        pipe = EagerMicroPipeline(group=tp_group if manage == "tp" else None) if use_eagertp else None
        losses: list[torch.Tensor] = []

        def step():
            step_losses: list[torch.Tensor] = []  # NB: the schedule empties the list it is given
            with pipe if pipe is not None else contextlib.nullcontext():
                if pp_rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=target, losses=step_losses)
            losses.extend(step_losses)

        with OpCounter() as counter:
            step()
        first = {"stats": dict(pipe.stats), "explain": pipe.explain(), "explained": explained_collectives(pipe)} if pipe else {}
        later = []
        for _ in range(LATER_STEPS):  # more steps in the same pipeline (gradients accumulate)
            step()
            later.append(dict(pipe.stats) if pipe is not None else {})
        grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for p in stage_module.parameters()]
        return [loss.detach() for loss in losses], grads, counter, pipe, first, later

    plain_losses, plain_grads, plain, *_ = train(False)
    losses, grads, fused, pipe, first, later = train(True)
    return {
        "pp_rank": pp_rank,
        "losses": (plain_losses, losses),
        "grads_close": [torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, plain_grads)],
        **first,
        "later_stats": later,
        "plain": {
            "all_gather": plain.unfused_all_gathers,
            "reduce_scatter": plain.unfused_reduce_scatters,
            "all_reduce": plain.counts["_c10d_functional.all_reduce.default"],
            "p2p": plain.p2p,
        },
        "fused_run": {
            "all_gather": fused.unfused_all_gathers,
            "reduce_scatter": fused.unfused_reduce_scatters,
            "all_reduce": fused.counts["_c10d_functional.all_reduce.default"],
        },
    }


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("manage", ["tp", "all"])
def test_pipeline_stages_of_tp_blocks(pool, schedule_name, sequence_parallel, manage):
    """Each stage fuses every TP collective plain eager issues for its
    microbatches, forward and backward; the stages' activations and gradients
    cross the pp group as the schedule sends them."""
    for r in pool.run(_pp_tp_worker, 4, schedule_name, sequence_parallel, manage):
        plain_losses, losses = r["losses"]
        assert len(losses) == len(plain_losses) == ((1 + LATER_STEPS) * MICROBATCHES if r["pp_rank"] == 1 else 0)
        for got, want in zip(losses, plain_losses):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert all(r["grads_close"]), r["grads_close"]
        plain, stats = r["plain"], r["stats"]
        # Each microbatch's activation one way, its gradient back (and the first
        # step's shape inference).
        assert plain["p2p"] >= 2 * MICROBATCHES, plain
        if sequence_parallel:
            assert plain["all_gather"] > 0 and plain["reduce_scatter"] > 0 and not plain["all_reduce"], plain
            assert stats["all_gather_matmul"] == plain["all_gather"], (stats, plain)
            assert stats["matmul_reduce_scatter"] == plain["reduce_scatter"], (stats, plain)
        else:
            assert plain["all_reduce"] > 0 and not plain["all_gather"] and not plain["reduce_scatter"], plain
            assert stats["matmul_all_reduce"] == plain["all_reduce"], (stats, plain)
        assert not any(key.startswith("unfused") for key in stats), stats
        # Later steps in the same pipeline (Note [Deferrals that gained nothing]):
        # the schedule's first step also ran its shape inference, so the second
        # fuses otherwise and teaches nothing; the third learns, and the fourth
        # runs at once what the third read whole and fuses as it did.
        third, fourth = (dict(s) for s in r["later_stats"][1:])
        assert "matmuls_run_at_once" not in third and fourth.pop("matmuls_run_at_once", 0) > 0, r["later_stats"]
        assert third == fourth, r["later_stats"]
        # No invisible collective: explain() accounts for each one plain eager issued.
        assert r["explained"] == plain["all_gather"] + plain["reduce_scatter"] + plain["all_reduce"], r
        assert r["fused_run"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}, r["fused_run"]
        assert "not fused" not in r["explain"] and "passed through" not in r["explain"], r["explain"]
