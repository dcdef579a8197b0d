"""torch's symmetric-memory code, run for real by CPU worker processes.

``get_symm_mem_workspace`` and ``_pipelined_produce_and_all2all`` are Python,
and so is eagertp's symm_mem backend. What they need from CUDA is small:

- ``_SymmetricMemory`` (C++): ``empty_strided_p2p`` allocates a rank's buffer,
  ``rendezvous`` maps every peer's, and the handle offers ``rank``,
  ``world_size``, ``get_buffer(peer, ...)`` (a view of *the peer's* memory,
  read and written over NVLink) and ``barrier(channel)``;
- streams (``current_stream``, torch's backend stream, the streams code creates
  such as eagertp's comm streams, events, ``synchronize``, ``_sleep``) that
  order their copies and our callbacks.

Here the buffers are files in /dev/shm that every rank of the test's gloo group
maps (so ``get_buffer(peer)`` is the peer's memory, as on NVLink), ``barrier``
exchanges where each rank is (channel, barrier number on it, workspace size)
over gloo and fails every rank where they differ, as CUDA's signal waits would
hang, and streams run everything at once, in issue order: a stricter
schedule than CUDA's, which overlaps streams (so a gather started on the comm
stream has landed when its start returns). What CUDA may overlap is checked
instead (``EmulatedStreams``): from entry to exit of ``emulated_symm_mem``,
every op's reads and writes are recorded with its stream's vector clock, and
two unordered accesses to the same bytes from different streams, one a write,
fail the test (a race on a GPU), across any number of gathers in flight and
reduce-scatters in between; so does memory the program frees while another
stream than its own may still use it, unrecorded (Note [Freed on one stream,
used on another]). Stream waits, event records and waits, barriers,
record_stream and host waits are also logged. Everything else is the real code: eagertp's
gathers, and torch's reduce-scatter (its chunk order, buffer offsets,
contiguity checks) and workspace sizing (and the error it raises when the
workspace would have to grow during CUDA graph capture), with eagertp's
consumers and producers running inside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import tempfile
import uuid

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


# Memory-backed where Linux has it; any directory works (mmap keeps it coherent).
_SHARED_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Handle:
    """What ``_SymmetricMemory.rendezvous`` returns: every rank's buffer."""

    def __init__(self, buffers: list[torch.Tensor], group: dist.ProcessGroup, streams: EmulatedStreams) -> None:
        self._buffers = buffers
        self._group = group
        self._streams = streams
        self.rank = group.rank()
        self.world_size = group.size()
        with _disable_current_modes():
            self._signal_pad = torch.zeros(64, dtype=torch.uint8)  # a byte per channel
        self._barriers: dict[int, int] = {}  # channel -> barriers this rank has reached on it

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        raw = self._buffers[rank]
        flat = raw[: raw.numel() - raw.numel() % dtype.itemsize].view(dtype)
        numel = math.prod(sizes)
        if storage_offset + numel > flat.numel():
            raise RuntimeError(
                f"get_buffer: {numel} elements at offset {storage_offset} exceed the "
                f"{flat.numel()}-element buffer"
            )
        return flat[storage_offset : storage_offset + numel].view(sizes)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        """A signal-pad barrier on CUDA, no c10d op: hidden from the tests' op
        counters. On CUDA each rank signals every peer on its channel of this
        allocation's signal pad and waits for theirs: ranks on different
        channels, at different barriers of one channel, or on different
        workspaces never match, and wait forever (or until ``timeout_ms``, then
        trap). Here every rank compares what it is at, and all fail at once."""
        with _disable_current_modes():
            self._barriers[channel] = self._barriers.get(channel, 0) + 1
            at = torch.tensor([channel, self._barriers[channel], self._buffers[self.rank].numel()])
            every = [torch.empty_like(at) for _ in range(self.world_size)]
            dist.all_gather(every, at, group=self._group)
            if any(not torch.equal(other, at) for other in every):
                per_rank = "; ".join(f"rank {r}: {t.tolist()}" for r, t in enumerate(every))
                raise RuntimeError(
                    f"emulated symmetric memory: ranks meet at different barriers (channel, barrier number on "
                    f"it, workspace bytes): {per_rank}. On CUDA their signal waits would never match: a hang"
                    + (f", then a trap after {timeout_ms} ms" if timeout_ms else " with no end (no timeout_ms)")
                )
            self._streams.barrier(self._signal_pad[channel : channel + 1], channel, timeout_ms)


