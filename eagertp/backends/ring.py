"""A portable micro-pipeline over torch.distributed point-to-point ops.

Works on any process group that supports ``isend``/``irecv``: gloo on CPU,
NCCL on GPUs.

All-gather, started where the program issues it
-----------------------------------------------
``start_all_gather`` starts moving the shards at once, from this rank's shard
itself (Note [Sends from the shard] in ``eagertp.engine``) straight into their
chunks of ``ag_out`` (no staging buffer, no extra full-size copy), then copies
this rank's shard into its own chunk; ``consume`` runs the consumer on this
rank's own shard, then on each peer's shard as it lands, in ring order
(``rank - 1``, ``rank - 2``, ...). A shard may travel in pieces
(``piece_rows``: split along its ``piece_dim`` by its bytes, Note [Pieces]),
each consumed as it lands; on 2 ranks over gloo a piece travels as up to two
messages (Note [Wire pieces]). How the shards move depends on the world size and
the device:

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
three chunk-sized buffers, in pieces (Note [Pieces]): each piece is sent on as
soon as it is made and added. The messages depend only on the
shapes, ``reduce_op`` and the group, never on the producer: an unfused
reduce-scatter is the same ring whose producer copies a slice of its input.

Produce + all-reduce
--------------------
The reduce-scatter, then the gather of the reduced chunk, started, except on
2 ranks, where the two interleave: each reduced piece goes to the peer as soon
as it is added (Note [Interleaved all-reduce]).
"""

from __future__ import annotations

import _thread
import collections
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from eagertp.backends.base import (
    ALL_ROWS,
    ChunkConsumer,
    ChunkProducer,
    GatherHandle,
    RowsConsumer,
    ShardProducer,
    check_gather_buffers,
    check_scatter_buffers,
    chunk_rows,
    kept_from_thread,
    peer_error,
    raise_kept,
    reduce_scatter_then_gather,
    piece_dim,
    shard_piece,
    wait_for_peer,
)
from eagertp.trace import Meta, Reason, Text

log = logging.getLogger(__name__)


class RingBackend:
    """Ring all-gather whose consumer of chunk i overlaps the transfer of chunk i+1."""

    name = "ring"

    def start_all_gather(
        self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup
    ) -> _P2PGather | _ThreadedRing:
        check_gather_buffers(shard, ag_out, group)
        if group.size() > 2 and shard.is_cpu and shard.numel():
            return _ThreadedRing(shard, ag_out, group, _next_tag(group))
        return _P2PGather(shard, ag_out, group)

    def why_not_produce_all_gather(self, shard: torch.Tensor, group: dist.ProcessGroup) -> str | None:
        if not shard.is_cpu:
            return "the ring makes a shard piece by piece on gloo only (NCCL posts a gather as one batch)"
        if group.size() == 1:
            return "a group of one rank sends nothing"
        if len(piece_rows(shard, "all_gather")) < 2:
            return f"{Meta.of(shard)} travels in one piece (Note [Pieces]): nothing to overlap its making with"
        return None

    def produce_all_gather(
        self, producer: ShardProducer, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup
    ) -> _P2PGather | _ThreadedRing:
        """Each piece of the shard made, then sent at once, while the next is
        made (Note [Matmul + all-gather] in eagertp.collectives.all_gather)."""
        check_gather_buffers(shard, ag_out, group)
        assert self.why_not_produce_all_gather(shard, group) is None, "the caller checks why_not_produce_all_gather"
        if group.size() > 2:
            return _ThreadedRing(shard, ag_out, group, _next_tag(group), producer)
        return _P2PGather(shard, ag_out, group, producer)

    def produce_reduce_scatter(
        self,
        producer: ChunkProducer,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        reduce_op: str,
    ) -> None:
        check_scatter_buffers(out, reduce_op)
        world, rank = group.size(), group.rank()
        if world == 1 or out.numel() == 0:
            producer(rank, out, ALL_ROWS)
        else:
            what = Reason("reduce_scatter({}) -> {}", reduce_op, Meta.of(out))
            rows = chunk_rows(out)  # pieces are rows of it, whatever out's dims (ChunkProducer)
            _Links(group, what, out.device).reduce_scatter(producer, rows, reduce_op, piece_rows(rows, "reduce_scatter"))
        if reduce_op == "avg":
            out.div_(world)

    def start_all_reduce(
        self,
        producer: ChunkProducer,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        reduce_op: str,
    ) -> GatherHandle:
        """On 2 ranks, the two halves interleaved (Note [Interleaved
        all-reduce]); on more, the reduce-scatter ring, then the gather of the
        reduced shard started."""
        if group.size() != 2 or out.numel() == 0:
            return reduce_scatter_then_gather(self, producer, out, group, reduce_op)
        check_scatter_buffers(out, reduce_op)
        return _InterleavedAllReduce(producer, out, group, reduce_op)


class _GatherLayout(NamedTuple):
    """What a 2-rank-or-more gather's messages and pieces are: a function of
    the shard's shape and dtype, the group's size, this rank and the device
    kind only, so worked out once per shape (``_gather_layout``)."""

    rows: tuple[slice, ...]  # the pieces consumed (Note [Pieces])
    # What travels: the pieces, each split once more on the 2-rank ring over
    # gloo (Note [Wire pieces]); what is consumed: the pieces.
    wire: list[list[slice]]
    messages: list[slice]  # one shard's, in the order they land
    # Peers' shards in the order they are consumed, rank - 1, rank - 2, ...
    # (the ring's order, so that sums over chunks add as they always have).
    sources: list[int]
    received: list[list[range]]  # per source and piece: the indices of its messages among the receives


