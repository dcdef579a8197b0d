"""CUDA symmetric memory: gathers pulled from the peers' buffers on a
communication stream, and torch's micro-pipelined reduce-scatter.

An all-gather starts where the program issues it and its consumers bind later
(``Backend.start_all_gather`` -> ``GatherHandle.consume``). At the start, this
rank's shard goes into the group's symmetric workspace and every peer's shard is
pulled from that peer's buffer into ``ag_out``, chunk by chunk, all on the
group's communication stream, which compute never waits for as a whole; ``consume``
enqueues the consumers on the current stream, each behind its chunk's event
(Note [Gathers in flight on the comm stream]). This replaces::

    _pipelined_all_gather_and_consume(shard, shard_consumer, ag_out, group_name)

which wants its consumer at the call, and runs its even steps' copies and its
closing barrier on the current stream: called at the program point, it would
hold the compute stream on the other ranks' progress.

The reduce-scatter is torch's, with eagertp's producer, at its program point::

    _pipelined_produce_and_all2all(chunk_producer, output, group_name)

It gathers every rank's contribution to this rank's chunk (all-to-all of
produced chunks) and reduces locally, as torch's
``_fused_matmul_reduce_scatter_impl`` does: W chunk-sized buffers instead of the
ring's 3.

Both use torch private API that may move between releases: ``unavailable_reason``
detects it (and CUDA) and says why this backend cannot serve a collective, and
probes each group's workspace once, so that ``backend="auto"`` falls back to the
ring with that reason and ``backend="symm_mem"`` raises it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import socket
import tempfile

import torch
import torch.distributed as dist

from eagertp._format import group_str, tensor_str
from eagertp.backends.base import (
    ALL_ROWS,
    ChunkConsumer,
    ChunkProducer,
    GatherHandle,
    ShardProducer,
    check_gather_buffers,
    check_scatter_buffers,
    produce_then_gather,
    reduce_scatter_then_gather,
    whole_rows,
)

# What this backend uses of torch.distributed._symmetric_memory.
_TORCH_NAMES = ("_pipelined_produce_and_all2all", "get_symm_mem_workspace", "_group_name_to_workspace_tensor")


def _symm_mem_module():
    try:
        return importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return None


def unavailable_reason(t: torch.Tensor, group: dist.ProcessGroup) -> str | None:
    """Why the symm_mem backend cannot serve a collective on ``t`` over
    ``group``, or None. The first call for a group rendezvouses its
    symmetric-memory workspace, a collective: every rank reaches it at the same
    collective, since the answer before it depends on the device and the torch
    build only."""
    return static_reason(t) or _group_reason(group, t.device)


def static_reason(t: torch.Tensor) -> str | None:
    """What the device and the torch build say, without communicating."""
    device_type = t.device.type
    if device_type not in _static_reasons:  # NB: asked for every collective `auto` serves
        _static_reasons[device_type] = _static_reason(device_type)
    return _static_reasons[device_type]


# device type -> static_reason's answer, which the process's torch build fixes.
_static_reasons: dict[str, str | None] = {}


def _static_reason(device_type: str) -> str | None:
    if device_type != "cuda":
        return f"symmetric memory needs CUDA tensors, this collective's are on {device_type}"
    module = _symm_mem_module()
    if module is None:
        return "this torch has no torch.distributed._symmetric_memory"
    missing = [name for name in _TORCH_NAMES if not hasattr(module, name)]
    if missing:
        return f"this torch ({torch.__version__}) lacks {', '.join(missing)} in torch.distributed._symmetric_memory"
    return None


# group name -> why symmetric memory cannot serve it (None: it can), probed once.
_group_reasons: dict[str, str | None] = {}


def _group_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    name = group.group_name
    if name not in _group_reasons and torch.cuda.is_current_stream_capturing():
        # Note [Capture]: not cached, the next collective outside capture probes.
        return (
            f"the first collective on {group_str(group)} ran under CUDA graph capture, where its workspace "
            f"cannot be set up; run a step outside capture first (a warm-up, as CUDA graphs need anyway)"
        )
    if name not in _group_reasons:
        with _on(device):
            _group_reasons[name] = _probe(group, device)
    return _group_reasons[name]


# Note [Probing a group]
# Whether symmetric memory can serve a group is decided once, at its first
# collective, and every rank must decide alike: a rank on the ring and a peer
# on symm_mem would wait for each other forever (Invariant 2). torch's
# get_symm_mem_workspace allocates, then rendezvouses (a store exchange and a
# file-descriptor exchange over Unix sockets), and a rank that fails alone
# leaves its peers blocked inside that exchange. So the probe takes the steps
# one at a time, and the ranks agree after each (over the group itself, with
# its own timeout):
#
# 1. what each rank can tell alone: its host and its temporary directory
#    (where torch's sockets live); ranks that differ never rendezvous (a group
#    spanning hosts, one GPU per container with its own /tmp);
# 2. the allocation on each rank, then everyone hears whether any failed;
# 3. the rendezvous, then the same.
#
# Every rank then holds the same verdict, naming the first rank that failed
# and why. A failure inside torch's exchange on some ranks only (step 3) can
# still block the others there: that part is torch's.


def _probe(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why symmetric memory cannot serve ``group`` (None: it can), agreed by
    every rank (Note [Probing a group]); on success the group's workspace is
    set up, as ``get_symm_mem_workspace`` sets it up."""
    module = _symm_mem_module()
    facts = (socket.gethostname(), tempfile.gettempdir())
    every = _gather(facts, group)
    if any(other != facts for other in every):
        per_rank = "; ".join(f"rank {r}: host {h!r}, temp dir {t!r}" for r, (h, t) in enumerate(every))
        return f"the ranks of {group_str(group)} do not share one host and temp dir ({per_rank})"
    workspace = None
    try:
        workspace = module._SymmetricMemory.empty_strided_p2p(
            (WORKSPACE_MIN_BYTES,), [1], torch.uint8, device, group.group_name
        )
        failed = None
    except (RuntimeError, ValueError) as e:
        failed = f"allocation failed on rank {group.rank()}: {e}"
    failed = _first_failure(failed, group)
    if failed is None:
        try:
            module._SymmetricMemory.rendezvous(workspace, group.group_name)
            module._group_name_to_workspace_tensor[group.group_name] = workspace
        except (RuntimeError, ValueError) as e:  # e.g. no peer access between the devices
            failed = f"rendezvous failed on rank {group.rank()}: {e}"
        failed = _first_failure(failed, group)
    return None if failed is None else f"its workspace on {group_str(group)}: {failed}"


def _gather(value: object, group: dist.ProcessGroup) -> list:
    every: list = [None] * group.size()
    dist.all_gather_object(every, value, group=group)
    return every


def _first_failure(failed: str | None, group: dist.ProcessGroup) -> str | None:
    """The first rank's failure, as every rank hears it, or None if none failed."""
    return next((f for f in _gather(failed, group) if f is not None), None)


# Note [Gathers in flight on the comm stream]
# start_all_gather enqueues the whole transfer at the program point; consume
# (later, in any order) enqueues the consumers. On 3 ranks, as seen by rank 0
# (``own``: the shard into ag_out; ``mv``: ag_out's own chunk into this rank's
# workspace buffer; ``b``: a barrier with every rank's comm stream; ``cp i``:
# pull rank i's shard from rank i's buffer into ag_out, then record event
# ``ei``; ``mm i``: the consumer of rank i's shard; e0 matters only if consume
# runs on another stream than start):
#
#   program: start(AG) ... other work ...       consume(AG, mm)
#   current: [own]e0[ other work ]         wait e0 [mm 0] wait e1 [mm 1] wait e2 [mm 2]
#   comm:      wait current [mv][b][cp 1]e1[cp 2]e2[b]
#
# The compute stream waits only for the chunks it consumes, when it consumes
# them (their pulls follow the opening barrier, so the peers' [mv]), never for
# a closing barrier nor for a gather started later. Consumers all run on the
# current stream, in order: one that accumulates (an OrderedConsumer) needs
# nothing more.
#
# Several gathers in flight on one group queue up on its comm stream in
# program order (the same on every rank, so the barriers match), and each
# rank consumes them in its own order. On 2 ranks, as seen by rank 0, consuming B first:
#
#   program: start(A) start(B) ...     consume(B, mm)          consume(A, mm)
#   current: [own A][own B]            [mm B0] wait B1 [mm B1] [mm A0] wait A1 [mm A1]
#   comm:       [mv A][b][cp A1]A1[b][mv B][b][cp B1]B1[b]
#
# Why the workspace is safe for the next collective:
# - A gather writes its buffer ([mv]) only behind the closing barrier of the
#   collective before: an earlier gather's is earlier on the comm stream; a
#   reduce-scatter's is on the current stream, which the comm stream waits for
#   at each start. A closing barrier on rank r completes when every rank has
#   reached it, so when no peer still pulls from rank r's buffer.
# - The opening barrier [b] after [mv]: no rank pulls before every shard is in
#   its owner's buffer.
# - A reduce-scatter (torch's primitive, at its program point, on the current
#   and torch's backend streams) first makes the current stream wait for the
#   comm stream: it writes the workspace after every gather in flight has
#   closed. The compute stream then does wait for the peers: the price of one
#   workspace per group.
# - The comm stream's barriers use their own signal-pad channel
#   (_COMM_CHANNEL): consume waits for the last pull, not for the closing
#   barrier, so a later symmetric-memory op outside eagertp (torch's
#   primitives use channels 0 and 1) may barrier on the current stream while
#   the comm stream's closing barrier runs.
# - Growth: Note [Workspace growth].
_COMM_CHANNEL = 2
# torch releases after 2.13 order every built-in signal-pad op of a (group,
# device) across streams (c10d's GroupStreamGuard: a barrier on one stream
# waits for the event that ended the group's previous pad op on another, and
# its pad is shared by every allocation of the group). For the comm stream
# that is the order kept here already: each gather's start waits for the
# current stream, and the current stream waits for the comm stream before a
# reduce-scatter or a torch symm_mem op (Note [torch's symmetric-memory ops] in
# eagertp.collectives.torch_symm_mem). It adds one wait: the current stream's
# next pad op waits for the closing barrier of the gather before it, which no
# consumer waits for here. Nothing waits in a cycle, so it cannot deadlock;
# channels stay apart (torch's ops use 0 and 1).

# (group name, device) -> the stream its gathers' copies and barriers run on.
# NB: one per group, as its workspace: gathers of different groups never wait
# for each other, so two groups' collectives issued in different orders by
# ranks in both (as with separate NCCL communicators) cannot deadlock here.
_comm_streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}


def _comm_stream(group: dist.ProcessGroup, device: torch.device) -> torch.cuda.Stream:
    key = (group.group_name, device)
    stream = _comm_streams.get(key)
    if stream is None:
        stream = _comm_streams[key] = torch.cuda.Stream(device=device)
    return stream


def _wait_for_gathers(stream: torch.cuda.Stream, group: dist.ProcessGroup, device: torch.device) -> None:
    """``stream`` waits for every gather on ``group`` started so far, closing
    barriers included (Note [Gathers in flight on the comm stream])."""
    comm = _comm_streams.get((group.group_name, device))
    if comm is not None:
        stream.wait_stream(comm)


def wait_for_every_gather() -> None:
    """The current stream of each device waits for every gather eagertp has
    started there, closing barriers included: before torch's own
    symmetric-memory ops, which write a group's workspace after only their own
    barrier (Note [torch's symmetric-memory ops] in
    eagertp.collectives.torch_symm_mem)."""
    for (_, device), comm in _comm_streams.items():
        torch.cuda.current_stream(device).wait_stream(comm)


# Note [Workspace growth]
# get_symm_mem_workspace replaces a group's workspace that is too small for the
# request, and the old one is freed then. Gathers in flight may still pull from
# the peers' old buffers on this rank's comm stream, and the peers from this
# rank's. torch's allocator happens to run cudaDeviceSynchronize before it
# unmaps a buffer (AllocationRef's destructor); this backend does not rely on
# that: before a request that will grow the workspace, the host waits for the
# stream that orders every earlier use of it (the comm stream at a gather's
# start, which has just waited for the current stream; the current stream
# before a reduce-scatter, which has just waited for the comm stream). Those
# uses end with closing barriers, so the wait also covers the peers' pulls
# from this rank's buffer. Every rank grows at the same collective (sizes
# depend on shapes only). Growth happens once per larger size, and the wait
# costs what torch's own synchronize would. Under CUDA graph capture there is
# no wait: torch raises its own error (the workspace cannot grow during
# capture; its message says how to size it first).
# Each growth costs every rank a host wait, an allocation and a rendezvous (a
# store exchange, a file descriptor per peer), so the workspace starts at
# WORKSPACE_MIN_BYTES and grows at least twofold: shapes that vary from step
# to step (sequence lengths) grow it a few times, not at every new maximum.
# Set WORKSPACE_MIN_BYTES to the largest collective's bytes before the first
# collective (or before a CUDA graph capture) to never grow it.

# The workspace a group's first collective makes (bytes): Note [Workspace growth].
WORKSPACE_MIN_BYTES = 1 << 20

# Note [Capture]
# Under CUDA graph capture every stream the captured stream forks work onto
# must be joined back before the capture ends. A gather forks onto its group's
# comm stream, whose closing barrier nothing else waits for (only a later
# reduce-scatter's start would): so under capture ``consume`` makes the
# current stream wait for the comm stream once the consumers are enqueued. The
# engine consumes every gather before the block exits (or at a flush), so a
# block inside a capture leaves no fork. (Outside capture the closing barrier
# stays off the compute stream: Note [Gathers in flight on the comm stream].)
# A group's workspace cannot be set up during capture, so a probe there is not
# cached: ``auto`` serves that collective with the ring, and the next one
# outside capture probes. A graph replays on the workspace it captured: one
# replaced by growth after a capture is kept alive, never freed.

# group name -> the workspace a capture used; replaced ones, kept for replays.
_captured: dict[str, torch.Tensor] = {}
_kept_after_capture: list[torch.Tensor] = []


def _workspace(group: dist.ProcessGroup, nbytes: int, stream: torch.cuda.Stream):
    """``get_symm_mem_workspace(group, nbytes)``, grown safely and at least
    twofold (Note [Workspace growth])."""
    module = _symm_mem_module()
    held = module._group_name_to_workspace_tensor.get(group.group_name)
    held_bytes = 0 if held is None else held.numel() * held.element_size()
    if held_bytes >= nbytes:
        if torch.cuda.is_current_stream_capturing():
            _captured[group.group_name] = held
        return module.get_symm_mem_workspace(group.group_name, min_size=nbytes)
    if torch.cuda.is_current_stream_capturing():
        return module.get_symm_mem_workspace(group.group_name, min_size=nbytes)  # torch's error says what to do
    if _captured.get(group.group_name) is held:
        _kept_after_capture.append(held)  # Note [Capture]: a graph may still replay on it
    stream.synchronize()
    return module.get_symm_mem_workspace(group.group_name, min_size=max(nbytes, 2 * held_bytes, WORKSPACE_MIN_BYTES))


@dataclasses.dataclass(eq=False)
class SymmMemGather:
    """An all-gather in flight: ``ag_out`` fills as the events of ``arrivals``
    complete (Note [Gathers in flight on the comm stream])."""

    chunks: torch.Tensor  # ag_out as [W, *shard.shape]: chunks[i] is rank i's shard
    # (src, the event after which chunks[src] holds rank src's shard; None:
    # nothing moves it), in delivery order: this rank's own shard first (its
    # event on the stream that started the gather), then the peers in pull order.
    arrivals: list[tuple[int, torch.cuda.Event | None]]

    # The comm stream that moved it, joined back under CUDA graph capture (Note [Capture]).
    comm: torch.cuda.Stream | None = None

    def consume(self, consumer: ChunkConsumer | None, *, own_chunk_unread: bool = False) -> None:
        """``consumer`` on every chunk, on the current stream, each behind its event."""
        current = torch.cuda.current_stream(self.chunks.device)
        rows = whole_rows(self.chunks[0])
        for src, event in self.arrivals:
            if event is not None:
                current.wait_event(event)
            if consumer is not None:
                consumer(self.chunks[src], src, rows)
        if self.comm is not None and torch.cuda.is_current_stream_capturing():
            current.wait_stream(self.comm)  # Note [Capture]: its closing barrier joined back

    def wait_chunk(self, src: int) -> None:
        """The current stream waits for ``chunks[src]``'s event."""
        current = torch.cuda.current_stream(self.chunks.device)
        for s, event in self.arrivals:
            if s == src and event is not None:
                current.wait_event(event)

    def landed(self) -> bool | None:
        # NB: the host runs ahead of the copies on a GPU, and consumers enqueued
        # per chunk behind their events cost the host nothing: always chunked.
        return False

    def watch(self) -> None:
        pass  # always chunked (landed)

    def release_shard(self) -> None:
        pass  # copied into ag_out on the current stream when the gather started


class SymmMemBackend:
    """Gathers on a communication stream over symmetric memory; torch's
    pipelined reduce-scatter with eagertp's producers."""

    name = "symm_mem"

    def start_all_gather(self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup) -> SymmMemGather:
        """Enqueue ``ag_out = all_gather(shard, group)`` whole on the comm stream
        now; the returned handle's ``consume`` binds the consumers (Note
        [Gathers in flight on the comm stream])."""
        check_gather_buffers(shard, ag_out, group)
        with _torch_errors(f"all_gather of {tensor_str(shard)} on {group_str(group)}"), _on(shard.device):
            return _start_gather(shard, ag_out, group)

    def why_not_produce_all_gather(self, shard: torch.Tensor, group: dist.ProcessGroup) -> str | None:
        return "symm_mem gathers a shard whole: torch has no pipelined matmul + all-gather of its output"

    def produce_all_gather(
        self, producer: ShardProducer, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup
    ) -> GatherHandle:
        return produce_then_gather(self, producer, shard, ag_out, group)

    def produce_reduce_scatter(
        self,
        producer: ChunkProducer,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        reduce_op: str,
    ) -> None:
        check_scatter_buffers(out, reduce_op)
        world = group.size()
        # stacked[i]: rank i's contribution to this rank's chunk
        stacked = out.new_empty(world, *out.shape)  # NB: sizes apart: see Deferring.placeholder
        with _torch_errors(f"reduce_scatter({reduce_op}) to {tensor_str(out)} on {group_str(group)}"), _on(out.device):
            current = torch.cuda.current_stream(out.device)
            # NB: torch's primitive writes the workspace from the current stream (and
            # its backend stream, which waits for the current one): after every
            # gather in flight has closed (Note [Gathers in flight on the comm stream]).
            _wait_for_gathers(current, group, out.device)
            _workspace(group, 2 * out.numel() * out.element_size(), current)  # the size torch asks for
            _symm_mem_module()._pipelined_produce_and_all2all(
                lambda dst, buf: producer(dst, buf, ALL_ROWS),  # torch's chunking: whole chunks
                stacked.view(world * out.shape[0], *out.shape[1:]),
                group.group_name,
            )
        _REDUCE[reduce_op](stacked, out)

    def start_all_reduce(
        self, producer: ChunkProducer, out: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
    ) -> SymmMemGather:
        """torch's pipelined reduce-scatter, then the gather of the reduced rows
        enqueued on the comm stream."""
        return reduce_scatter_then_gather(self, producer, out, group, reduce_op)


