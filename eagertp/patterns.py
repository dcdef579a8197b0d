"""Patterns: turn one ready piece of pending work into a plan for a backend.

A plan is what a flush hands the backend: the buffers, the group, and the
consumer to run on each rank's chunk. New patterns (gathers along other dims,
matmul + reduce-scatter) add plan types here; the mode and the backends stay
as they are.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from eagertp.backends.base import ChunkConsumer
from eagertp.deferred import PendingGather, PendingMatmul

aten = torch.ops.aten


@dataclasses.dataclass(eq=False)
class AllGatherMatmulPlan:
    """Fuse the pattern::

        A = all_gather_into_tensor(A_shard, group)    # [W*m, ...] gather dim 0
        A2 = A.view(W*r, K)                           # r rows per rank
        C_j = mm(A2, B_j)  or  addmm(bias_j, A2, B_j) # any number of consumers

    into one micro-pipelined call whose consumer, for the chunk of rank i, runs::

        C_j[i*r:(i+1)*r] = mm(chunk_i.view(r, K), B_j)   (written in place)

    With no consumers this is the gather alone, issued with the same messages.
    """

    gather: PendingGather

    @property
    def fused(self) -> bool:
        return bool(self.gather.consumers)

    @property
    def name(self) -> str:
        return "all_gather_matmul" if self.fused else "all_gather"

    def consumer(self) -> ChunkConsumer | None:
        if not self.fused:
            return None
        world = self.gather.group.size()
        # Per consumer: the callable writing rows of rank i into its placeholder.
        steps = [_chunk_matmul(mm, world) for mm in self.gather.consumers]

        def consume(chunk: torch.Tensor, src: int) -> None:
            for step in steps:
                step(chunk, src)

        return consume

    def render(self) -> str:
        outs = ", ".join(f"${mm.tid}" for mm in self.gather.consumers)
        arrow = f" -> {outs}" if outs else ""
        return f"{self.name}(${self.gather.tid}{arrow})"

    def reference(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Plain eager: the collective, then every consumer on the whole tensor."""
        g = self.gather
        ag = torch.empty_like(g.out)
        dist.all_gather_into_tensor(ag, g.shard, group=g.group)
        return ag, [_full_matmul(mm, ag) for mm in g.consumers]


def _chunk_matmul(mm: PendingMatmul, world: int):
    m, n = mm.out.shape
    rows = m // world
    out = mm.out.view(world, rows, n)  # out[i]: rows computed from rank i's chunk
    k = mm.b.shape[0]
    if mm.bias is None:

        def step(chunk: torch.Tensor, src: int) -> None:
            torch.mm(chunk.view(rows, k), mm.b, out=out[src])

    else:
        bias = mm.bias.expand(m, n)  # broadcast exactly as addmm does, then row-slice

        def step(chunk: torch.Tensor, src: int) -> None:
            torch.addmm(
                bias[src * rows : (src + 1) * rows],
                chunk.view(rows, k),
                mm.b,
                beta=mm.beta,
                alpha=mm.alpha,
                out=out[src],
            )

    return step


def _full_matmul(mm: PendingMatmul, ag: torch.Tensor) -> torch.Tensor:
    a = ag.view(mm.out.shape[0], mm.b.shape[0])
    if mm.bias is None:
        return torch.mm(a, mm.b)
    return torch.addmm(mm.bias, a, mm.b, beta=mm.beta, alpha=mm.alpha)