def _gather_layout(shard: torch.Tensor, world: int, rank: int, on_cpu: bool) -> _GatherLayout:
    # NB: PIECES and WIRE_SPLIT may change (tests, benchmarks): part of the key.
    key = (shard.shape, shard.dtype, world, rank, on_cpu, PIECES["all_gather"], WIRE_SPLIT)
    layout = _gather_layouts.get(key)
    if layout is None:
        rows = piece_rows(shard, "all_gather")  # the same on every rank: shapes only
        wire = wire_rows(shard, rows) if world == 2 and on_cpu else [[r] for r in rows]
        messages = [w for split in wire for w in split]
        sources = [(rank - step) % world for step in range(1, world)] if shard.numel() else []
        ends = list(itertools.accumulate(len(split) for split in wire))
        received = [
            [range(i * len(messages) + end - len(split), i * len(messages) + end) for end, split in zip(ends, wire)]
            for i in range(len(sources))
        ]
        layout = _gather_layouts[key] = _GatherLayout(rows, wire, messages, sources, received)
    return layout


# (shape, dtype, world, rank, on CPU?, PIECES["all_gather"], WIRE_SPLIT) ->
# its _GatherLayout; bounded by the shapes a program gathers.
_gather_layouts: dict[tuple, _GatherLayout] = {}


class _Piece(NamedTuple):
    """A piece of a peer's shard, as ``_P2PGather.consume`` runs its consumer."""

    src: int  # the peer whose shard it is
    rows: slice  # its rows of that shard
    view: torch.Tensor  # those rows of ag_out
    received: range  # the indices of its messages among the gather's receives
    messages: list[slice]  # the rows each message carries (Note [Wire pieces])


class _P2PGather:
    """An all-gather in flight: every send and receive posted at construction."""

    def __init__(
        self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup, producer: ShardProducer | None = None
    ) -> None:
        world, rank = group.size(), group.rank()
        self._rank, self._group = rank, group
        self._what = Reason("all_gather of {}", Meta.of(shard))
        transport = transport_of(group, ag_out.device, self._what)
        self._chunks = chunks = ag_out.view(world, *shard.shape)  # chunks[i]: rank i's shard
        layout = _gather_layout(shard, world, rank, ag_out.is_cpu)
        rows, wire, messages, sources = layout.rows, layout.wire, layout.messages, layout.sources
        # (_isend or _irecv, tensor, peer): every receive, then every send (Note
        # [Receives first]); each send from the shard itself (Note [Sends from
        # the shard] in eagertp.engine).
        ops: list[tuple[Callable, torch.Tensor, int]] = [
            (_irecv, piece, src) for src in sources for piece in pieces_of(chunks[src], messages)
        ]
        n_receives = len(ops)
        shard_messages = pieces_of(shard, messages)
        ops += [
            (_isend, piece, (rank + step) % world) for step in range(1, len(sources) + 1) for piece in shard_messages
        ]
        try:
            if producer is None:
                works = _post(ops, group, transport)
            else:  # 2 ranks on gloo: the receives, then each message sent as soon as it is made
                assert world == 2 and ag_out.is_cpu, "produced gathers: RingBackend.produce_all_gather"
                works = [post(t, transport, peer) for post, t, peer in ops[:n_receives]]
                for w, (post, piece, peer) in zip(messages, ops[n_receives:]):
                    producer(piece, w)
                    works.append(post(piece, transport, peer))
        except RuntimeError as e:
            raise peer_error(e, self._what, group, sources[0] if sources else rank) from e  # 2 ranks: the one peer
        # What is consumed, once the messages are on their way.
        self._whole = slice(0, rows[-1].stop)
        self._pieces = [
            _Piece(src, r, piece, received, split)
            for src, received_per_piece in zip(sources, layout.received)
            for r, piece, received, split in zip(rows, pieces_of(chunks[src], rows), received_per_piece, wire)
        ]
        # This rank's chunk of ag_out: copied from the shard when consumed,
        # unless nothing reads it then (Note [This rank's chunk, unread]).
        self._shard: torch.Tensor | None = shard
        # (work, the peer it waits for): Note [Waiting on a peer]
        if len(works) == len(ops):  # gloo: one Work per op
            recvs = [(w, peer) for (post, _, peer), w in zip(ops, works) if post is _irecv]
            self._rest = [(w, peer) for (post, _, peer), w in zip(ops, works) if post is _isend]
        else:  # NCCL coalesces a batch into one Work: the first piece waits for all
            recvs, self._rest = [], [(w, sources[0]) for w in works]
        # NB: wait_chunk and consume share the receives, release_shard and
        # consume the sends: a gloo Work may be waited for once only.
        self._recvs = _Receives(recvs, self._what, group, on_cpu=ag_out.is_cpu)
        # NB: gloo's receives, one Work each (NCCL: none; the batch's one Work
        # is in _rest): ``bool(self._recvs)`` without its __len__ frame.
        self._per_receive = bool(recvs)

    def _fill_own(self) -> None:
        if self._shard is not None:
            own = self._chunks[self._rank]
            if self._shard.data_ptr() != own.data_ptr():  # NB: a produced shard is made there
                own.copy_(self._shard)
            self._shard = None

    def release_shard(self) -> None:
        self._fill_own()  # NB: before the program overwrites the shard
        self._wait(self._rest)
        if self._per_receive:  # gloo: the sends, waited for once (NCCL: the batch's one Work)
            self._rest = []

    def wait_chunk(self, src: int) -> None:
        if src == self._rank:
            self._fill_own()
            return
        if not self._per_receive:
            self._wait(self._rest)
            return
        for piece in self._pieces:
            if piece.src == src:
                self._recvs.wait(piece.received[-1])

    def consume(self, consumer: ChunkConsumer | None, *, own_chunk_unread: bool = False) -> None:
        chunks, rank = self._chunks, self._rank
        if consumer is not None:
            own = chunks[rank] if self._shard is None else self._shard
            consumer(own, rank, self._whole)
        if own_chunk_unread:
            self._shard = None  # never filled: nothing will read it
        else:
            self._fill_own()  # while the peers' pieces land
        if not self._per_receive:
            self._wait(self._rest)
        by_message = isinstance(consumer, RowsConsumer)
        for src, rows, piece, received, split in self._pieces:
            if self._per_receive:
                if by_message and len(split) > 1 and self._waited_for(received[0]):
                    # Behind the wire: each message as it lands (Note [Wire pieces]).
                    for i, message in zip(received, split):
                        self._recvs.wait(i)
                        consumer(shard_piece(self._chunks[src], message), src, message)
                    continue
                self._recvs.wait(received[-1])
            if consumer is not None:
                # The consumer of one piece overlaps the transfers of the pieces after it.
                consumer(piece, src, rows)
        self._wait(self._rest)
        self._rest = []

    def _waited_for(self, i: int) -> bool:
        """Wait for receive ``i``; True if it had not landed (the wait took
        longer than WAITED_S)."""
        start = time.perf_counter()
        self._recvs.wait(i)
        return time.perf_counter() - start > WAITED_S

    def _wait(self, works: list[tuple[dist.Work, int]]) -> None:
        for work, peer in works:
            wait_for_peer(work, self._what, self._group, peer)

    def watch(self) -> None:
        self._recvs.watch()

    def landed(self) -> bool | None:
        if self._per_receive or self._chunks.is_cpu:
            return self._recvs.landed()
        return all(work.is_completed() for work, _ in self._rest)  # NCCL's one Work: its CUDA event


