"""torchtitan's Llama TP plan as a client: a vocab-parallel embedding whose
output is sequence-sharded, tensor + sequence parallel blocks, a
sequence-parallel final norm, and a column-parallel output kept sharded along
the vocabulary for ``loss_parallel``'s cross-entropy (its own all-reduces of
the row max and the sum of exponentials), forward and backward, under
``EagerMicroPipeline``: the same loss and gradients as plain eager, every
matmul collective fused, the others issued with their reasons."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

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


def _titan_worker(rank, group, batch):
    """torchtitan's ``apply_tp`` (models/llama3/infra/parallelize.py) with
    ``loss_parallel``, on the demo's blocks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module,
    )

    from eagertp.demo import tensor_parallel_plan

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = _TinyLlama()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.layers:
        parallelize_module(layer, mesh, tensor_parallel_plan())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, 16), generator=g)
    labels = torch.randint(0, VOCAB, (batch, 16), generator=g)

    def step(pipe):
        model.zero_grad()
        with loss_parallel(), pipe if pipe is not None else contextlib.nullcontext():
            pred = model(ids)
            loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        return loss.detach().full_tensor(), [p.grad.full_tensor() for p in model.parameters()]

    expected = step(None)
    pipe = EagerMicroPipeline()
    got = step(pipe)
    return {
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
        assert r["stats"] == _STATS, r
        lines = r["explain"].splitlines()
        assert sum(" fused with " in line for line in lines) == 18, r["explain"]
        unfused = [line for line in lines if "not fused" in line]
        assert len(unfused) == sum(n for n, _, _ in _UNFUSED), r["explain"]
        for n, head, why in _UNFUSED:
            assert sum(line.startswith(head) and why in line for line in unfused) == n, (head, r["explain"])
