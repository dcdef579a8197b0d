"""torchtitan's Llama TP plan as a client: a vocab-parallel embedding whose
output is sequence-sharded, tensor + sequence parallel blocks, a
sequence-parallel final norm, and a column-parallel output kept sharded along
the vocabulary for ``loss_parallel``'s cross-entropy (its own all-reduces of
the row max and the sum of exponentials), forward and backward, under
``EagerMicroPipeline``: the same loss and gradients as plain eager, every
matmul collective fused, the others issued with their reasons. Then the
whole stack torchtitan trains with: that plan on the tp dim of a 2 x 2 mesh,
every block checkpointed, FSDP2 on the dp dim, AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import PlainCollectives, collectives_seen, device_mesh

from eagertp import EagerMicroPipeline

VOCAB, DIM, HEADS, LAYERS = 64, 16, 4, 2


class _TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from eagertp.demo import TransformerBlock

        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock(DIM, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _apply_tp(model: _TinyLlama, tp_mesh) -> None:
    """torchtitan's ``apply_tp`` (models/llama3/infra/parallelize.py) with
    ``loss_parallel``: the output stays sharded along the vocabulary; the
    blocks take the demo's TP + SP plan, which follows torchtitan's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from eagertp.demo import tensor_parallel_plan

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, tensor_parallel_plan())


def _titan_worker(rank, group, batch):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = _TinyLlama()
    _apply_tp(model, mesh)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, 16), generator=g)
    labels = torch.randint(0, VOCAB, (batch, 16), generator=g)

    def step(block):
        model.zero_grad()
        with loss_parallel(), block:
            pred = model(ids)
            loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        return loss.detach().full_tensor(), [p.grad.full_tensor() for p in model.parameters()]

    plain = PlainCollectives()
    expected = step(plain)
    pipe = EagerMicroPipeline()
    got = step(pipe)
    return {
        "collectives_seen": (collectives_seen(plain), collectives_seen(pipe)),
        "loss": (expected[0], got[0]),
        "grads_close": [torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got[1], expected[1])],
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
    }