class _SharedMemorySymmetricMemory:
    """Stands in for ``torch._C._distributed_c10d._SymmetricMemory``.
    ``workspaces`` is torch's group name -> workspace table, which the
    emulation gives torch: a workspace replaced by a bigger one is freed, and
    must then be unused by every stream (``EmulatedStreams.check_unused``)."""

    def __init__(self, streams: EmulatedStreams, workspaces: dict[str, torch.Tensor | None]) -> None:
        self._streams = streams
        self._workspaces = workspaces
        self._allocations: dict[int, tuple[str, str]] = {}  # data_ptr -> (path, group name)
        self._handles: dict[int, _Handle] = {}  # data_ptr -> its rendezvous, as torch caches it

    def empty_strided_p2p(self, size, stride, dtype, device, group_name, alloc_id=None) -> torch.Tensor:
        assert list(stride) == [1] and dtype == torch.uint8, "torch's workspace is a flat byte buffer"
        replaced = self._workspaces.get(group_name)
        if replaced is not None:  # torch drops it as soon as this returns
            self._streams.check_unused(replaced, f"the workspace of group {group_name!r}")
        path = os.path.join(_SHARED_DIR, f"eagertp-test-symm-mem-{uuid.uuid4().hex}")
        with _disable_current_modes():
            # NB: exactly the size asked for, as torch's tensor is (whatever the
            # allocation's granularity): what decides when a workspace grows.
            buffer = torch.from_file(path, shared=True, size=size[0], dtype=torch.uint8)
        self._allocations[buffer.data_ptr()] = (path, group_name)
        return buffer

    def rendezvous(self, tensor: torch.Tensor, group_name: str | None = None) -> _Handle:
        if tensor.data_ptr() in self._handles:  # torch asks again on every call
            return self._handles[tensor.data_ptr()]
        path, allocated_for = self._allocations.pop(tensor.data_ptr())
        group = dist.distributed_c10d._resolve_process_group(group_name or allocated_for)
        paths: list[str | None] = [None] * group.size()
        with _disable_current_modes():
            dist.all_gather_object(paths, path, group=group)
            buffers = [
                tensor if peer == group.rank() else torch.from_file(p, shared=True, size=tensor.numel(), dtype=torch.uint8)
                for peer, p in enumerate(paths)
            ]
            dist.barrier(group=group)  # every peer has mapped this rank's file
        os.unlink(path)
        for peer, mapped in enumerate(buffers):
            if peer != group.rank():
                self._streams.mirror(mapped, tensor)
        handle = self._handles[tensor.data_ptr()] = _Handle(buffers, group, self._streams)
        return handle


class _InOrderStream:
    """A CUDA stream whose ops run at once, in issue order. What CUDA would let
    overlap is tracked instead: each stream keeps a vector clock that its ops
    advance and that ``wait_stream`` / ``wait_event`` / barriers merge, so
    ``EmulatedStreams`` can tell whether two ops on different streams are
    ordered. ``with stream:`` makes it the current stream."""

    def __init__(self, name: str, streams: EmulatedStreams) -> None:
        self.name = name
        self._streams = streams
        self.clock: dict[str, int] = {}

    def wait_stream(self, other: _InOrderStream) -> None:
        self._streams.log.append(f"{self.name} waits {other.name}")
        self.merge(other.clock)

    def wait_event(self, event: _Event) -> None:
        self._streams.log.append(f"{self.name} waits e{event.id}")
        self.merge(event.clock)

    def synchronize(self) -> None:
        """The host waits for this stream: every op issued later, on any
        stream, comes after its work."""
        self._streams.log.append(f"host waits {self.name}")
        _merge(self._streams.host, self.clock)

    def merge(self, clock: dict[str, int]) -> None:
        _merge(self.clock, clock)

    def tick(self) -> int:
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        return self.clock[self.name]

    def __enter__(self) -> _InOrderStream:
        self._streams.stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._streams.stack.pop()


def _merge(into: dict[str, int], clock: dict[str, int]) -> None:
    for name, tick in clock.items():
        into[name] = max(into.get(name, 0), tick)


class _Event:
    def __init__(self, streams: EmulatedStreams) -> None:
        self._streams = streams
        self.id = streams.events
        self.clock: dict[str, int] = {}  # never recorded: waiting for it waits for nothing, as on CUDA
        streams.events += 1

    def record(self, stream: _InOrderStream | None = None) -> None:
        stream = stream or self._streams.current()
        self._streams.log.append(f"{stream.name} records e{self.id}")
        self.clock = dict(stream.clock)


