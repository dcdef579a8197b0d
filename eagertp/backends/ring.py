"""A portable micro-pipeline over torch.distributed point-to-point ops.

Works on any process group that supports ``isend``/``irecv``: gloo on CPU,
NCCL on GPUs.

All-gather, started where the program issues it
-----------------------------------------------
``start_all_gather`` copies this rank's shard into its chunk of ``ag_out`` and
starts moving the shards at once, straight into their chunks of ``ag_out`` (no
staging buffer, no extra full-size copy); ``consume`` runs the consumer on this
rank's own shard, then on each peer's shard as it lands, in ring order
(``rank - 1``, ``rank - 2``, ...). A shard may travel in pieces
(``piece_rows``: split along dim 0; one piece by default), each consumed as it
lands. How the shards move depends on the world size and the device:

- 2 ranks, or NCCL: every send and receive is posted at the start (one
  ``batch_isend_irecv``); the transfers progress on gloo's threads and NCCL's
  streams while the program runs on. With 2 ranks that is the ring itself.
- More than 2 ranks on gloo: a ring, whose forwarding (receive shard i, send it
  on) runs on a helper thread started with the gather, so it progresses while
  the program runs on too. Posting every peer at once would move the same
  bytes, but on a shared link all shards then land together at the end,
  leaving nothing for the consumer to overlap (measured: 15% slower than the
  ring on 4 ranks, benchmarks/NOTES.md). The ring lands one shard per step.

On 3 ranks, as seen by rank 0 (``mm[i]``: the consumer on rank i's shard;
``indep``: the program's own work between the gather and its first reader)::

    program: AG(x)  [ indep ]  mm(ag) ..................... read
    comm:    [ <- 2, -> 1 ][ <- 1, -> 1 (2's shard) ]
    compute:        [ indep ]  [ mm[0] ][ mm[2] ][ mm[1] ]

The messages depend only on the shapes and the group, never on the consumer or
on when ``consume`` is called (Invariant 2 in DESIGN.md): they are posted from
the start, by this thread or the helper, so ranks may consume gathers in
flight in any order. Each gather on gloo sends with its own tag (from a
per-group sequence, the same on every rank since gathers start in program
order), so a helper's forwards never match another collective's messages.

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

import collections
import itertools
import threading

import torch
import torch.distributed as dist

from eagertp._format import tensor_str
from eagertp.backends.base import (
    ChunkConsumer,
    ChunkProducer,
    check_gather_buffers,
    check_scatter_buffers,
    peer_transfer,
    wait_for_peer,
)


class RingBackend:
    """Ring all-gather whose consumer of chunk i overlaps the transfer of chunk i+1."""

    name = "ring"

    def start_all_gather(
        self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup
    ) -> _P2PGather | _ThreadedRing:
        check_gather_buffers(shard, ag_out, group)
        if group.size() > 2 and shard.device.type == "cpu" and shard.numel():
            return _ThreadedRing(shard, ag_out, group, _next_tag(group))
        return _P2PGather(shard, ag_out, group)

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
            what = f"reduce_scatter({reduce_op}) -> {tensor_str(out)}"
            send_buf, recv_buf = torch.empty_like(out), torch.empty_like(out)
            spare = torch.empty_like(out) if world > 2 else None
            producer((rank - 1) % world, send_buf)
            with peer_transfer(what, group, send_to):
                send = _isend(send_buf, group, send_to)
            for step in range(1, world):
                last = step == world - 1
                with peer_transfer(what, group, recv_from):
                    recv = _irecv(recv_buf, group, recv_from)
                acc = out if last else spare
                # This rank's share of chunk c overlaps the transfer of the partial sum of c.
                producer((rank - step - 1) % world, acc)
                wait_for_peer(recv, what, group, recv_from)  # Note [Waiting on a peer]
                combine(acc, recv_buf)
                if not last:
                    wait_for_peer(send, what, group, send_to)  # send_buf is free again
                    send_buf, spare = acc, send_buf
                    with peer_transfer(what, group, send_to):
                        send = _isend(send_buf, group, send_to)
            wait_for_peer(send, what, group, send_to)
        if reduce_op == "avg":
            out.div_(world)


class _P2PGather:
    """An all-gather in flight: every send and receive posted at construction."""

    def __init__(self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup) -> None:
        world, rank = group.size(), group.rank()
        self._rank, self._group = rank, group
        self._what = f"all_gather of {tensor_str(shard)}"
        self._chunks = chunks = ag_out.view(world, *shard.shape)  # chunks[i]: rank i's shard
        chunks[rank].copy_(shard)  # NB: the sends read this copy: the program may overwrite shard now
        rows = piece_rows(shard)  # the same on every rank: shapes only
        # Peers' shards in the order they are consumed, rank - 1, rank - 2, ...
        # (the ring's order, so that sums over chunks add as they always have).
        sources = [(rank - step) % world for step in range(1, world)] if shard.numel() else []
        self._pieces = [(src, r) for src in sources for r in rows]
        ops = []
        for step, src in enumerate(sources, start=1):
            dst = (rank + step) % world
            ops += [dist.P2POp(dist.isend, chunks[rank][r], group=group, group_peer=dst) for r in rows]
            ops += [dist.P2POp(dist.irecv, chunks[src][r], group=group, group_peer=src) for r in rows]
        with peer_transfer(self._what, group, sources[0] if sources else rank):  # 2 ranks: the one peer
            works = dist.batch_isend_irecv(ops) if ops else []
        # (work, the peer it waits for): Note [Waiting on a peer]
        if len(works) == len(ops):  # gloo: one Work per op
            self._recvs = [(w, op.group_peer) for op, w in zip(ops, works) if op.op is dist.irecv]
            self._rest = [(w, op.group_peer) for op, w in zip(ops, works) if op.op is dist.isend]
        else:  # NCCL coalesces a batch into one Work: the first piece waits for all
            self._recvs, self._rest = [], [(w, sources[0]) for w in works]
        # NB: a gloo receive's Work may be waited for once only (a second wait
        # waits for another message): wait_chunk and consume share these flags.
        self._received = [False] * len(self._recvs)

    def _wait_piece(self, i: int) -> None:
        if not self._received[i]:
            self._wait(self._recvs[i : i + 1])  # at once if it has landed
            self._received[i] = True

    def wait_chunk(self, src: int) -> None:
        if src == self._rank:
            return
        if not self._recvs:
            self._wait(self._rest)
            return
        for i, (s, _) in enumerate(self._pieces):
            if s == src:
                self._wait_piece(i)

    def consume(self, consumer: ChunkConsumer | None) -> None:
        chunks, rank = self._chunks, self._rank
        if consumer is not None:
            consumer(chunks[rank], rank, slice(0, chunks.shape[1]))
        if not self._recvs:
            self._wait(self._rest)
        for i, (src, rows) in enumerate(self._pieces):
            if self._recvs:
                self._wait_piece(i)
            if consumer is not None:
                # The consumer of one piece overlaps the transfers of the pieces after it.
                consumer(chunks[src][rows], src, rows)
        self._wait(self._rest)
        self._recvs, self._rest, self._received = [], [], []

    def _wait(self, works: list[tuple[dist.Work, int]]) -> None:
        for work, peer in works:
            wait_for_peer(work, self._what, self._group, peer)

    def landed(self) -> bool | None:
        if self._chunks.device.type == "cpu":
            return None  # NB: gloo's point-to-point Work completes only in wait()
        return all(work.is_completed() for work, _ in self._recvs or self._rest)  # NCCL: its CUDA event


class _ThreadedRing:
    """A ring all-gather for gloo with more than 2 ranks: step s receives shard
    ``rank - s`` and sends it on to ``rank + 1``, so the shards land one per
    step. Until ``consume`` needs a piece that has not landed, a helper thread
    drives the ring (waits for each piece, forwards it); from there the
    consuming thread drives it itself, as it waits anyway (Note [Who drives
    the ring])."""

    def __init__(self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup, tag: int) -> None:
        world, rank = group.size(), group.rank()
        self._rank, self._group, self._tag = rank, group, tag
        self._what = f"all_gather of {tensor_str(shard)}"
        self._chunks = chunks = ag_out.view(world, *shard.shape)  # chunks[i]: rank i's shard
        chunks[rank].copy_(shard)  # NB: the sends read this copy: the program may overwrite shard now
        rows = piece_rows(shard)  # the same on every rank: shapes only
        sources = [(rank - step) % world for step in range(1, world)]
        # Piece p: rows of shard sources[p // len(rows)], in the order they land.
        self._pieces = [(src, r) for src in sources for r in rows]
        self._per_step = len(rows)
        self._send_to, self._recv_from = (rank + 1) % world, (rank - 1) % world
        self._landed = [threading.Event() for _ in self._pieces]
        self._failure: BaseException | None = None
        self._driven = 0  # pieces received (and forwarded) so far
        self._stop = False  # set by consume() to drive the rest itself
        # Step 0 from this thread: this rank's shard goes out, the first shard's pieces are posted.
        self._sends = [self._isend(chunks[rank][r]) for r in rows]
        self._recvs = {p: self._irecv(chunks[src][r]) for p, (src, r) in enumerate(self._pieces[: len(rows)])}
        self._thread = threading.Thread(target=self._helper, name="eagertp-ring", daemon=True)
        self._thread.start()

    def _isend(self, t: torch.Tensor) -> dist.Work:
        with peer_transfer(self._what, self._group, self._send_to):
            return _isend(t, self._group, self._send_to, self._tag)

    def _irecv(self, t: torch.Tensor) -> dist.Work:
        with peer_transfer(self._what, self._group, self._recv_from):
            return _irecv(t, self._group, self._recv_from, self._tag)

    def _drive(self, p: int) -> None:
        """Wait for piece ``p``, forward it (posting the receive of the piece
        one step later), and say it landed."""
        wait_for_peer(self._recvs.pop(p), self._what, self._group, self._recv_from)  # Note [Waiting on a peer]
        nxt = p + self._per_step
        if nxt < len(self._pieces):
            src, rows = self._pieces[p]
            self._sends.append(self._isend(self._chunks[src][rows]))
            next_src, next_rows = self._pieces[nxt]
            self._recvs[nxt] = self._irecv(self._chunks[next_src][next_rows])
        self._driven = p + 1
        self._landed[p].set()

    def _helper(self) -> None:
        try:
            for p in range(len(self._pieces)):
                if self._stop:
                    return
                self._drive(p)
        except BaseException as e:  # noqa: B036 - handed to consume(), which raises it
            self._failure = e

    def wait_chunk(self, src: int) -> None:
        for p, (s, _) in enumerate(self._pieces):
            if s == src:
                self._land(p)

    def _land(self, p: int) -> None:
        """Return once piece ``p`` has landed, driving the ring from here if
        the helper has not got there yet (Note [Who drives the ring])."""
        if not self._landed[p].is_set() and self._thread.is_alive():
            # Take over: the helper finishes the piece it is on, then stops.
            self._stop = True
            self._thread.join()
        if self._failure is not None:
            raise self._failure
        while self._driven <= p:
            self._drive(self._driven)

    def consume(self, consumer: ChunkConsumer | None) -> None:
        chunks, rank = self._chunks, self._rank
        if consumer is not None:
            consumer(chunks[rank], rank, slice(0, chunks.shape[1]))
        for p, (src, rows) in enumerate(self._pieces):
            self._land(p)
            if consumer is not None:
                consumer(chunks[src][rows], src, rows)
        self._thread.join()
        for work in self._sends:
            wait_for_peer(work, self._what, self._group, self._send_to)
        self._sends = []

    def landed(self) -> bool | None:
        return all(event.is_set() for event in self._landed)


# Note [Who drives the ring]
# Between a gather's start and its consume the program runs on, so a helper
# thread forwards each piece as it lands. Once consume() reaches a piece that
# has not landed, the consuming thread would only wait; it stops the helper
# (which finishes the piece it is blocked on) and forwards the rest itself, so
# no forward waits for the helper to get a core while the consumer computes
# (with more ranks than cores, measured: benchmarks/NOTES.md). Every piece is
# received and forwarded exactly once, in order, by one thread or the other.


# group name -> the tags of its next gathers on gloo: the same sequence on every
# rank, as gathers start in program order. 0 is left to the reduce-scatter.
_tags: dict[str, itertools.count] = collections.defaultdict(lambda: itertools.count(1))


def _next_tag(group: dist.ProcessGroup) -> int:
    return next(_tags[group.group_name]) % (1 << 30) or 1


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


def _isend(t: torch.Tensor, group: dist.ProcessGroup, group_dst: int, tag: int = 0) -> dist.Work:
    work = dist.isend(t, group=group, group_dst=group_dst, tag=tag)
    assert work is not None, "isend on a group this rank belongs to returns a Work"
    return work


def _irecv(t: torch.Tensor, group: dist.ProcessGroup, group_src: int, tag: int = 0) -> dist.Work:
    work = dist.irecv(t, group=group, group_src=group_src, tag=tag)
    assert work is not None, "irecv on a group this rank belongs to returns a Work"
    return work
