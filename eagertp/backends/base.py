"""What every backend shares: the consumer type and the buffer invariants."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn, Protocol

import torch
import torch.distributed as dist

from eagertp._format import group_str
from eagertp.trace import Text

# consumer(piece, src_rank, rows): piece is rows `rows` (a slice along the
# shard's `piece_dim`) of rank src_rank's shard, `shard_piece(shard, rows)`.
# A backend delivers each shard whole (`whole_rows`) or in pieces; the
# pieces of one shard arrive in order, as views of its chunk of ag_out, so the
# last one completes the shard there. A shard delivered whole may be any tensor
# holding it: ag_out may not hold it yet.
ChunkConsumer = Callable[[torch.Tensor, int, slice], None]


class _KindOfConsumer:
    """A consumer, called as any, whose class tells a backend what it may do
    with its calls (the subclasses below)."""

    __slots__ = ("fn",)

    def __init__(self, fn: ChunkConsumer) -> None:
        self.fn = fn

    def __call__(self, piece: torch.Tensor, src: int, rows: slice) -> None:
        self.fn(piece, src, rows)


class OrderedConsumer(_KindOfConsumer):
    """A consumer whose calls share state (it accumulates into one output), so
    each call must see the writes of the calls before it. The ring and
    symm_mem call consumers one after another on one stream (symm_mem: the
    current CUDA stream) anyway; a backend that spread them over several
    streams would have to chain this one's calls."""

    __slots__ = ()


class RowsConsumer(_KindOfConsumer):
    """A consumer whose calls each write rows of the outputs that no other
    call writes (nothing accumulates over chunks), so it may run on any
    grouping of the rows: a backend whose pieces travel as several messages
    may run it on each message as it lands (Note [Wire pieces] in
    eagertp.backends.ring); any other backend calls it as any consumer."""

    __slots__ = ()


# producer(dst_rank, buf, rows): writes into buf this rank's contribution to
# the chunk that rank dst_rank keeps after the reduce-scatter: the whole chunk
# (rows = ALL_ROWS, buf of any shape holding it), or rows `rows` of it viewed
# as [-1, its last dim] (`chunk_rows`), buf holding exactly those rows. A
# backend may produce a chunk whole or in pieces, each once.
ChunkProducer = Callable[[int, torch.Tensor, slice], None]
ALL_ROWS = slice(None)

# producer(piece, rows): writes rows `rows` (a slice along the shard's
# `piece_dim`, or ALL_ROWS) of this rank's shard of an all-gather into piece,
# the shard's own view of them, before they are sent
# (``Backend.produce_all_gather``).
ShardProducer = Callable[[torch.Tensor, slice], None]


def piece_dim(shape: Sequence[int]) -> int:
    """The dim along which a shard of ``shape`` travels in pieces, and which
    the ``rows`` of consumers and shard producers count: dim 0, or past the
    leading dims of size 1, never the last. So a batch of one sharded along the
    sequence, ``[1, S/W, D]``, splits along ``S/W`` as ``[S/W, D]`` would: the
    same bytes (the dims before it are 1), and its pieces are runs of whole
    rows, contiguous in the shard and in every view of the gathered tensor."""
    d = 0
    while d < len(shape) - 2 and shape[d] == 1:
        d += 1
    return d


def whole_rows(shard: torch.Tensor) -> slice:
    """The ``rows`` of a whole shard (or of any chunk shaped like it)."""
    return slice(0, shard.shape[piece_dim(shard.shape)]) if shard.dim() else slice(0, 1)