@dataclasses.dataclass(frozen=True)
class _Bytes:
    """Bytes of a storage: every one in [lo, hi), or only ``scattered`` (any strides)."""

    lo: int
    hi: int
    scattered: frozenset[int] | None = None

    def overlaps(self, other: _Bytes) -> bool:
        if self.hi <= other.lo or other.hi <= self.lo:
            return False
        if self.scattered is None and other.scattered is None:
            return True
        some, span = (self, other) if self.scattered is not None else (other, self)
        if span.scattered is None:
            return any(span.lo <= b < span.hi for b in some.scattered)
        return not some.scattered.isdisjoint(span.scattered)

    def covers(self, other: _Bytes) -> bool:
        if other.lo < self.lo or other.hi > self.hi:
            return False
        if self.scattered is None:
            return True
        return set(range(other.lo, other.hi) if other.scattered is None else other.scattered) <= self.scattered


@dataclasses.dataclass
class _Access:
    stream: _InOrderStream
    tick: int  # the stream's clock at the access
    write: bool
    bytes: _Bytes
    op: str
    # NB: held, so that a temporary freed on one stream cannot lend its address
    # to one made on another (the CPU allocator would; CUDA's keeps blocks per stream).
    storage: torch.UntypedStorage


# Note [Freed on one stream, used on another]
# CUDA's caching allocator keeps a block with the stream it was allocated on,
# and lends a freed block to the next allocation on that stream at once: safe
# for that stream's own work (in order), a race for any other stream that
# still reads or writes it, unless that stream's work was ordered before the
# allocating stream's (a wait), or ``record_stream`` named the other stream
# (then the allocator waits for an event on it before reuse). Here every op's
# new output storage is taken as allocated on the current stream; at the next
# allocation, each storage the program has freed since (only this table still
# holds it) is checked: every access from another stream must be ordered
# before the allocating stream, waited for by the host, or recorded. CPU's
# allocator would reuse the address at once, so a storage stays held until
# that check, then its accesses are forgotten.


