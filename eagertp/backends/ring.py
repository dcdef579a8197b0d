"""A portable micro-pipeline over torch.distributed point-to-point ops.

Works on any process group that supports ``isend``/``irecv``: gloo on CPU,
NCCL on GPUs. The all-gather runs as a ring: at step ``s`` rank ``r`` forwards
the chunk it holds, ``(r - s) % W``, to rank ``r + 1`` and receives chunk
``(r - s - 1) % W`` from rank ``r - 1``, while it consumes the chunk it holds.
On 3 ranks, as seen by rank 0 (``mm[i]`` is the consumer on rank i's chunk)::

    comm:    [ send 0 / recv 2 ][ send 2 / recv 1 ]
    compute: [ copy 0 ][ mm[0] ]  [ mm[2] ]          [ mm[1] ]

Received chunks land directly in ``ag_out`` (the placeholder the program already
holds): there is no staging buffer and no extra full-size copy.

The messages depend only on the shapes and the group, never on the consumer
(Invariant 2 in DESIGN.md): materialising a gather alone is the same ring with
no consumer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagertp.backends.base import ChunkConsumer, check_gather_buffers


class RingBackend:
    """Ring all-gather whose consumer of chunk i overlaps the transfer of chunk i+1."""

    name = "ring"

    def all_gather_consume(
        self,
        shard: torch.Tensor,
        consumer: ChunkConsumer | None,
        ag_out: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> None:
        check_gather_buffers(shard, ag_out, group)
        world, rank = group.size(), group.rank()
        chunks = ag_out.view(world, *shard.shape)  # chunks[i]: rank i's shard
        chunks[rank].copy_(shard)
        if world == 1 or shard.numel() == 0:
            # NB: shapes are equal on every rank, so every rank skips the ring
            # together and no message is left unmatched.
            _consume_all(consumer, chunks)
            return

        send_to, recv_from = (rank + 1) % world, (rank - 1) % world
        sends: list[dist.Work] = []
        held, src = shard, rank
        for step in range(world):
            recv = None
            if step + 1 < world:
                # Post the transfer of the next chunk before consuming this one.
                sends.append(_isend(held, group, send_to))
                src_next = (src - 1) % world
                recv = _irecv(chunks[src_next], group, recv_from)
            if consumer is not None:
                consumer(held, src)
            if recv is not None:
                recv.wait()
                held, src = chunks[src_next], src_next
        for work in sends:
            work.wait()


def _consume_all(consumer: ChunkConsumer | None, chunks: torch.Tensor) -> None:
    if consumer is not None:
        for src, chunk in enumerate(chunks):
            consumer(chunk, src)


def _isend(t: torch.Tensor, group: dist.ProcessGroup, group_dst: int) -> dist.Work:
    work = dist.isend(t, group=group, group_dst=group_dst)
    assert work is not None, "isend on a group this rank belongs to returns a Work"
    return work


def _irecv(t: torch.Tensor, group: dist.ProcessGroup, group_src: int) -> dist.Work:
    work = dist.irecv(t, group=group, group_src=group_src)
    assert work is not None, "irecv on a group this rank belongs to returns a Work"
    return work
