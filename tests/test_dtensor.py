"""DTensor tensor parallelism: DTensor desugars first, its funcol ops fuse."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from helpers import OpCounter, integer_tensor

from eagertp import EagerMicroPipeline


def _colwise_rowwise_worker(rank, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group, "cpu")

    def make():
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                p.copy_(integer_tensor(p.shape, torch.float32, seed=i))
        # Sequence-parallel input (Shard(0)) -> all-gather before the first linear.
        plan = {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
        }
        return parallelize_module(m, mesh, plan)

    x = integer_tensor((8, 16), torch.float32, seed=100).chunk(group.size())[rank].clone()

    def step(model, ctx):
        with ctx:
            out = model(x)
            out.pow(2).sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        return out, grads

    expected = step(make(), contextlib.nullcontext())
    counter, pipe = OpCounter(), EagerMicroPipeline()
    got = step(make(), _both(counter, pipe))
    return {
        "out_ok": torch.equal(got[0], expected[0]),
        "grads_ok": [torch.equal(g, e) for g, e in zip(got[1], expected[1])],
        "stats": dict(pipe.stats),
        "trace": pipe.debug_string(),
        "plain_gathers": counter.unfused_all_gathers,
    }


def test_dtensor_colwise_rowwise_forward_backward(pool):
    results = pool.run(_colwise_rowwise_worker, 2)
    for r in results:
        assert r["out_ok"] and all(r["grads_ok"]), r
        assert r["stats"]["all_gather_matmul"] >= 1, r
        assert r["plain_gathers"] == 0, r
    print(results[0]["trace"])


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield
