"""torch's symmetric-memory code, run for real by CPU worker processes.

``_pipelined_all_gather_and_consume``, ``_pipelined_produce_and_all2all`` and
``get_symm_mem_workspace`` are Python. What they need from CUDA is small:

- ``_SymmetricMemory`` (C++): ``empty_strided_p2p`` allocates a rank's buffer,
  ``rendezvous`` maps every peer's, and the handle offers ``rank``,
  ``world_size``, ``get_buffer(peer, ...)`` (a view of *the peer's* memory,
  read and written over NVLink) and ``barrier(channel)``;
- streams (``current_stream``, the backend stream, events, ``_sleep``) that
  order their copies and our callbacks.

Here the buffers are files in /dev/shm that every rank of the test's gloo group
maps (so ``get_buffer(peer)`` is the peer's memory, as on NVLink), ``barrier`` is
a gloo barrier, and streams run everything at once, in issue order: a stricter
schedule than CUDA's, which overlaps the two streams. What CUDA may overlap is
checked instead: streams keep vector clocks that waits and events merge, and
inside torch's primitives every op's reads and writes are recorded, so that two
unordered accesses to the same bytes from different streams, one a write, fail
the test (a race on a GPU). Event records and waits are also logged. Everything
else is torch's own code: its
chunk order, buffer offsets, contiguity checks, workspace sizing (and the error
it raises when the workspace would have to grow during CUDA graph capture), with
eagertp's consumers and producers running inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import uuid

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


# Memory-backed where Linux has it; any directory works (mmap keeps it coherent).
_SHARED_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Handle:
    """What ``_SymmetricMemory.rendezvous`` returns: every rank's buffer."""

    def __init__(self, buffers: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        self._buffers = buffers
        self._group = group
        self.rank = group.rank()
        self.world_size = group.size()

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        flat = self._buffers[rank].view(dtype)
        numel = math.prod(sizes)
        if storage_offset + numel > flat.numel():
            raise RuntimeError(
                f"get_buffer: {numel} elements at offset {storage_offset} exceed the "
                f"{flat.numel()}-element buffer"
            )
        return flat[storage_offset : storage_offset + numel].view(sizes)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        # A signal-pad barrier on CUDA, no c10d op: hidden from the tests' op counters.
        with _disable_current_modes():
            dist.barrier(group=self._group)


class _SharedMemorySymmetricMemory:
    """Stands in for ``torch._C._distributed_c10d._SymmetricMemory``."""

    def __init__(self) -> None:
        self._allocations: dict[int, tuple[str, str]] = {}  # data_ptr -> (path, group name)
        self._handles: dict[int, _Handle] = {}  # data_ptr -> its rendezvous, as torch caches it

    def empty_strided_p2p(self, size, stride, dtype, device, group_name, alloc_id=None) -> torch.Tensor:
        assert list(stride) == [1] and dtype == torch.uint8, "torch's workspace is a flat byte buffer"
        path = os.path.join(_SHARED_DIR, f"eagertp-test-symm-mem-{uuid.uuid4().hex}")
        nbytes = -(-size[0] // 64) * 64  # rounded up: every dtype's view of it stays whole
        buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
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
        handle = self._handles[tensor.data_ptr()] = _Handle(buffers, group)
        return handle


class _InOrderStream:
    """A CUDA stream whose ops run at once, in issue order. What CUDA would let
    overlap is tracked instead: each stream keeps a vector clock that its ops
    advance and that ``wait_stream`` / ``wait_event`` merge, so
    ``EmulatedStreams`` can tell whether two ops on different streams are
    ordered. ``with stream:`` makes it the current stream."""

    def __init__(self, name: str, streams: EmulatedStreams) -> None:
        self.name = name
        self._streams = streams
        self.clock: dict[str, int] = {}

    def wait_stream(self, other: _InOrderStream) -> None:
        self._merge(other.clock)

    def wait_event(self, event: _Event) -> None:
        self._streams.log.append(f"{self.name} waits e{event.id}")
        self._merge(event.clock)

    def _merge(self, clock: dict[str, int]) -> None:
        for name, tick in clock.items():
            self.clock[name] = max(self.clock.get(name, 0), tick)

    def __enter__(self) -> _InOrderStream:
        self._streams.stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._streams.stack.pop()


class _Event:
    def __init__(self, streams: EmulatedStreams) -> None:
        self._streams = streams
        self.id = streams.events
        self.clock: dict[str, int] = {}
        streams.events += 1

    def record(self, stream: _InOrderStream | None = None) -> None:
        stream = stream or self._streams.current()
        self._streams.log.append(f"{stream.name} records e{self.id}")
        self.clock = dict(stream.clock)


@dataclasses.dataclass
class _Access:
    stream: _InOrderStream
    tick: int  # the stream's clock at the access
    write: bool
    offsets: frozenset[int]  # the bytes of the storage it touched
    op: str
    # NB: held, so that a temporary freed on one stream cannot lend its address
    # to one made on the other (the CPU allocator would; CUDA's keeps blocks per stream).
    storage: torch.UntypedStorage


class EmulatedStreams:
    """torch's current and backend streams, a log of event records and waits,
    and a race check: inside torch's primitives every op's reads and writes
    (bytes of storage) are recorded with its stream's clock, and two accesses
    to the same bytes from different streams, one a write, with neither
    ordered before the other, raise ``AssertionError`` naming both ops."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.events = 0
        self.stack: list[_InOrderStream] = []
        self.default = _InOrderStream("current", self)
        self.backend = _InOrderStream("backend", self)
        self._accesses: dict[int, list[_Access]] = {}  # storage -> accesses

    def current(self, device=None) -> _InOrderStream:
        return self.stack[-1] if self.stack else self.default

    def event(self, **kwargs) -> _Event:
        return _Event(self)

    def checked(self, primitive):
        """``primitive`` with its ops race-checked."""

        def run(*args, **kwargs):
            self._accesses.clear()  # NB: torch starts each with backend.wait_stream(current)
            with _RaceCheck(self):
                primitive(*args, **kwargs)
            assert self.default.clock.get("backend", 0) >= self.backend.clock.get("backend", 0), (
                f"{primitive.__name__} returned before the current stream waited for the backend stream"
            )

        return run

    def access(self, op: str, t: torch.Tensor, write: bool) -> None:
        stream = self.current()
        stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
        storage = t.untyped_storage()
        new = _Access(stream, stream.clock[stream.name], write, _bytes_of(t), op, storage)
        history = self._accesses.setdefault(storage.data_ptr(), [])
        for old in history:
            ordered = old.stream is stream or old.tick <= stream.clock.get(old.stream.name, 0)
            if not ordered and (old.write or write) and old.offsets & new.offsets:
                raise AssertionError(
                    f"stream race: {op} {'writes' if write else 'reads'} on the {stream.name} stream "
                    f"bytes that {old.op} {'wrote' if old.write else 'read'} on the {old.stream.name} "
                    f"stream, with no wait between them"
                )
        history.append(new)


def _bytes_of(t: torch.Tensor) -> frozenset[int]:
    """The bytes of its storage that ``t`` (any strides) covers."""
    if t.numel() == 0:
        return frozenset()
    size = t.element_size()
    elements = torch.as_strided(
        torch.arange(t.untyped_storage().nbytes() // size), t.shape, t.stride(), t.storage_offset()
    )
    return frozenset((elements.reshape(-1, 1) * size + torch.arange(size)).flatten().tolist())


class _RaceCheck(TorchDispatchMode):
    """Records every op's tensor reads and writes (the arguments its schema
    marks mutable) on the current emulated stream; views access nothing."""

    def __init__(self, streams: EmulatedStreams) -> None:
        super().__init__()
        self._streams = streams

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            for arg, value in _schema_values(func, args, kwargs):
                write = arg.alias_info is not None and arg.alias_info.is_write
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(t, torch.Tensor):
                        self._streams.access(str(func), t, write)
        return out


def _schema_values(func, args, kwargs):
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


@contextlib.contextmanager
def emulated_symm_mem():
    """Inside: the symm_mem backend accepts CPU tensors and torch's primitives
    run over shared memory, race-checked; yields the ``EmulatedStreams``.
    Whatever a test patches on the objects below (say,
    ``torch.cuda.is_current_stream_capturing``) is restored on exit."""
    import torch.distributed._symmetric_memory as symm_mem

    from eagertp.backends import symm_mem as backend

    streams = EmulatedStreams()
    allocator = _SharedMemorySymmetricMemory()
    patches = [
        (symm_mem, "_SymmetricMemory", allocator),
        (symm_mem, "_group_name_to_workspace_tensor", {}),
        (symm_mem, "_get_backend_stream", lambda priority=0: streams.backend),
        *(
            (symm_mem, name, streams.checked(getattr(symm_mem, name)))
            for name in ("_pipelined_all_gather_and_consume", "_pipelined_produce_and_all2all")
        ),
        (torch.cuda, "current_stream", streams.current),
        (torch.cuda, "Event", streams.event),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "is_current_stream_capturing", lambda: False),
        (torch.cuda, "_sleep", lambda cycles: None),
        (backend, "static_reason", lambda t: None),  # CPU tensors welcome, here only
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    backend._group_reasons.clear()
    try:
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
