"""A portable micro-pipeline over torch.distributed point-to-point ops.

Works on any process group that supports ``isend``/``irecv``: gloo on CPU,
NCCL on GPUs.

All-gather + consume
--------------------
The all-gather runs as a ring: at step ``s`` rank ``r`` forwards
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

Produce + reduce-scatter
------------------------
The reduce-scatter runs as a ring of partial sums: at step ``s`` rank ``r``
produces its contribution to chunk ``c = (r - s - 1) % W`` while the partial
sum of ``c`` from ranks before it is in flight, adds the two and forwards the
result; after ``W - 1`` steps it holds chunk ``r`` reduced over every rank. On
3 ranks, as seen by rank 0 (``P[c]`` produces chunk c)::

    comm:    [ send P[2] ][ recv 1 / send P[1]+1 ][ recv 0 ]
    compute: [ P[2] ]     [ P[1] ]  [ + ]         [ P[0] ]  [ + ] -> out

Only this rank's contribution to one chunk is computed at a time, into one of
three chunk-sized buffers. The messages depend only on the
shapes, ``reduce_op`` and the group, never on the producer: an unfused
reduce-scatter is the same ring whose producer copies a slice of its input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagertp.backends.base import (
    ChunkConsumer,
    ChunkProducer,
    check_gather_buffers,
    check_scatter_buffers,
    consume_in_order,
)


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
            consume_in_order(consumer, chunks)
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

    def produce_reduce_scatter(
        self,
        producer: ChunkProducer,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        reduce_op: str,
    ) -> None:
        check_scatter_buffers(out, group, reduce_op)
        world, rank = group.size(), group.rank()
        combine = _COMBINE[reduce_op]
        if world == 1 or out.numel() == 0:
            producer(rank, out)
        else:
            send_to, recv_from = (rank + 1) % world, (rank - 1) % world
            send_buf, recv_buf = torch.empty_like(out), torch.empty_like(out)
            spare = torch.empty_like(out) if world > 2 else None
            producer((rank - 1) % world, send_buf)
            send = _isend(send_buf, group, send_to)
            for step in range(1, world):
                last = step == world - 1
                recv = _irecv(recv_buf, group, recv_from)
                acc = out if last else spare
                # This rank's share of chunk c overlaps the transfer of the partial sum of c.
                producer((rank - step - 1) % world, acc)
                recv.wait()
                combine(acc, recv_buf)
                if not last:
                    send.wait()  # send_buf is free again
                    send_buf, spare = acc, send_buf
                    send = _isend(send_buf, group, send_to)
            send.wait()
        if reduce_op == "avg":
            out.div_(world)


def _add(acc: torch.Tensor, other: torch.Tensor) -> None:
    acc.add_(other)


def _max(acc: torch.Tensor, other: torch.Tensor) -> None:
    torch.maximum(acc, other, out=acc)


def _min(acc: torch.Tensor, other: torch.Tensor) -> None:
    torch.minimum(acc, other, out=acc)


def _mul(acc: torch.Tensor, other: torch.Tensor) -> None:
    acc.mul_(other)


# reduce_op -> in-place combine of a received partial into the local one.
_COMBINE = {"sum": _add, "avg": _add, "max": _max, "min": _min, "product": _mul}


def _isend(t: torch.Tensor, group: dist.ProcessGroup, group_dst: int) -> dist.Work:
    work = dist.isend(t, group=group, group_dst=group_dst)
    assert work is not None, "isend on a group this rank belongs to returns a Work"
    return work


def _irecv(t: torch.Tensor, group: dist.ProcessGroup, group_src: int) -> dist.Work:
    work = dist.irecv(t, group=group, group_src=group_src)
    assert work is not None, "irecv on a group this rank belongs to returns a Work"
    return work