class EmulatedStreams:
    """torch's current and backend streams, the streams code creates, a log
    of stream and event waits, event records, barriers and host waits, and a
    race check: every op's reads and writes (bytes of storage) are recorded with
    its stream's clock, and two accesses to the same bytes from different
    streams, one a write, with neither ordered before the other, raise
    ``AssertionError`` naming both ops.

    Peers' accesses to this rank's symmetric buffers happen in other processes;
    they are checked here by symmetry (Note [Peers, mirrored])."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.events = 0
        self.stack: list[_InOrderStream] = []
        self.default = _InOrderStream("current", self)
        self.backend = _InOrderStream("backend", self)
        self._created: list[_InOrderStream] = []
        self._peers: dict[str, _InOrderStream] = {}  # stream name -> the peers' same stream
        self.host: dict[str, int] = {}  # what the host has waited for, per stream
        self._accesses: dict[int, list[_Access]] = {}  # storage -> accesses
        # Note [Freed on one stream, used on another]: storage -> itself (held:
        # its address is not reused while tracked) and the stream it was
        # allocated on; storage -> the streams record_stream named for it.
        self._allocated: dict[int, tuple[torch.UntypedStorage, _InOrderStream]] = {}
        self._recorded: dict[int, set[str]] = {}
        self._mirrors: dict[int, torch.Tensor] = {}  # a peer's buffer, mapped here -> this rank's

    def current(self, device=None) -> _InOrderStream:
        return self.stack[-1] if self.stack else self.default

    def event(self, **kwargs) -> _Event:
        return _Event(self)

    def new_stream(self, device=None, priority: int = 0, **kwargs) -> _InOrderStream:
        """``torch.cuda.Stream(...)``: the first is named ``comm`` (eagertp's,
        made at the first gather), later ones ``stream2``, ``stream3``, ..."""
        stream = _InOrderStream("comm" if not self._created else f"stream{len(self._created) + 1}", self)
        self._created.append(stream)
        return stream

    def synchronize(self, device=None) -> None:
        """``torch.cuda.synchronize()``: the host waits for every stream.

        NB: it never blocks here, and needs not to: what a stream owes that
        another rank must provide is a barrier, and an emulated barrier
        blocks the host where it is issued until every peer reaches it (or
        the group's timeout). A program whose synchronize would wait forever
        on CUDA (a peer that never reaches the barrier, or reaches it only
        after this host does more) stops at that barrier here, earlier."""
        for stream in (self.default, self.backend, *self._created):
            stream.synchronize()

    # CUDA graph capture: ``torch.cuda.is_current_stream_capturing`` answers
    # ``capturing``. On CUDA, work that a captured stream forks onto another
    # stream (a wait_stream or an event) must be joined back into the capture
    # stream before the capture ends, or it fails with
    # cudaErrorStreamCaptureUnjoined; end_capture checks the same.
    capturing = False

    def begin_capture(self) -> None:
        self.capturing = True
        self._capture_origin = self.current()
        self._ticks_at_capture = {s.name: s.clock.get(s.name, 0) for s in (self.backend, *self._created)}

    def end_capture(self) -> None:
        self.capturing = False
        origin = self._capture_origin
        for stream in (self.backend, *self._created):
            ticked = stream.clock.get(stream.name, 0) > self._ticks_at_capture.get(stream.name, 0)
            if ticked and origin.clock.get(stream.name, 0) < stream.clock[stream.name]:
                raise AssertionError(
                    f"unjoined fork: work on the {stream.name} stream during capture is not joined back into the "
                    f"{origin.name} stream before the capture ends (cudaErrorStreamCaptureUnjoined on CUDA)"
                )

    def joined(self, primitive):
        """``primitive``, checked to return with the current stream past the backend stream's work."""

        def run(*args, **kwargs):
            primitive(*args, **kwargs)
            assert self.default.clock.get("backend", 0) >= self.backend.clock.get("backend", 0), (
                f"{primitive.__name__} returned before the current stream waited for the backend stream"
            )

        return run

    # Note [Peers, mirrored]
    # A symmetric collective runs the same schedule on every rank: where this
    # rank reads bytes X of peer p's buffer on stream S, some peer reads bytes X
    # of this rank's buffer on its own stream S, at the same point of it. So an
    # access to a peer's buffer is recorded as the same access to this rank's
    # buffer on the pseudo-stream "peers' S", and a barrier on S orders both
    # ways: S's work before it comes before the peers' S work after it, and
    # the peers' S work before it before S's work after it. Ordered then means
    # ordered across ranks: a write to this rank's buffer that a peer may
    # still read (no closing barrier, or a stream that never waited for it) is
    # a race here, as on the GPUs.

    def mirror(self, peer_buffer: torch.Tensor, own_buffer: torch.Tensor) -> None:
        self._mirrors[peer_buffer.untyped_storage().data_ptr()] = own_buffer

    def _peers_of(self, stream: _InOrderStream) -> _InOrderStream:
        if stream.name not in self._peers:
            self._peers[stream.name] = _InOrderStream(f"peers' {stream.name}", self)
        return self._peers[stream.name]

    def barrier(self, pad_byte: torch.Tensor, channel: int, timeout_ms: int = 0) -> None:
        """A barrier on the current stream: it writes its channel's signal pad
        (two unordered barriers on one channel race: on CUDA they would take
        each other's signals), then syncs with the peers' same stream. The log
        says its timeout, where it has one."""
        stream = self.current()
        self.log.append(f"{stream.name} barrier {channel}" + (f" timeout {timeout_ms} ms" if timeout_ms else ""))
        self.access(f"barrier(channel={channel})", pad_byte, write=True)
        peers = self._peers_of(stream)
        stream.merge(peers.clock)
        peers.merge(stream.clock)

    def access(self, op: str, t: torch.Tensor, write: bool) -> None:
        span = _bytes_of(t)
        if span is None:
            return
        storage = t.untyped_storage()
        own = self._mirrors.get(storage.data_ptr())
        if own is None:
            self._record(self.current(), op, storage, span, write)
        else:  # Note [Peers, mirrored]
            self._record(self._peers_of(self.current()), f"{op} (by a peer)", own.untyped_storage(), span, write)

    def _record(self, stream: _InOrderStream, op: str, storage: torch.UntypedStorage, span: _Bytes, write: bool) -> None:
        new = _Access(stream, stream.tick(), write, span, op, storage)
        history = self._accesses.setdefault(storage.data_ptr(), [])
        kept = []
        for old in history:
            if not self._ordered(old, stream) and (old.write or write) and old.bytes.overlaps(span):
                raise AssertionError(
                    f"stream race: {op} {'writes' if write else 'reads'} on the {stream.name} stream "
                    f"bytes that {old.op} {'wrote' if old.write else 'read'} on the {old.stream.name} "
                    f"stream, with no wait between them"
                )
            # NB: an older access of this stream that the new one covers (and is no
            # weaker than: a write covers a read) races with whatever it would race with.
            if not (old.stream is stream and span.covers(old.bytes) and (write or not old.write)):
                kept.append(old)
        kept.append(new)
        self._accesses[storage.data_ptr()] = kept

    def _ordered(self, old: _Access, stream: _InOrderStream) -> bool:
        """Whether ``old`` comes before the next op on ``stream``."""
        name = old.stream.name
        return old.stream is stream or old.tick <= max(stream.clock.get(name, 0), self.host.get(name, 0))

    def record_stream(self, t: torch.Tensor, stream: _InOrderStream) -> None:
        """``t.record_stream(stream)``: the caching allocator will not reuse
        ``t``'s memory, once freed, before ``stream``'s work so far is done."""
        self.log.append(f"record_stream on {stream.name}")
        self._recorded.setdefault(t.untyped_storage().data_ptr(), set()).add(stream.name)

    def allocated(self, t: torch.Tensor) -> None:
        """An op's output ``t``: if its storage is new, it was allocated on the
        current stream, after the program freed whatever it freed so far
        (Note [Freed on one stream, used on another])."""
        storage = t.untyped_storage()
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # a tensor without data of its own (a wrapper subclass's inner view)
            return
        if ptr in self._allocated or ptr in self._accesses:
            return
        self._check_freed()
        self._allocated[ptr] = (storage, self.current())

    def _check_freed(self) -> None:
        for ptr in {*self._allocated, *self._accesses}:
            history = self._accesses.get(ptr, [])
            storage = self._allocated[ptr][0] if ptr in self._allocated else history[0].storage
            # NB: one reference is this table's and the accesses' (one Python object)
            if torch._C._storage_Use_Count(storage._cdata) > 1:
                continue
            _, on = self._allocated.pop(ptr, (None, self.default))  # made before the emulation: the program's
            recorded = self._recorded.pop(ptr, set())
            self._accesses.pop(ptr, None)
            for old in history:
                name = old.stream.name
                if old.stream is on or name in recorded or old.tick <= max(on.clock.get(name, 0), self.host.get(name, 0)):
                    continue
                raise AssertionError(
                    f"freed while in use: the program freed memory allocated on the {on.name} stream that "
                    f"{old.op} on the {name} stream may still {'write' if old.write else 'read'}, with no "
                    f"wait on the {on.name} stream and no record_stream({name}): CUDA's caching allocator "
                    f"may hand it to the next allocation on the {on.name} stream"
                )

    def check_unused(self, t: torch.Tensor, what: str) -> None:
        """``t`` is about to be freed: every access to it (the peers' too) must
        be one the host has waited for."""
        for old in self._accesses.get(t.untyped_storage().data_ptr(), []):
            if old.tick > self.host.get(old.stream.name, 0):
                raise AssertionError(
                    f"{what} is freed while {old.op} on the {old.stream.name} stream may still "
                    f"{'write' if old.write else 'read'} it: the host never waited for that stream"
                )


def _bytes_of(t: torch.Tensor) -> _Bytes | None:
    """The bytes of its storage that ``t`` covers (None: none)."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    lo = t.storage_offset() * size
    # NB: dims of size 1 or stride 0 (expanded) add no bytes.
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1 and st != 0)
    if _dense(dims):
        return _Bytes(lo, lo + math.prod(sz for _, sz in dims) * size)
    with _disable_current_modes():
        elements = torch.as_strided(
            torch.arange(t.untyped_storage().nbytes() // size), t.shape, t.stride(), t.storage_offset()
        )
        scattered = frozenset((elements.reshape(-1, 1) * size + torch.arange(size)).flatten().tolist())
    return _Bytes(min(scattered), max(scattered) + 1, scattered)


def _dense(dims: list[tuple[int, int]]) -> bool:
    """Whether the (stride, size) ``dims``, sorted, fill a block of storage."""
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class _RaceCheck(TorchDispatchMode):
    """Records every op's tensor reads and writes (the arguments its schema
    marks mutable) on the current emulated stream; views access nothing.
    DTensor and funcol's AsyncCollectiveTensor desugar first (into the plain
    tensors they hold); other subclasses (the FakeTensor of DTensor's sharding
    propagation) hold no data and pass through; only CPU tensors hold data."""

    def __init__(self, streams: EmulatedStreams) -> None:
        super().__init__()
        self._streams = streams

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, _DESUGAR_FIRST) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and not issubclass(t, torch.nn.Parameter) for t in types):
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                self._streams.allocated(t)
        for i, name, write in _arguments(func):
            value = args[i] if i < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                    self._streams.access(str(func), t, write)
        return out


_DESUGAR_FIRST = (DTensor, AsyncCollectiveTensor)


# Ops that read none of their tensor arguments' data (on CUDA, no kernel reads
# them): funcol's wrappers around a collective's result, and factories that
# take only a tensor's metadata.
_READ_NOTHING = frozenset({
    "_c10d_functional::_wrap_tensor_autograd", "_c10d_functional::wait_tensor",
    "aten::new_empty", "aten::new_empty_strided", "aten::new_zeros", "aten::new_ones", "aten::new_full",
    "aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like",
})


@functools.cache
def _arguments(func) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, written?) of the arguments ``func`` accesses: none for
    a view (it aliases its input, reading nothing)."""
    schema = func._schema
    if func.name() in _READ_NOTHING or any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return ()
    return tuple(
        (i, arg.name, arg.alias_info is not None and arg.alias_info.is_write) for i, arg in enumerate(schema.arguments)
    )