def shard_piece(shard: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of ``shard`` (or of a chunk shaped like it), a view."""
    if not shard.dim():
        return shard
    return shard.narrow(piece_dim(shard.shape), rows.start, rows.stop - rows.start)


def chunk_rows(chunk: torch.Tensor) -> torch.Tensor:
    """A contiguous chunk as the rows a producer's pieces count: [-1, last dim]."""
    return chunk.view(-1, chunk.shape[-1]) if chunk.dim() > 1 else chunk.view(1, -1)


class GatherHandle(Protocol):
    """An all-gather in flight: ``Backend.start_all_gather`` started moving its
    data where the program issued it; ``consume`` binds its consumer later.

    ``consume(consumer)`` is called exactly once per handle, on the thread that
    started it. It runs ``consumer`` on every chunk (pieces of one shard in
    order; this rank's own shard may come first), computing on chunks that have
    already landed at once and on the others as they land, and returns when
    ``ag_out`` holds every chunk (on CUDA: in the current stream's order) and
    the transfer holds nothing of the caller's any more. ``consumer`` may be
    None (the gather alone: the same messages). ``own_chunk_unread``: the
    caller knows that nothing reads this rank's chunk of ``ag_out`` once the
    consumer has run, so a backend may leave it unwritten, handing the
    consumer the shard itself (Note [This rank's chunk, unread] in
    eagertp.engine).

    Several handles of one group may be in flight at once. They are started in
    the same order on every rank (program order), but consumed in any order,
    and in different orders on different ranks: a rank that reads the second
    gather's result first must still interoperate with one that consumes the
    first gather first. So every message of a gather is posted (or enqueued)
    by ``start_all_gather``, never by ``consume``.
    """

    def consume(self, consumer: ChunkConsumer | None, *, own_chunk_unread: bool = False) -> None: ...

    def wait_chunk(self, src: int) -> None:
        """Return once rank ``src``'s chunk of ``ag_out`` holds its shard (on
        CUDA: the current stream waits for it), so that another gather's
        consumer may read those rows: a row-wise FP8 scale gathered alongside
        the data (Note [Gathered row-wise scales] in eagertp.deferred). Any
        number of calls, before ``consume``, which is still called once; a
        failed transfer raises there, not here."""
        ...

    def landed(self) -> bool | None:
        """True if every chunk is already in ``ag_out``: a consumer would find
        nothing left to overlap. Never blocks; None where the backend cannot
        tell without ``watch`` (Note [Landed gathers] in eagertp.patterns)."""
        ...

    def watch(self) -> None:
        """Work is about to run while this gather is in flight: from now on,
        keep ``landed`` able to tell, where that costs what the backend would
        not spend otherwise (the 2-rank ring on gloo: a thread that waits for
        the receives). Any number of calls, before ``consume``."""
        ...

    def release_shard(self) -> None:
        """Return once the transfer reads nothing of ``shard`` any more (on
        CUDA: in the current stream's order), so that the caller may
        overwrite it; the gather stays in flight. Any number of calls, before
        ``consume`` (Note [Sends from the shard] in eagertp.engine)."""
        ...


class Backend(Protocol):
    """The contract every backend implements (see eagertp.backends)."""

    name: str

    def start_all_gather(self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup) -> GatherHandle:
        """Start ``ag_out = all_gather(shard, group)`` (gather dim 0) now. The
        backend may read ``shard`` until the handle's ``release_shard`` or
        ``consume`` returns (the ring sends from it); ``ag_out`` belongs to the
        backend until the handle is consumed."""
        ...

    def why_not_produce_all_gather(self, shard: torch.Tensor, group: dist.ProcessGroup) -> str | None:
        """Why ``produce_all_gather`` could not overlap making ``shard`` with
        sending it, if it could not (then the caller makes it first). Reads
        shapes, devices and the group only."""
        ...

    def produce_all_gather(
        self, producer: ShardProducer, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup
    ) -> GatherHandle:
        """``start_all_gather`` of a shard that ``producer`` makes, piece by
        piece, each piece sent as soon as it is made: the messages are those of
        ``start_all_gather(shard, ...)`` (Invariant 2). On return ``shard``
        holds every piece."""
        ...

    def produce_reduce_scatter(
        self, producer: ChunkProducer, out: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
    ) -> None:
        """The whole reduce-scatter, at the program point, blocking. Gathers of
        the same group may be in flight (started earlier, consumed later): the
        backend orders its use of anything they share (symm_mem's workspace)
        after them."""
        ...

    def start_all_reduce(
        self, producer: ChunkProducer, out: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
    ) -> GatherHandle:
        """Start ``out = all_reduce(product)``, the product made by ``producer``
        (chunk c: rows ``c*m:(c+1)*m`` of ``out``): on return this rank's chunk
        of ``out`` holds its reduced rows; the handle is the gather of every
        rank's reduced rows into ``out``, in flight. ``reduce_scatter_then_gather``
        is the plain composition of the two calls above."""
        ...


def all_gather_consume(
    backend: Backend,
    shard: torch.Tensor,
    consumer: ChunkConsumer | None,
    ag_out: torch.Tensor,
    group: dist.ProcessGroup,
) -> None:
    """Start an all-gather and consume it at once: the whole collective, blocking."""
    backend.start_all_gather(shard, ag_out, group).consume(consumer)


def reduce_scatter_then_gather(
    backend: Backend, producer: ChunkProducer, out: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
) -> GatherHandle:
    """``Backend.start_all_reduce`` as its two halves: the reduce-scatter into
    this rank's rows of ``out``, then the gather of those rows started."""
    m = out.shape[0] // group.size()
    shard = out[group.rank() * m : (group.rank() + 1) * m]
    backend.produce_reduce_scatter(producer, shard, group, reduce_op)
    return backend.start_all_gather(shard, out, group)


def produce_then_gather(
    backend: Backend, producer: ShardProducer, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup
) -> GatherHandle:
    """``Backend.produce_all_gather`` for a backend that sends a shard whole:
    the shard made, then its gather started (nothing overlaps)."""
    producer(shard, ALL_ROWS)
    return backend.start_all_gather(shard, ag_out, group)


def consume_in_order(consumer: ChunkConsumer | None, chunks: torch.Tensor) -> None:
    """Run ``consumer`` on every rank's whole chunk, rank order (all present)."""
    if consumer is not None:
        for src, chunk in enumerate(chunks):
            consumer(chunk, src, whole_rows(chunk))


def check_gather_buffers(shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Internal invariants every backend relies on (the mode guarantees them)."""
    assert shard.is_contiguous() and ag_out.is_contiguous(), (
        f"all_gather_consume needs contiguous buffers, got strides {shard.stride()} "
        f"and {ag_out.stride()}"
    )
    assert ag_out.shape[0] == shard.shape[0] * group.size() and (
        ag_out.shape[1:] == shard.shape[1:]
    ), f"ag_out {tuple(ag_out.shape)} is not shard {tuple(shard.shape)} gathered over {group.size()} ranks"


def check_scatter_buffers(out: torch.Tensor, reduce_op: str) -> None:
    assert out.is_contiguous(), f"produce_reduce_scatter needs a contiguous out, got strides {out.stride()}"
    assert reduce_op in REDUCE_OPS, f"reduce_op {reduce_op!r} is not one of {sorted(REDUCE_OPS)}"


# funcol's reduce_op names -> c10d's. "avg" is reduced as a sum and divided at the
# end, so it needs no backend support beyond SUM.
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


# Note [Waiting on a peer]
# ------------------------
# Every wait of the ring is on one peer's point-to-point transfer. On gloo,
# ``Work.wait()`` of an ``isend``/``irecv`` is bounded by the process group's
# timeout (``new_group(timeout=...)``; measured on torch 2.13: a peer that
# never issues its side raises "Timed out waiting ...ms for recv operation"
# after that long, and a peer that died raises "Connection closed by peer" at
# once), so eagertp passes no timeout of its own. On NCCL, ``wait()`` only
# orders the current stream; the group's watchdog bounds the transfer. What
# eagertp adds is the error: gloo's names neither the collective nor the peer,
# so every post and wait re-raises its failure as a ``PeerError``
# (``peer_error``) naming the collective, the group, the peer and the fix.


class PeerError(RuntimeError):
    """A transfer eagertp waited on failed or timed out: a peer died, or stopped
    issuing the collectives this rank issued."""


def peer_error(e: RuntimeError, what: Text, group: dist.ProcessGroup, peer: int) -> PeerError:
    """The ``PeerError`` to raise for ``e``, a failed post or wait of a transfer
    with ``peer`` (its rank in ``group``; gloo: the group's timeout, or a
    closed connection), naming ``what`` (the collective and its shapes), the
    group and the peer; raised ``from e`` in an ``except RuntimeError`` around
    the post or wait alone (``wait_for_peer``).

    NB: a try block, not a context manager: every post and wait of the ring
    has one, and a try costs nothing until it raises."""
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return PeerError(
        f"eagertp: {what} on {group_str(group)}: rank {group.rank()} waited for rank {peer} "
        f"({_global_rank(group, peer)}) and the transfer failed: {cause}. A peer died or "
        f"stopped issuing collectives: every rank must issue the same collectives in the "
        f"same order; see rank {peer}'s own error first."
    )


def wait_for_peer(work: dist.Work, what: Text, group: dist.ProcessGroup, peer: int) -> None:
    """``work.wait()``, its failure a ``PeerError``: Note [Waiting on a peer]."""
    try:
        work.wait()
    except RuntimeError as e:
        raise peer_error(e, what, group, peer) from e


# Note [Failures handed between threads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A helper thread (the ring's forwarder, a gather's watcher) keeps its failure
# for the consuming thread to raise. An exception kept by an object must hold
# no frames: its traceback's frames hold that object (``self``) and, through
# ``f_back``, every caller's locals, a reference cycle that keeps the block's
# pending work and tensors until Python's garbage collector runs (Note [Freed
# without the garbage collector] in eagertp.deferred). So the thread keeps it
# with its frames written into a note (``kept_from_thread``), and every
# consuming thread raises a copy (``raise_kept``), whose traceback is that
# thread's own and which nothing keeps.


def kept_from_thread(e: BaseException) -> BaseException:
    """``e``, raised on a helper thread, to keep for ``raise_kept``: Note
    [Failures handed between threads]."""
    if hasattr(e, "add_note"):  # NB: Python >= 3.11; on 3.10 the thread's frames are dropped unsaid
        e.add_note("raised on eagertp's helper thread:\n" + "".join(traceback.format_tb(e.__traceback__)).rstrip())
    chained: BaseException | None = e
    while chained is not None and chained.__traceback__ is not None:  # NB: gloo's error, the cause, holds them too
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__
    return e


def raise_kept(e: BaseException) -> NoReturn:
    """Raise a failure ``kept_from_thread`` kept, as a copy (with its cause and
    notes): Note [Failures handed between threads]."""
    try:
        raised = copy.copy(e)
    except Exception:  # noqa: BLE001 - an exception type that does not copy: raised itself
        raised = e
    try:
        raise raised from e.__cause__
    finally:
        raised = e = None  # NB: its traceback holds this frame


def _global_rank(group: dist.ProcessGroup, peer: int) -> str:
    try:
        return f"global rank {dist.get_global_rank(group, peer)}"
    except (ValueError, RuntimeError):  # a group torch.distributed does not know
        return "global rank unknown"
