"""FSDP2 + TP on a 2 x 2 (dp, tp) mesh: eagertp fuses TP, passes FSDP through.

Four gloo ranks form a ``(dp=2, tp=2)`` DeviceMesh. The model is two of the
demo's ``TransformerBlock``s (dim 16, 4 heads), each made tensor + sequence
parallel with ``parallelize_module(block, mesh["tp"], tensor_parallel_plan())``
and then sharded with ``fully_shard(block, mesh=mesh["dp"])``; the root is
``fully_shard(model, mesh=mesh["dp"])``. AdamW, 3 steps; each dp rank trains on
its own batch, sequence-sharded over tp as the plan expects.

The same training runs twice from the same seed: plain eager, then with each
step's forward + backward inside ``EagerMicroPipeline(group=mesh.get_group("tp"))``
(the optimizer step outside). On every rank the test asserts:

- the losses of every step and the final parameters equal plain eager's;
- per step, eagertp fused every TP collective: no unfused all-gather or
  reduce-scatter, at least as many ``all_gather_matmul`` / ``matmul_reduce_scatter``
  as plain eager issued all-gathers / reduce-scatters on the tp group, and an
  op counter outside the mode saw no plain all-gather or reduce-scatter on tp;
- FSDP's collectives on the dp group (4 all-gathers, 2 reduce-scatters per
  step) passed through untouched: the op counter outside the mode sees exactly
  the dp collectives plain eager issues, and the tp all-reduces of the
  LayerNorm gradients too; only the TP all-gathers / reduce-scatters became
  eagertp's send/recv ring.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from helpers import GroupOpCounter, device_mesh, explained_collectives, explained_kind

from eagertp import EagerMicroPipeline
from eagertp.backends.ring import own_group_name

STEPS = 3
LAYERS = 2
DIM, HEADS, BATCH, SEQ = 16, 4, 2, 8

_GATHERS = ("all_gather_into_tensor", "_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_")
_SCATTERS = ("reduce_scatter_tensor", "_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_")


def _kind(op: str) -> str:
    if op in _GATHERS:
        return "all_gather"
    if op in _SCATTERS:
        return "reduce_scatter"
    return op


def _fsdp_tp_worker(rank, group):
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    assert group.size() == dist.get_world_size() == 4
    mesh = device_mesh((2, 2), ("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    # The ring's messages travel on eagertp's own group over the tp ranks (Note
    # [eagertp's own connections] in eagertp.backends.ring), never on tp itself.
    names = {tp_group.group_name: "tp", dp_group.group_name: "dp", own_group_name(tp_group.group_name): "tp+eagertp"}
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")

    def batch(step):
        # A different batch per dp rank (the same on both tp ranks of a dp rank),
        # sequence-sharded over tp.
        g = torch.Generator().manual_seed(1000 + 10 * step + dp_rank)
        x = torch.randn(BATCH, SEQ, DIM, generator=g)
        target = torch.randn(BATCH, SEQ, DIM, generator=g)
        return (t.chunk(2, 1)[tp_rank].contiguous() for t in (x, target))

    def train(use_eagertp: bool):
        torch.manual_seed(0)  # the same initial weights in both runs, on every rank
        model = nn.Sequential(*(TransformerBlock(DIM, HEADS) for _ in range(LAYERS)))
        for block in model:
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, steps = [], []
        pipe = EagerMicroPipeline(group=tp_group) if use_eagertp else None  # one for the loop, as the README
        for step in range(STEPS):
            x, target = batch(step)
            counter = GroupOpCounter()
            with counter, pipe if pipe is not None else contextlib.nullcontext():
                loss = F.mse_loss(model(x), target)
                loss.backward()
            per_group = collections.Counter()
            for (g, op), n in counter.by_group.items():
                per_group[f"{names.get(g, g)}:{_kind(op)}"] += n
            steps.append({"collectives": dict(per_group), "stats": dict(pipe.stats) if pipe else {},
                          "explain": pipe.explain() if pipe else "",
                          "explained": explained_collectives(pipe) if pipe else None})
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        return losses, params, steps

    plain_losses, plain_params, plain_steps = train(False)
    losses, params, steps = train(True)
    return {
        "rank": rank,
        "plain_losses": plain_losses,
        "losses": losses,
        "plain_params": plain_params,
        "params": params,
        "plain_steps": plain_steps,
        "steps": steps,
    }


def test_fsdp2_and_tp_on_a_2x2_mesh(pool):
    results = pool.run(_fsdp_tp_worker, 4, timeout=90)
    for r in results:
        where = f"rank {r['rank']}"
        for step, (got, expected) in enumerate(zip(r["losses"], r["plain_losses"])):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{where}, step {step} loss")
        assert r["params"].keys() == r["plain_params"].keys()
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["plain_params"][name], rtol=1e-4, atol=1e-6, msg=f"{where}, {name}")
        # One pipeline for the loop: from the second step on it runs at once the
        # matmuls the step before read whole (Note [Deferrals that gained
        # nothing]), and fuses as the first step did.
        at_once = [s["stats"].pop("matmuls_run_at_once", 0) for s in r["steps"]]
        assert at_once[0] == 0 and at_once[1] == at_once[2] > 0, (where, at_once)
        assert all(s["stats"] == r["steps"][0]["stats"] for s in r["steps"][1:]), (where, r["steps"])
        for step, (plain, fused) in enumerate(zip(r["plain_steps"], r["steps"])):
            pc, fc, stats = plain["collectives"], fused["collectives"], fused["stats"]
            info = f"{where}, step {step}: plain {pc}, eagertp {fc}, stats {stats}\n{fused['explain']}"
            tp_gathers, tp_scatters = pc.get("tp:all_gather", 0), pc.get("tp:reduce_scatter", 0)
            # Plain eager on the tp group, per step: per block 2 all-gathers and 2
            # reduce-scatters forward (attn/mlp inputs; wo/w2 outputs), mirrored in
            # backward: 2 blocks -> 8 and 8.
            assert tp_gathers == 4 * LAYERS and tp_scatters == 4 * LAYERS, info
            assert stats.get("unfused_all_gather", 0) == 0, info
            assert stats.get("unfused_reduce_scatter", 0) == 0, info
            # No invisible collective: explain() accounts for tp's and dp's (passed through).
            assert fused["explained"] == sum(n for k, n in pc.items() if explained_kind(k.split(":")[1])), info
            assert stats.get("all_gather_matmul", 0) >= tp_gathers, info
            assert stats.get("matmul_reduce_scatter", 0) >= tp_scatters, info
            assert fc.get("tp:all_gather", 0) == 0 and fc.get("tp:reduce_scatter", 0) == 0, info
            # FSDP on dp, per step: per block one all-gather forward and one in
            # backward (reshard_after_forward), one gradient reduce-scatter; the
            # root holds no parameters: 4 and 2. They, and the tp all-reduces of
            # the SequenceParallel LayerNorms' gradients (Partial -> Replicate,
            # 2 LayerNorms x 2 params x 2 blocks = 8), pass through eagertp
            # untouched: outside the mode, everything but the TP all-gathers and
            # reduce-scatters (replaced by eagertp's send/recv ring, on its own
            # group over the tp ranks) is as plain.
            assert pc.get("dp:all_gather", 0) == 2 * LAYERS and pc.get("dp:reduce_scatter", 0) == LAYERS, info
            untouched = {k: v for k, v in pc.items() if k not in ("tp:all_gather", "tp:reduce_scatter")}
            ring = ("tp+eagertp:send", "tp+eagertp:recv_")
            assert {k: v for k, v in fc.items() if k not in ring} == untouched, info
            assert fc.get(ring[0], 0) > 0 and fc.get(ring[0], 0) == fc.get(ring[1], 0), info