def _start_gather(shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup) -> SymmMemGather:
    """Enqueue the whole gather (Note [Gathers in flight on the comm stream])."""
    world, rank = group.size(), group.rank()
    chunks = ag_out.view(world, *shard.shape)
    pull_order = [(rank + step) % world for step in range(1, world)]  # torch's order
    current = torch.cuda.current_stream(shard.device)
    chunks[rank].copy_(shard)  # the caller may overwrite shard now
    # NB: consume may run on another stream than this one (user streams, backward).
    own = _recorded_on(current)
    if world == 1 or shard.numel() == 0:
        # NB: shapes are equal on every rank, so every rank skips the workspace
        # and its barriers together.
        return SymmMemGather(chunks, [(rank, own), *((src, None) for src in pull_order)])
    comm = _comm_stream(group, shard.device)
    comm.wait_stream(current)
    # NB: written on the comm stream. Should ag_out be freed before it is
    # consumed (an exception in between), the caching allocator must not lend
    # its memory to the current stream while the pulls still write it.
    _record_stream(ag_out, comm)
    workspace = _workspace(group, shard.numel() * shard.element_size(), comm)

    def buffer(peer: int) -> torch.Tensor:  # rank peer's shard in its workspace
        return workspace.get_buffer(peer, shard.shape, shard.dtype)

    arrivals: list[tuple[int, torch.cuda.Event | None]] = [(rank, own)]
    timeout_ms = _barrier_timeout_ms(group, shard.device)
    with comm:
        buffer(rank).copy_(chunks[rank])
        workspace.barrier(channel=_COMM_CHANNEL, timeout_ms=timeout_ms)  # every shard is in its owner's buffer
        for src in pull_order:
            chunks[src].copy_(buffer(src))
            arrivals.append((src, _recorded_on(comm)))
        # No peer pulls from this rank's buffer any more.
        workspace.barrier(channel=_COMM_CHANNEL, timeout_ms=timeout_ms)
    return SymmMemGather(chunks, arrivals, comm)


# Note [Barriers time out]
# torch's signal-pad barrier waits for its peers' signals with no end unless
# given ``timeout_ms``: a peer that died, or issued another collective, hangs
# the comm stream, then the host at its next synchronize, and nothing says
# why. With a timeout, torch's device-side wait reports the rank, the peer and
# the channel that timed out, then traps: the process fails with a CUDA error
# (after a trap the device is unusable, so no PeerError can be raised as the
# ring raises one; the report is torch's). The timeout is the group's own,
# what its process group would allow the same collective before giving up.
# torch's own primitives (the reduce-scatter's barriers) pass none: their
# hangs are torch's, as in plain eager with those ops.

# group name -> its timeout in milliseconds (Note [Barriers time out]).
_timeouts_ms: dict[str, int] = {}


def _barrier_timeout_ms(group: dist.ProcessGroup, device: torch.device) -> int:
    """``group``'s timeout, in milliseconds, for its comm stream's barriers."""
    name = group.group_name
    if name not in _timeouts_ms:
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options: c10d's default
            timeout = dist.default_pg_timeout
        _timeouts_ms[name] = max(1, int(timeout.total_seconds() * 1000))
    return _timeouts_ms[name]


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` made the current CUDA device. torch allocates a group's
    workspace, and launches its barriers and signal waits, on
    ``torch.cuda.current_device()``: a program that never called
    ``torch.cuda.set_device`` would otherwise have every rank allocate on
    device 0 (its rendezvous then fails, or its barriers run on another
    device's stream). The collective's own tensors say which device is meant."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _record_stream(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """``t.record_stream(stream)``: a function of its own, which the CPU
    emulation in tests/ replaces to check what the caching allocator would."""
    if t.is_cuda:
        t.record_stream(stream)


def _recorded_on(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


@contextlib.contextmanager
def _torch_errors(what: str):
    """Name the collective in torch's errors (its text carries the fix, e.g. for
    a workspace that cannot grow during CUDA graph capture)."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"eagertp symm_mem backend, {what}: {e}") from e


def _sum(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.sum(stacked, dim=0, out=out)


def _avg(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.sum(stacked, dim=0, out=out)
    out.div_(stacked.shape[0])


def _max(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.amax(stacked, dim=0, out=out)


def _min(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.amin(stacked, dim=0, out=out)


def _product(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.prod(stacked, dim=0, out=out)


_REDUCE = {"sum": _sum, "avg": _avg, "max": _max, "min": _min, "product": _product}
