"""A user's script, for tests/test_exit.py: one rank of a gloo job launched as
torchrun launches it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), that trains
a few steps of a tensor-parallel pair of linears in an EagerMicroPipeline
block (gathers in flight, a reduce-scatter, backward), then returns normally:
no ``os._exit``. With ``DESTROY=0`` it leaves the process group to the
interpreter's exit."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from eagertp import EagerMicroPipeline


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(0)
    w1 = torch.randn(64, 128, requires_grad=True)
    w2 = torch.randn(128, 64, requires_grad=True)
    pipe = EagerMicroPipeline(min_fuse_bytes=0)
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        with pipe:
            gathered = funcol.all_gather_tensor(x, 0, group)
            other = funcol.all_gather_tensor(x * 2, 0, group)  # two in flight
            h = torch.relu(gathered @ w1) + torch.relu(other @ w1)
            y = funcol.reduce_scatter_tensor(h @ w2, "sum", 0, group)
            y.square().sum().backward()
    stats = dict(pipe.stats)
    assert stats.get("all_gather_matmul") and stats.get("matmul_reduce_scatter"), stats
    dist.barrier()
    if os.environ.get("DESTROY", "1") == "1":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