class _ThreadedRing:
    """A ring all-gather for gloo with more than 2 ranks: step s receives shard
    ``rank - s`` and sends it on to ``rank + 1``, so the shards land one per
    step. Until ``consume`` needs a piece that has not landed, a helper thread
    drives the ring (waits for each piece, forwards it); from there the
    consuming thread drives it itself, as it waits anyway (Note [Who drives
    the ring])."""

    def __init__(
        self,
        shard: torch.Tensor,
        ag_out: torch.Tensor,
        group: dist.ProcessGroup,
        tag: int,
        producer: ShardProducer | None = None,
    ) -> None:
        world, rank = group.size(), group.rank()
        self._rank = rank
        self._links = _Links(group, Reason("all_gather of {}", Meta.of(shard)), ag_out.device, tag)
        self._chunks = chunks = ag_out.view(world, *shard.shape)  # chunks[i]: rank i's shard
        rows = piece_rows(shard, "all_gather")  # the same on every rank: shapes only
        self._whole = slice(0, rows[-1].stop)
        sources = [(rank - step) % world for step in range(1, world)]
        # Piece p: rows of shard sources[p // len(rows)], in the order they land.
        self._pieces = [(src, r) for src in sources for r in rows]
        self._per_step = len(rows)
        self._landed = [threading.Event() for _ in self._pieces]
        self._failure: BaseException | None = None
        self._driven = 0  # pieces received (and forwarded) so far
        self._stop = False  # set by consume() to drive the rest itself
        # Step 0 from this thread: the first shard's pieces are posted (Note
        # [Receives first]), then this rank's shard goes out, from the shard
        # itself (Note [Sends from the shard]); a produced one each piece as
        # soon as it is made.
        self._recvs = {
            p: self._links.irecv(shard_piece(chunks[src], r)) for p, (src, r) in enumerate(self._pieces[: len(rows)])
        }
        self._shard_sends = []
        for r, piece in zip(rows, pieces_of(shard, rows)):
            if producer is not None:
                producer(piece, r)
            self._shard_sends.append(self._links.isend(piece))
        if shard.data_ptr() != chunks[rank].data_ptr():  # NB: a produced shard is made there
            chunks[rank].copy_(shard)  # while the shard is on its way
        self._sends: list[dist.Work] = []  # the forwards, appended by whichever thread drives the ring
        self._helper_done = threading.Event()
        _thread.start_new_thread(self._helper, ())  # NB: as _Receives.watch: no wait for it to run

    def _drive(self, p: int) -> None:
        """Wait for piece ``p``, forward it (posting the receive of the piece
        one step later), and say it landed."""
        self._links.wait_received(self._recvs.pop(p))  # Note [Waiting on a peer]
        nxt = p + self._per_step
        if nxt < len(self._pieces):
            src, rows = self._pieces[p]
            self._sends.append(self._links.isend(shard_piece(self._chunks[src], rows)))
            next_src, next_rows = self._pieces[nxt]
            self._recvs[nxt] = self._links.irecv(shard_piece(self._chunks[next_src], next_rows))
        self._driven = p + 1
        self._landed[p].set()

    def _helper(self) -> None:
        try:
            for p in range(len(self._pieces)):
                if self._stop:
                    return
                self._drive(p)
        except BaseException as e:  # noqa: B036 - handed to consume(), which raises it
            self._failure = kept_from_thread(e)
        finally:
            self._helper_done.set()

    def wait_chunk(self, src: int) -> None:
        for p, (s, _) in enumerate(self._pieces):
            if s == src:
                self._land(p)

    def _land(self, p: int) -> None:
        """Return once piece ``p`` has landed, driving the ring from here if
        the helper has not got there yet (Note [Who drives the ring])."""
        if not self._landed[p].is_set() and not self._helper_done.is_set():
            # Take over: the helper finishes the piece it is on, then stops.
            self._stop = True
            self._helper_done.wait()
        if self._failure is not None:
            raise_kept(self._failure)
        while self._driven <= p:
            self._drive(self._driven)

    def consume(self, consumer: ChunkConsumer | None, *, own_chunk_unread: bool = False) -> None:
        chunks, rank = self._chunks, self._rank
        if consumer is not None:
            consumer(chunks[rank], rank, self._whole)
        for p, (src, rows) in enumerate(self._pieces):
            self._land(p)
            if consumer is not None:
                consumer(shard_piece(chunks[src], rows), src, rows)
        self._helper_done.wait()
        self.release_shard()
        self._links.wait_sent(self._sends)
        self._sends = []

    def release_shard(self) -> None:
        self._links.wait_sent(self._shard_sends)  # NB: gloo's Work: waited for once
        self._shard_sends = []

    def watch(self) -> None:
        pass  # the helper thread says what has landed already

    def landed(self) -> bool | None:
        return all(event.is_set() for event in self._landed)