@contextlib.contextmanager
def emulated_symm_mem():
    """Inside: the symm_mem backend accepts CPU tensors, symmetric memory
    lives in shared memory, and every op is race-checked; yields the
    ``EmulatedStreams``. Whatever a test patches on the objects below (say,
    ``torch.cuda.is_current_stream_capturing``) is restored on exit."""
    import torch.distributed._symmetric_memory as symm_mem

    from eagertp.backends import symm_mem as backend

    streams = EmulatedStreams()
    workspaces: dict[str, torch.Tensor | None] = {}
    allocator = _SharedMemorySymmetricMemory(streams, workspaces)
    patches = [
        (symm_mem, "_SymmetricMemory", allocator),
        (symm_mem, "_group_name_to_workspace_tensor", workspaces),
        (symm_mem, "_get_backend_stream", lambda priority=0: streams.backend),
        *(
            (symm_mem, name, streams.joined(getattr(symm_mem, name)))
            for name in ("_pipelined_all_gather_and_consume", "_pipelined_produce_and_all2all")
        ),
        (torch.cuda, "current_stream", streams.current),
        (torch.cuda, "Stream", streams.new_stream),
        (torch.cuda, "Event", streams.event),
        (torch.cuda, "synchronize", streams.synchronize),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "is_current_stream_capturing", lambda: streams.capturing),
        (torch.cuda, "_sleep", lambda cycles: None),
        (backend, "static_reason", lambda t: None),  # CPU tensors welcome, here only
        (backend, "_record_stream", streams.record_stream),
        (backend, "_comm_streams", {}),  # emulated streams, gone on exit
        (backend, "WORKSPACE_MIN_BYTES", backend.WORKSPACE_MIN_BYTES),  # a test may change it
        (backend, "_captured", {}),
        (backend, "_kept_after_capture", []),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    backend._group_reasons.clear()
    try:
        with _RaceCheck(streams):
            yield streams
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        backend._group_reasons.clear()
        for path, _ in allocator._allocations.values():  # allocated, never rendezvoused
            os.unlink(path)


def with_cpu_symm_mem(rank, group, worker, *args):
    """A pool job: ``worker(rank, group, *args)`` with symmetric memory emulated."""
    with emulated_symm_mem():
        return worker(rank, group, *args)


# Tests that run on both: the ring moves the data with point-to-point messages,
# symm_mem (emulated) through shared buffers, with no c10d op at all.
BOTH_BACKENDS = ["ring", "symm_mem"]


def run_on(backend: str, pool, worker, world: int, *args, **kwargs):
    """``pool.run(worker, world, *args, **kwargs)``; for "symm_mem", with
    symmetric memory emulated, which the workers' ``EagerMicroPipeline()``
    (backend "auto") picks."""
    if backend == "symm_mem":
        return pool.run(with_cpu_symm_mem, world, worker, *args, **kwargs)
    return pool.run(worker, world, *args, **kwargs)


def assert_moved_by(backend: str, report: dict) -> None:
    """The fused collectives' data moved by ``backend`` (a ``fusion_report``)."""
    if backend == "ring":
        assert report["p2p_ops"] > 0, report
    else:
        assert report["p2p_ops"] == 0, report
