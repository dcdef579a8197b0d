"""A portable micro-pipeline over torch.distributed point-to-point ops.

Works on any process group that supports ``isend``/``irecv``: gloo on CPU,
NCCL on GPUs.

All-gather + consume
--------------------
The all-gather runs as a ring: at step ``s`` rank ``r`` forwards the shard it
holds, ``(r - s) % W``, to rank ``r + 1`` and receives shard ``(r - s - 1) % W``
from rank ``r - 1``. A shard may travel in pieces (``piece_rows``: split along
dim 0; one piece by default), and the consumer runs on each piece as soon as it
has arrived, so only the last piece's work is exposed. On 2 ranks with 3 pieces, as seen by
rank 0 (``mm[i.j]``: the consumer on piece j of rank i's shard)::

    comm:    [ 1.0 ][ 1.1 ][ 1.2 ]
    compute: [ mm[0] (own shard)   ][ mm[1.0] ][ mm[1.1] ][ mm[1.2] ]

Received pieces land directly in ``ag_out`` (the placeholder the program already
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
        rows = piece_rows(shard)  # the same on every rank: it depends on the shape only

        def recv_pieces(src: int) -> list[dist.Work]:
            return [_irecv(chunks[src][r], group, recv_from) for r in rows]

        # Step 0: this rank's shard goes out, the next shard's pieces are posted.
        sends = [_isend(chunks[rank][r], group, send_to) for r in rows]
        src = (rank - 1) % world
        recvs = recv_pieces(src)
        if consumer is not None:
            consumer(chunks[rank], rank, slice(0, shard.shape[0]))
        for step in range(1, world):
            forward = step + 1 < world
            next_recvs = []
            for r, recv in zip(rows, recvs):
                # The consumer of piece j overlaps the transfer of piece j+1.
                recv.wait()
                if forward:
                    sends.append(_isend(chunks[src][r], group, send_to))
                    next_recvs.append(_irecv(chunks[(src - 1) % world][r], group, recv_from))
                if consumer is not None:
                    consumer(chunks[src][r], src, r)
            src, recvs = (src - 1) % world, next_recvs
        for work in sends:
            work.wait()

    def produce_reduce_scatter(
        self,
        producer: ChunkProducer,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        reduce_op: str,
    ) -> None:
        check_scatter_buffers(out, reduce_op)
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


# A shard may travel in up to MAX_PIECES pieces of at least PIECE_MIN_BYTES, so
# that the consumer of one piece overlaps the transfer of the next. Measured on
# 2 CPU ranks over gloo (benchmarks/NOTES.md), 4 pieces did not beat 1: the
# copies and the matmuls share the same cores. One piece until measured on GPUs.
MAX_PIECES = 1
PIECE_MIN_BYTES = 64 * 1024


def piece_rows(shard: torch.Tensor, max_pieces: int | None = None, min_bytes: int | None = None) -> list[slice]:
    """How a shard is split along dim 0 for the ring: a function of its shape
    and dtype only, so that every rank exchanges the same messages."""
    max_pieces = MAX_PIECES if max_pieces is None else max_pieces
    min_bytes = PIECE_MIN_BYTES if min_bytes is None else min_bytes
    n_rows = shard.shape[0]
    nbytes = shard.numel() * shard.element_size()
    pieces = max(1, min(max_pieces, n_rows, nbytes // max(min_bytes, 1)))
    bounds = [i * n_rows // pieces for i in range(pieces + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _isend(t: torch.Tensor, group: dist.ProcessGroup, group_dst: int) -> dist.Work:
    work = dist.isend(t, group=group, group_dst=group_dst)
    assert work is not None, "isend on a group this rank belongs to returns a Work"
    return work


def _irecv(t: torch.Tensor, group: dist.ProcessGroup, group_src: int) -> dist.Work:
    work = dist.irecv(t, group=group, group_src=group_src)
    assert work is not None, "irecv on a group this rank belongs to returns a Work"
    return work