class _Links:
    """Point-to-point messages of one collective to the next rank and from the
    previous one, each post and wait naming the collective if it fails."""

    def __init__(self, group: dist.ProcessGroup, what: Text, device: torch.device, tag: int = 0) -> None:
        world, rank = group.size(), group.rank()
        self.group, self.what, self.tag = group, what, tag
        self.transport = transport_of(group, device, what)
        self.send_to, self.recv_from = (rank + 1) % world, (rank - 1) % world

    def isend(self, t: torch.Tensor) -> dist.Work:
        try:
            return _isend(t, self.transport, self.send_to, self.tag)
        except RuntimeError as e:
            raise peer_error(e, self.what, self.group, self.send_to) from e

    def irecv(self, t: torch.Tensor) -> dist.Work:
        try:
            return _irecv(t, self.transport, self.recv_from, self.tag)
        except RuntimeError as e:
            raise peer_error(e, self.what, self.group, self.recv_from) from e

    def wait_sent(self, works: list[dist.Work]) -> None:
        for work in works:
            wait_for_peer(work, self.what, self.group, self.send_to)  # Note [Waiting on a peer]

    def wait_received(self, work: dist.Work) -> None:
        wait_for_peer(work, self.what, self.group, self.recv_from)

    def reduce_scatter(
        self, producer: ChunkProducer, out: torch.Tensor, reduce_op: str, rows: Sequence[slice]
    ) -> None:
        """The ring of partial sums (module docstring), each chunk produced,
        combined and sent on in pieces ``rows``; leaves ``out`` reduced (not yet
        divided for avg)."""
        world, rank = self.group.size(), self.group.rank()
        combine = _COMBINE[reduce_op]
        send_buf, recv_buf = torch.empty_like(out), torch.empty_like(out)
        spare = torch.empty_like(out) if world > 2 else None
        received = pieces_of(recv_buf, rows)
        # NB: every receive is posted as soon as its buffer is free, so that a
        # peer's piece can move while this rank computes (gloo moves a message
        # once both sides have posted it).
        recvs = [self.irecv(piece) for piece in received]
        sends = []
        for r, piece in zip(rows, pieces_of(send_buf, rows)):  # each piece goes out as soon as it is made
            producer((rank - 1) % world, piece, r)
            sends.append(self.isend(piece))
        for step in range(1, world):
            last = step == world - 1
            acc = out if last else spare
            forwards, next_recvs = [], []
            for r, piece, got, recv in zip(rows, pieces_of(acc, rows), received, recvs):
                # This rank's share of chunk c overlaps the transfer of the partial sum of c.
                producer((rank - step - 1) % world, piece, r)
                self.wait_received(recv)
                combine(piece, got)
                if not last:
                    next_recvs.append(self.irecv(got))  # the next step's piece r
                    forwards.append(self.isend(piece))
            recvs = next_recvs
            if not last:
                self.wait_sent(sends)  # send_buf is free again
                send_buf, spare, sends = acc, send_buf, forwards
        self.wait_sent(sends)  # NB: once: a gloo Work waited twice waits for another message


# Note [Interleaved all-reduce]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A matmul + all-reduce on 2 ranks run as its reduce-scatter, then the gather
# of the reduced shard, leaves the link idle while this rank computes its own
# chunk and the peer's partial of it arrives, then sends the reduced chunk only
# once the whole reduce-scatter is done. Interleaved, each piece of this rank's
# chunk goes out to the peer as soon as it is reduced, while the next piece is
# computed: the link carries the reduce-scatter's bytes, then the gather's,
# with no gap. Rank 0, chunks in 2 pieces (``P[c][j]``: this rank's product
# rows of chunk c, piece j; ``R[c][j]``: reduced)::
#
#     compute: [P[1][0]][P[1][1]][P[0][0]][+][P[0][1]][+]
#     send:           [P[1][0]][P[1][1]]   [R[0][0]]   [R[0][1]]
#     receive:        [P from 1 ......][R[1][0] ...][R[1][1] ...]   -> consume
#
# Every element is still reduced once, by its owner, as out[0] = P[0] + the
# peer's partial (the reduce-scatter's order), then copied. The messages are
# the same whatever the producer or the consumer (Invariant 2): partial pieces,
# then reduced pieces, in the pieces ``piece_rows(chunk, "all_reduce")`` makes
# of the shapes alone. A consumer of the result binds to the returned handle
# as to any gather in flight; the reduced pieces were posted to be received at
# the start.
#
# Note [Partial sums where the reduced rows land]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``P[peer]`` needs a buffer only while it is sent, and the peer's reduced rows
# ``R[peer]`` need the peer's rows of ``out`` only once they arrive: one place
# serves both. Piece j of ``R[peer]`` can only arrive after the peer received
# all of piece j of ``P[peer]`` (it is that piece plus the peer's own partial),
# so every byte of the send was read before the first byte of the receive is
# written, whatever the transport (gloo and NCCL send and receive from the
# tensor's own memory, and neither writes a receive buffer before its data
# arrives). Nothing else reads those rows before ``R[peer]`` has landed: the
# consumers wait for each reduced piece. The buffer this saves is one chunk of
# every all-reduce in flight (benchmarks/results/memory_2cpu-gloo-loopback_2026-12-04_d848e84.md).