# Per step. Forward: each block's 2 gathers and 2 reduce-scatters, the output's
# gather (fused with its matmul); backward: each block's 2 and 2 again, and
# the output's input gradient reduce-scattered. Not matmul collectives, each
# issued with its reason: the vocab-parallel embedding's reduce-scatter
# (masked lookups summed) and, backward, its gradient's gather (read by
# embedding_dense_backward); loss_parallel's all-reduces of the row max, the
# sum of exponentials and the picked logits.
_STATS = {
    "all_gather_matmul": 2 * 2 * LAYERS + 1, "fused_matmuls": 8 * LAYERS + 1,
    "matmul_reduce_scatter": 2 * 2 * LAYERS + 1,
    "unfused_reduce_scatter": 1, "unfused_all_gather": 1, "unfused_all_reduce": 3,
    # loss_parallel's ops on the all-reduced row max and sums, exp and log
    # among them (row by row on their gather halves, read by the next op that
    # is not: Note [Row-wise ops on gathered rows] in eagertp.rowwise)
    "rowwise_ops": 5,
}
_UNFUSED = [
    (1, "reduce_scatter(sum) #0", "its input is not the pending output of a matmul"),
    (1, "all_reduce(max) #0", "its input is not the pending output of a matmul"),
    (2, "all_reduce(sum) #", "its input is not the pending output of a matmul"),
    (1, "all_gather #9", "no matmul consumed it before aten.embedding_dense_backward.default"),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch", [2, 1])
def test_torchtitan_llama_plan_with_loss_parallel(pool, world, batch):
    for r in pool.run(_titan_worker, world, batch):
        torch.testing.assert_close(r["loss"][1], r["loss"][0], rtol=1e-5, atol=1e-6)
        assert all(r["grads_close"]), r["grads_close"]
        plain, explained = r["collectives_seen"]  # no invisible collective
        assert plain == explained > 0, r["collectives_seen"]
        assert r["stats"] == _STATS, r
        lines = r["explain"].splitlines()
        assert sum(" fused with " in line for line in lines) == 18, r["explain"]
        unfused = [line for line in lines if "not fused" in line]
        assert len(unfused) == sum(n for n, _, _ in _UNFUSED), r["explain"]
        for n, head, why in _UNFUSED:
            assert sum(line.startswith(head) and why in line for line in unfused) == n, (head, r["explain"])


# -- the whole stack: FSDP2 x TP on a 2 x 2 mesh, activation checkpointing ------


def _titan_fsdp_worker(rank, group, steps=2):
    """torchtitan's order: ``apply_tp`` on the tp mesh, ``apply_ac`` (every
    block checkpointed, non-reentrant), ``apply_fsdp`` (each block, then the
    root) on the dp mesh; AdamW; each step's forward + backward under
    ``loss_parallel`` and ``EagerMicroPipeline(group=tp)``."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    assert group.size() == dist.get_world_size() == 4
    mesh = device_mesh((2, 2), ("dp", "tp"))
    tp_group, dp_rank = mesh.get_group("tp"), mesh.get_local_rank("dp")

    def batch(step):  # a batch per dp rank, the same on both of its tp ranks
        g = torch.Generator().manual_seed(1000 + 10 * step + dp_rank)
        return torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)

    def train(use_eagertp: bool):
        torch.manual_seed(0)
        model = _TinyLlama()
        _apply_tp(model, mesh["tp"])
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, stats, seen = [], [], []
        pipe = EagerMicroPipeline(group=tp_group) if use_eagertp else PlainCollectives()  # one for the loop
        for step in range(steps):
            ids, labels = batch(step)
            with loss_parallel(), pipe:
                loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(0, 1))
                loss.backward()
            losses.append(loss.detach().full_tensor())
            stats.append(dict(pipe.stats) if use_eagertp else {})
            seen.append(collectives_seen(pipe))
            opt.step()
            opt.zero_grad()
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        return losses, params, stats, pipe.explain() if use_eagertp else "", seen

    plain = train(False)
    fused = train(True)
    return {
        "collectives_seen": (plain[4], fused[4]),
        "losses": (plain[0], fused[0]),
        "params_close": {n: torch.allclose(fused[1][n], p, rtol=1e-4, atol=1e-5) for n, p in plain[1].items()},
        "stats": fused[2],
        "explain": fused[3],
    }


# Per step on the tp group: _STATS, plus the checkpointed blocks' forward
# recomputed in backward (each block's 2 gathers and, as non-reentrant
# checkpointing stops once it has what backward needs, its first
# reduce-scatter: fused again), and the sequence-parallel norms' weight and
# bias gradients all-reduced (1-d: issued as written, with the reason).
_STACK_STATS = {
    **_STATS,
    "all_gather_matmul": _STATS["all_gather_matmul"] + 2 * LAYERS,
    "fused_matmuls": _STATS["fused_matmuls"] + 4 * LAYERS,
    "matmul_reduce_scatter": _STATS["matmul_reduce_scatter"] + LAYERS,
    "unfused_all_reduce": _STATS["unfused_all_reduce"] + 2 * (2 * LAYERS + 1),
}


def test_torchtitan_stack_fsdp2_tp_checkpointing_loss_parallel(pool):
    """FSDP2 on dp, TP on tp, every block checkpointed, loss_parallel:
    eagertp fuses every TP matmul collective of every step (the recomputed
    ones too) and leaves FSDP's alone; the losses and the trained parameters
    are plain eager's."""
    for r in pool.run(_titan_fsdp_worker, 4):
        torch.testing.assert_close(r["losses"][1], r["losses"][0], rtol=1e-5, atol=1e-6)
        assert all(r["params_close"].values()), r["params_close"]
        # No invisible collective: tp's and FSDP's on dp (passed through), each step.
        plain, explained = r["collectives_seen"]
        assert plain == explained and min(plain) > 0, r["collectives_seen"]
        # One pipeline for the loop: its second step runs at once the matmuls the
        # first read whole (Note [Deferrals that gained nothing]), and fuses as it did.
        first, second = r["stats"]
        assert second.pop("matmuls_run_at_once", 0) > 0, r["stats"]
        assert first == second == _STACK_STATS, r["stats"]
        unfused = [line for line in r["explain"].splitlines() if "not fused" in line]
        norms = "not fused: f32[16] is one row (all dims but the last), which does not split over 2 ranks"
        assert sum(norms in line for line in unfused) == 2 * (2 * LAYERS + 1), r["explain"]