class _InterleavedAllReduce:
    """``out = all_reduce(product)`` on 2 ranks, started: on return this rank's
    chunk of ``out`` is reduced and on its way to the peer, the peer's reduced
    chunk is arriving into ``out`` (Note [Interleaved all-reduce])."""

    def __init__(self, producer: ChunkProducer, out: torch.Tensor, group: dist.ProcessGroup, reduce_op: str) -> None:
        rank = group.rank()
        self._rank, self._peer = rank, 1 - rank
        self._links = links = _Links(group, Reason("all_reduce({}) of {}", reduce_op, Meta.of(out)), out.device)
        self._chunks = chunks = out.view(2, out.shape[0] // 2, *out.shape[1:])
        own, peer = chunks[rank], chunks[self._peer]
        self._rows = rows = piece_rows(own, "all_reduce")
        combine = _COMBINE[reduce_op]
        partial = torch.empty_like(own)
        partial_pieces = pieces_of(partial, rows)
        self._peer_pieces = pieces_of(peer, rows)
        # NB: both receives posted first, in the order the peer sends: its
        # partial sums of this rank's chunk, then its reduced chunk.
        partials = [links.irecv(piece) for piece in partial_pieces]
        self._reduced = _Receives(
            [(links.irecv(piece), self._peer) for piece in self._peer_pieces],
            links.what, group, on_cpu=out.is_cpu,
        )
        self._sends = []
        # This rank's partial sums of the peer's chunk are made and sent from
        # the peer's rows of ``out``, where its reduced rows land later (Note
        # [Partial sums where the reduced rows land]).
        for r, piece in zip(rows, self._peer_pieces):
            producer(self._peer, piece, r)
            self._sends.append(links.isend(piece))
        for r, piece, got, recv in zip(rows, pieces_of(own, rows), partial_pieces, partials):
            producer(rank, piece, r)
            links.wait_received(recv)
            combine(piece, got)
            if reduce_op == "avg":
                piece.div_(2)
            self._sends.append(links.isend(piece))

    def wait_chunk(self, src: int) -> None:
        if src != self._rank and self._rows:
            self._reduced.wait(len(self._rows) - 1)

    def consume(self, consumer: ChunkConsumer | None, *, own_chunk_unread: bool = False) -> None:
        chunks = self._chunks
        if consumer is not None:
            consumer(chunks[self._rank], self._rank, slice(0, self._rows[-1].stop))
        for i, (r, piece) in enumerate(zip(self._rows, self._peer_pieces)):
            self._reduced.wait(i)
            if consumer is not None:
                consumer(piece, self._peer, r)
        self.release_shard()

    def release_shard(self) -> None:
        self._links.wait_sent(self._sends)  # NB: gloo's Work: waited for once
        self._sends = []

    def watch(self) -> None:
        self._reduced.watch()

    def landed(self) -> bool | None:
        return self._reduced.landed()


class _Receives:
    """The receives of a gather in flight, in the order they are consumed,
    each waited for once (a gloo Work waited for twice waits for another
    message): by the consuming thread, or, once watched, by a thread that
    waits for each as it lands, so that ``landed`` can tell on gloo too
    (Note [Landed gathers] in eagertp.patterns)."""

    def __init__(self, works: list[tuple[dist.Work, int]], what: Text, group: dist.ProcessGroup, *, on_cpu: bool) -> None:
        self._works = works  # (work, the peer it waits for): Note [Waiting on a peer]
        self._what, self._group, self._on_cpu = what, group, on_cpu
        self._count = 0  # receives known to have landed: 0 .. count - 1
        self._landed: list[threading.Event] = []  # once watched: receive i landed (or the watcher stopped)
        self._failure: BaseException | None = None

    def __len__(self) -> int:
        return len(self._works)

    def wait(self, i: int) -> None:
        """Return once receives ``0..i`` have landed."""
        if not self._landed:  # not watched
            while self._count <= i:
                self._receive_next()
            return
        self._landed[i].wait()  # NB: bounded: the watcher's waits time out as ours would
        if self._count <= i:
            assert self._failure is not None, "the watcher stopped early without a failure"
            raise_kept(self._failure)

    def _receive_next(self) -> None:
        """Wait for receive ``count`` (Note [Waiting on a peer]): on one thread
        only, the consuming one or, once watched, the watcher."""
        work, peer = self._works[self._count]
        wait_for_peer(work, self._what, self._group, peer)
        self._count += 1

    def watch(self) -> None:
        """From now on, wait for the receives on a thread of their own (gloo:
        its Work says it completed only once waited for)."""
        if not self._landed and self._on_cpu and self._count < len(self._works):
            self._landed = [threading.Event() for _ in self._works]
            for event in self._landed[: self._count]:
                event.set()
            # NB: not threading.Thread, whose start() waits until the new thread
            # runs: about 0.9 ms with both cores busy (benchmarks/NOTES.md). The
            # thread ends once every receive has landed or one failed.
            _thread.start_new_thread(self._watch, ())

    def _watch(self) -> None:
        try:
            while self._count < len(self._works):
                self._receive_next()
                self._landed[self._count - 1].set()
        except BaseException as e:  # noqa: B036 - raised by wait() on the consuming thread
            self._failure = kept_from_thread(e)
        finally:
            for event in self._landed:
                event.set()

    def landed(self) -> bool | None:
        """Never blocks. NCCL: each Work's CUDA event; gloo: what has been
        waited for, None if nothing watches the rest."""
        if not self._on_cpu:
            return all(work.is_completed() for work, _ in self._works)
        if self._count == len(self._works):
            return True
        return False if self._landed else None


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


# Note [Pieces]
# A chunk may travel in up to PIECES[kind][0] pieces of at least PIECES[kind][1]
# bytes, so that the matmul of one piece overlaps the transfer of the next
# (all-gather: its consumer; reduce-scatter and all-reduce: its producer, and
# the all-reduce's reduced pieces go on as each is added). The rule reads the
# chunk's shape and dtype only: every rank must split alike (Invariant 2), and
# an all-gather starts before its consumers are known. Measured on 2 CPU ranks
# over gloo against hand-written schedules (benchmarks/NOTES.md).
# A chunk splits along its ``piece_dim``: dim 0, or past leading dims of size 1.
# A batch of one sharded along the sequence (DTensor SP's [1, S/W, D], HF's
# [1, S, V/W] logits) splits along S as [S/W, D] would, where splitting dim 0
# would leave it whole: no consumer could start before the peer's whole shard
# had landed, and no product could be sent as it is made (benchmarks/NOTES.md,
# 2026-12-02 at 446ea6a: its gather of a product went from 1.0x to 1.2-1.3x unfused).
# An all-reduced chunk splits from 2 MiB: each piece costs two messages (its
# partial sums, then its reduced rows), which a 1 MiB chunk, the smallest the
# size rule fuses on CPU, does not earn back (2026-12-03 at 0bc2d19: the no-SP step 3%
# faster on loopback whole, the same on 2gbit; the K = 1024 op 2% slower).
PIECES: dict[str, tuple[int, int]] = {
    "all_gather": (2, 256 << 10),
    "reduce_scatter": (1, 64 << 10),
    "all_reduce": (2, 1 << 20),
}


# Note [Receives first]
# A gather posts every receive before any send, and as early as it can: the
# pieces it will consume are worked out once the messages are on their way.
# Over gloo a message moves only once its sender has heard that the receive
# is posted (a send finding none is queued, and the receiver's notice starts
# it), so a receive posted first lets the peer's bytes start while this rank
# is still posting its sends. The price: a send posted once the peer's
# receive is known starts writing its message into the socket at once, on
# the posting thread, where a send posted first is written later by gloo's
# own thread. What each rank posts, and in which order per peer, is
# unchanged (Invariant 2). Measured (benchmarks/NOTES.md, 2026-12-03 at c0b0836): at
# M = K = 1024 on 2gbit the first receive is posted 0.37 ms after the
# program issues the gather (before: the first of 4 sends at 0.41 ms, the
# receives after them); the posts took 0.5-2.5 ms of the program's thread
# against 0.5-0.8 (`call_cost.py --form all_gather_matmul`); the
# all-gather + matmul at N = 256, the row the wire bounds, read 1.05x the
# best hand schedule against 1.14x (medians of three alternated runs); N =
# 512-1024, the prefetch form and the step unchanged within the noise.


# Note [Wire pieces]
# On 2 ranks over gloo an all-gather's pieces each travel as up to
# WIRE_SPLIT messages of at least the kind's minimum bytes, a function of the
# shape alone like the pieces (Invariant 2). A producer (Note [Matmul +
# all-gather]) makes and sends each message's rows as soon as it can. A
# consumer runs once per piece, when its messages have landed, unless it is
# behind the wire: a RowsConsumer (each call writes rows of its own, nothing
# accumulates) that had to wait for a piece's first message multiplies each
# message of that piece as it lands, its matmul overlapping the next
# message's transfer. The rank's own choice: the messages are the same
# either way. Why by waiting and not by a rule on shapes: whether smaller
# matmuls pay depends on the link (benchmarks/NOTES.md, 2026-12-03 at 0bc2d19: by the
# shapes alone, per message ran the all-gather + matmul at M = K = 1024,
# N = 256-512 4-13% closer to the best hand schedule on 2gbit, and 7-9%
# slower on loopback, where the messages land before the consumer gets to
# them). What 4 pieces cost at large N was those smaller matmuls, not the
# messages (2026-12-03 at c733743: 4 messages in 2 matmuls, 0.98-1.01x of 2 in 2).
# Each output row is the same matmul of its own rows whichever way its rows
# are grouped: the bits of CPU matmuls did not change with the rows grouped
# by 8 or more, but may on other BLAS, so results may vary run to run within
# the tolerance of chunked matmul (Invariant 1). Consumers that accumulate
# (weight gradients) keep their pieces: their sums would vary, and each more
# call reads and writes their whole output again.
WIRE_SPLIT = 2
# A wait for a 512 KiB receive that had landed took 70 us at the median, 134
# at most, with a core busy (2026-12-03 at 0bc2d19); a 2gbit link moves it in 2-4 ms.
WAITED_S = 300e-6


def wire_rows(shard: torch.Tensor, rows: Sequence[slice]) -> list[list[slice]]:
    """Per piece ``rows[i]`` of ``shard``, the rows its messages carry (Note
    [Wire pieces]): two halves where each holds the kind's minimum bytes,
    else the piece itself."""
    if len(rows) < 2:
        return [list(rows)]
    n_rows = shard.shape[piece_dim(shard.shape)] if shard.dim() else 1
    row_bytes = shard.numel() * shard.element_size() // max(n_rows, 1)
    min_bytes = PIECES["all_gather"][1]
    return [_split_rows(r.start, r.stop - r.start, row_bytes, WIRE_SPLIT, min_bytes) for r in rows]


def pieces_of(t: torch.Tensor, rows: Sequence[slice]) -> list[torch.Tensor]:
    """``[shard_piece(t, r) for r in rows]``, ``rows`` the ``piece_rows`` of a
    tensor shaped as ``t``: one piece is ``t`` itself (NB: the common case, and
    a view costs several us on the ring's path)."""
    if len(rows) == 1:
        return [t]
    return [shard_piece(t, r) for r in rows]


def piece_rows(
    chunk: torch.Tensor, kind: str, max_pieces: int | None = None, min_bytes: int | None = None
) -> tuple[slice, ...]:
    """How one chunk of a ``kind`` collective is split along its ``piece_dim``
    for the ring (Note [Pieces]): a function of its shape and dtype only, so
    asked once per shape (a tuple: the same one again for the same shape)."""
    key = (kind, PIECES[kind], max_pieces, min_bytes, chunk.shape, chunk.dtype)  # NB: PIECES may change (tests)
    rows = _piece_rows.get(key)
    if rows is None:
        default_max, default_min = PIECES[kind]
        max_pieces = default_max if max_pieces is None else max_pieces
        min_bytes = default_min if min_bytes is None else min_bytes
        n_rows = chunk.shape[piece_dim(chunk.shape)] if chunk.dim() else 1
        row_bytes = chunk.numel() * chunk.element_size() // max(n_rows, 1)
        rows = _piece_rows[key] = tuple(_split_rows(0, n_rows, row_bytes, max_pieces, min_bytes))
    return rows


# (kind, PIECES[kind], max_pieces, min_bytes, shape, dtype) -> piece_rows's answer; bounded by the
# shapes a program's collectives take.
_piece_rows: dict[tuple, tuple[slice, ...]] = {}


def _split_rows(start: int, n_rows: int, row_bytes: int, max_pieces: int, min_bytes: int) -> list[slice]:
    """Rows ``start .. start + n_rows`` in up to ``max_pieces`` runs of at
    least ``min_bytes`` each (and a row), as even as whole rows allow."""
    pieces = max(1, min(max_pieces, n_rows, n_rows * row_bytes // max(min_bytes, 1)))
    bounds = [start + i * n_rows // pieces for i in range(pieces + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


# Note [eagertp's own connections]
# On gloo, the ring's messages travel over connections of eagertp's own, never
# over the user's process group, and one thread at a time posts on them.
# torch's ProcessGroupGloo is written for one thread ("For multi-threaded usage
# of process groups, you can consider using multiple process group
# instances", ProcessGroupGloo.hpp), while the ring posts from several: the
# forwards of a ring over more than 2 ranks from its helper thread (Note [Who
# drives the ring]), while the program's thread starts the next gather or
# issues the user's own collectives on the same group. A heap corrupted in
# gloo's threads killed a test worker about once in 10-20 full test runs,
# always in the suite's busiest users of gloo from several threads at once
# (benchmarks/NOTES.md, 2026-12-02 at 94d3a94); nothing finer was found.
# So each group gets a ``Transport``: a ProcessGroupGloo of its own over the
# same ranks (its own context, connections and sockets, on the group's gloo
# device), made as torch makes a gloo group (from the group's store, under a
# prefix of its own, with the group's timeout), by every rank of the group at
# its first ring collective (the same point in program order on every rank,
# Invariant 2). Each post holds the transport's lock; a wait holds nothing (it
# touches only its own Work, and a helper waits while the program's thread
# posts the receive its peer needs next). The user's group then carries the
# user's collectives only, from the user's thread. NCCL posts a gather as one
# batch from the program's thread, on the group itself.
# A transport holds no reference to the user's group, and ends with it (or at
# exit): once the user destroys the group, nothing of eagertp keeps gloo
# threads of its own alive.


class Transport:
    """Where the ring posts its messages to a group's ranks: eagertp's own
    gloo group on CPU (``own``), else the group itself (Note [eagertp's own
    connections]). ``lock`` is held around every post."""

    def __init__(self, group: dist.ProcessGroup, own: dist.ProcessGroup | None) -> None:
        self.own = own
        # What posts go to: NB a proxy of the user's group, never a reference.
        self.target = own if own is not None else weakref.proxy(group)
        self.lock = threading.Lock()

    def close(self) -> None:
        if self.own is not None:
            self.own._get_backend(torch.device("cpu")).shutdown()
            self.own = None


# (group name, on CPU?) -> (a reference to the group, its transport), one per
# live group and kind of device (a "cpu:gloo,cuda:nccl" group has both).
_transports: dict[tuple[str, bool], tuple[weakref.ref, Transport]] = {}
# group name -> transports made for groups of that name: the key prefix of the
# next, the same on every rank (groups are made, and rings run, in program order).
_transports_made: collections.Counter[str] = collections.Counter()


def transport_of(group: dist.ProcessGroup, device: torch.device, what: Text) -> Transport:
    """The group's transport, made on first use (collectively: every rank of
    the group calls this at the same point, Note [eagertp's own connections]),
    by ``what`` (the collective, for the error if a peer never comes)."""
    key = (group.group_name, device.type == "cpu")
    entry = _transports.get(key)
    if entry is not None and entry[0]() is group:
        return entry[1]
    if entry is not None:  # a destroyed group's name, reused
        entry[1].close()
    transport = Transport(group, _own_gloo_group(group, what) if device.type == "cpu" else None)
    _transports[key] = (weakref.ref(group), transport)
    weakref.finalize(group, _close_transport, key, transport)
    return transport


def _close_transport(key: tuple[str, bool], transport: Transport) -> None:
    """The user's group is gone, or the interpreter is about to finalise
    (``weakref.finalize`` runs then too, while Python still runs): so is its
    transport, its gloo threads joined."""
    transport.close()
    entry = _transports.get(key)
    if entry is not None and entry[1] is transport:
        del _transports[key]


def _own_gloo_group(group: dist.ProcessGroup, what: Text) -> dist.ProcessGroup | None:
    """A gloo group of eagertp's own over ``group``'s ranks, made as
    torch.distributed makes one, but known to it only through us (so
    ``new_group``'s every-rank rule does not apply: only the group's ranks
    make it); None where torch.distributed does not know ``group`` (its store
    is then unknown: the ring posts on the group itself, under the lock)."""
    name = group.group_name
    try:
        store = c10d._get_process_group_store(group)
        users = group._get_backend(torch.device("cpu")).options
    except (KeyError, RuntimeError, AttributeError) as e:
        log.info("eagertp: the ring posts on group %r itself (%s: no store or timeout known)", name, e)
        return None
    store = c10d.PrefixStore(f"eagertp/transport/{name}/{_transports_made[name]}/", store)
    _transports_made[name] += 1
    rank, size = group.rank(), group.size()
    _meet(store, group, users._timeout, what)
    own = dist.ProcessGroup(store, rank, size)
    gloo = dist.ProcessGroup.BackendType.GLOO
    own._set_default_backend(gloo)
    # NB: on the user's group's gloo device (its network interface, and its one
    # thread that moves every pair's bytes: a device of its own measured 2-4%
    # slower on 4 ranks on 2 cores), with one worker thread (collectives run
    # there; the ring posts none).
    options = dist.ProcessGroupGloo._Options()
    options._timeout, options._devices, options._threads = users._timeout, users._devices, 1
    own._register_backend(torch.device("cpu"), gloo, dist.ProcessGroupGloo(store, rank, size, options))
    own._set_group_name(own_group_name(name))
    log.debug("eagertp: made the ring's own gloo connections over group %r (%d ranks)", name, size)
    return own


def _meet(store: dist.Store, group: dist.ProcessGroup, timeout: timedelta, what: Text) -> None:
    """Return once every rank of ``group`` has come to make the transport;
    a ``PeerError`` naming the first that did not within ``timeout`` (gloo's
    own setup would fail naming a store key)."""
    rank, size = group.rank(), group.size()
    store.set(f"arrived/{rank}", "1")
    peers = [f"arrived/{peer}" for peer in range(size) if peer != rank]
    try:
        store.wait(peers, timeout)
    except RuntimeError as e:  # NB: DistStoreError is one
        missing = [peer for peer in range(size) if peer != rank and not store.check([f"arrived/{peer}"])]
        peer = missing[0] if missing else (rank + 1) % size
        cause = RuntimeError(f"it did not come to set up eagertp's own connections over the group within {timeout}")
        raise peer_error(cause, what, group, peer) from e


def own_group_name(name: str) -> str:
    """The name of eagertp's own group over the group named ``name``: what a
    dispatch mode outside eagertp's sees the ring's sends and receives on."""
    return f"{name}+eagertp"


# NB: straight to the group, as dist.isend / dist.irecv end up calling it:
# their checks (a rank of the group, a dense tensor, ...) hold here by
# construction, and cost about 40 us an op with both cores busy
# (benchmarks/NOTES.md).
def _isend(t: torch.Tensor, transport: Transport, group_dst: int, tag: int = 0) -> dist.Work:
    tensors = [torch.view_as_real(t) if t.is_complex() else t]
    with transport.lock:
        return transport.target.send(tensors, group_dst, tag)


def _irecv(t: torch.Tensor, transport: Transport, group_src: int, tag: int = 0) -> dist.Work:
    tensors = [torch.view_as_real(t) if t.is_complex() else t]
    with transport.lock:
        return transport.target.recv(tensors, group_src, tag)


def _post(
    ops: list[tuple[Callable, torch.Tensor, int]], group: dist.ProcessGroup, transport: Transport
) -> list[dist.Work]:
    """Post ``(_isend or _irecv, tensor, peer)`` in order: one Work each on
    CPU (gloo), one ``batch_isend_irecv`` on ``group`` elsewhere, which NCCL
    coalesces."""
    if not ops or ops[0][1].is_cpu:
        return [post(t, transport, peer) for post, t, peer in ops]
    p2p = {_isend: dist.isend, _irecv: dist.irecv}
    return dist.batch_isend_irecv([dist.P2POp(p2p[post], t, group=group, group_peer=peer) for post, t, peer in ops])
