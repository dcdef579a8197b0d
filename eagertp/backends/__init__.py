"""Backends: one contract, several implementations.

A backend moves the data of one collective and calls the pattern's per-chunk
callable as the chunks become available. Gathering, with a *consumer* of each
rank's chunk::

    all_gather_consume(shard, consumer, ag_out, group)

        ag_out = all_gather(shard, group)              # gather dim 0, into ag_out
        for src, chunk in enumerate(ag_out.chunk(group.size())):
            consumer(chunk, src)                       # in whatever order chunks land

and reduce-scattering, with a *producer* of this rank's contribution to each
rank's chunk, called when the backend needs it::

    produce_reduce_scatter(producer, out, group, reduce_op)

        for dst in range(group.size()):              # in whatever order the backend needs
            producer(dst, buf[dst], rows)        # whole, or in pieces of rows
        out = reduce(buf[rank] over all ranks)       # sum, avg, max, min, product

and all-reducing, with such a producer, is both, the gather half left in
flight (a handle like ``start_all_gather``'s, consumed later)::

    handle = start_all_reduce(producer, out, group, reduce_op)

        produce_reduce_scatter(producer, out[this rank's rows], group, reduce_op)
        handle = start_all_gather(out[this rank's rows], out, group)

and gathering a shard that a *producer* makes, each piece sent as soon as
it is made (the ring; the others make the shard, then send it)::

    handle = produce_all_gather(producer, shard, ag_out, group)

        for rows in the pieces the shard travels in (along its piece_dim):
            producer(shard_piece(shard, rows), rows)
            send shard_piece(shard, rows)
        handle = the gather of ag_out in flight, as start_all_gather's

``consumer`` may be ``None`` (the gather alone). Calls to one consumer may
overlap where a backend runs them on several CUDA streams (none does: symm_mem
runs them on the current stream, each behind its chunk's event), unless it is
an ``OrderedConsumer`` (it accumulates: each call must see the writes of the
calls before it). A ``RowsConsumer`` (each call writes rows of its own) may
be run on any grouping of a shard's rows: the 2-rank ring runs it on each
message of a piece it had to wait for (Note [Wire pieces]). Invariant 2 of
the design: the messages a backend exchanges depend only on the buffers'
shapes, ``reduce_op`` and the group, never on the consumer or producer, so a
rank that issues a collective alone interoperates with a peer that fuses it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from eagertp._format import bytes_str
from eagertp.backends.base import Backend, ChunkConsumer, ChunkProducer, OrderedConsumer, RowsConsumer, ShardProducer
from eagertp.backends.reference import ReferenceBackend
from eagertp.backends.ring import RingBackend
from eagertp.backends import symm_mem
from eagertp.backends.symm_mem import SymmMemBackend
from eagertp.trace import Lazy

__all__ = [
    "BACKENDS", "MIN_FUSE_BYTES", "Backend", "BackendChoice", "ChunkConsumer", "ChunkProducer", "OrderedConsumer",
    "RowsConsumer", "ShardProducer",
]

BACKENDS: dict[str, type[Backend]] = {
    "ring": RingBackend,
    "reference": ReferenceBackend,
    "symm_mem": SymmMemBackend,
}


KINDS = ("all_gather", "reduce_scatter", "all_reduce")  # the collectives eagertp fuses


# Note [Size rule]
# A collective whose per-rank buffer (the all-gather's shard, the reduce-scatter's
# output chunk, the all-reduce's reduced shard) is smaller than MIN_FUSE_BYTES[device, kind] is not deferred: the
# mode issues it exactly as the program did, at once, and records why (matmuls
# that could only feed such a reduce-scatter are not deferred either: Note
# [Deferral boundary]). A pipelined call pays fixed costs (a point-to-point
# message per step each way, a Python callback per chunk, W smaller matmuls,
# deferral itself: ~0.5 ms in all on CPU) that overlap cannot win back on a
# small transfer. The CPU values are the measured crossovers over gloo, on
# plain and on rate-limited loopback (benchmarks/NOTES.md, "Size rule"); the
# reduce-scatter's is lower because the ring's single message per step beats
# gloo's own reduce-scatter. The rule sees the collective's shape only, never
# its matmuls (Invariant 2: a rank that issues a gather alone and a peer that
# fuses it must pick the same transport). CUDA is not measured yet: there
# torch's fused ops are used at every size, as Inductor's pass does.
# An all-reduce's per-rank buffer is its reduced shard (input bytes / W), as
# for the reduce-scatter it starts with. Its CPU value is the 2gbit link's
# crossover (benchmarks/NOTES.md, "hand schedules"): from 1 MiB the fused form
# is 1.25-1.46x unfused eager, at 512 KiB anywhere from 0.91x to 1.22x between
# runs. On plain loopback with 2 ranks on 2 cores, where every transfer is a
# CPU copy competing with the matmuls, `calibrate_min_fuse_bytes` finds no
# gain below 8 MiB: calibrate there (or set the value) if that is your link.
MIN_FUSE_BYTES: dict[tuple[str, str], int] = {
    ("cpu", "all_gather"): 1 << 20,
    ("cpu", "reduce_scatter"): 512 << 10,
    ("cpu", "all_reduce"): 1 << 20,
    ("cuda", "all_gather"): 0,
    ("cuda", "reduce_scatter"): 0,
    ("cuda", "all_reduce"): 0,
}


class BackendChoice:
    """``EagerMicroPipeline(backend=name, min_fuse_bytes=...)``: which backend
    serves each collective.

    ``"auto"`` picks ``symm_mem`` for CUDA tensors where torch's symmetric-memory
    primitives exist, and ``ring`` otherwise (every process group: gloo on CPU,
    NCCL). Collectives under the size rule (Note [Size rule]) are issued plain.
    The choice depends on the device, the torch build and the collective's
    shape only, so every rank makes the same one (Invariant 2).
    """

    def __init__(self, name: str, min_fuse_bytes: int | Mapping[str, int] | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"EagerMicroPipeline(backend=...) takes a backend name, got "
                f"{type(name).__name__}; valid names: {_valid_names()}"
            )
        if name != "auto" and name not in BACKENDS:
            raise ValueError(f"EagerMicroPipeline: unknown backend {name!r}; valid names: {_valid_names()}")
        self.name = name
        self.min_fuse_bytes = _checked_min_fuse_bytes(min_fuse_bytes)
        self._instances = {key: cls() for key, cls in BACKENDS.items()}

    def min_bytes(self, device_type: str, kind: str) -> int:
        """The size rule's threshold for ``kind`` collectives on ``device_type``
        (0 for the reference backend, which has no size rule)."""
        if self.name == "reference":
            return 0
        if isinstance(self.min_fuse_bytes, int):
            return self.min_fuse_bytes
        if self.min_fuse_bytes is not None and kind in self.min_fuse_bytes:
            return self.min_fuse_bytes[kind]
        return MIN_FUSE_BYTES.get((device_type, kind), 0)

    def size_rule(self, device_type: str, kind: str, nbytes: int) -> Lazy | None:
        """Why a ``kind`` collective with ``nbytes`` per rank is issued as the
        program wrote it (Note [Size rule]), or None if it may fuse."""
        threshold = self.min_bytes(device_type, kind)
        if nbytes >= threshold:
            return None
        return Lazy(_size_rule_reason, nbytes, threshold)  # Note [Formatted when read]

    def for_collective(self, t: torch.Tensor, group: dist.ProcessGroup) -> tuple[Backend, str]:
        """The backend for a collective on ``t`` over ``group``, and its label
        for ``explain()``: its name, with why ``auto`` could not use symmetric
        memory on CUDA."""
        if self.name == "auto":
            ring = self._instances["ring"]
            if not t.is_cuda and symm_mem.static_reason(t) is not None:
                return ring, ring.name  # NB: not a candidate; nothing to say (below)
            why_not = symm_mem.unavailable_reason(t, group)
            if why_not is None:
                return self._instances["symm_mem"], "symm_mem"
            # Say why only where symmetric memory was a candidate (not for CPU tensors).
            candidate = t.is_cuda or symm_mem.static_reason(t) is None
            return ring, (f"{ring.name}; symm_mem unavailable: {why_not}" if candidate else ring.name)
        if self.name == "symm_mem":
            why_not = symm_mem.unavailable_reason(t, group)
            if why_not is not None:
                raise ValueError(
                    f"EagerMicroPipeline(backend='symm_mem') cannot serve this collective: {why_not}. "
                    f"Use backend='ring' (any process group) or backend='auto' (symm_mem where it works)."
                )
        backend = self._instances[self.name]
        return backend, backend.name


def _checked_min_fuse_bytes(value: int | Mapping[str, int] | None) -> int | dict[str, int] | None:
    """``min_fuse_bytes``: None (the per-device defaults), one byte count for
    both kinds, or a byte count per kind (``Calibration.min_fuse_bytes``; a kind
    left out keeps its default)."""

    def is_count(n) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 0

    if value is None or is_count(value):
        return value
    if isinstance(value, Mapping):
        unknown = [kind for kind in value if kind not in KINDS]
        bad = {kind: n for kind, n in value.items() if kind in KINDS and not is_count(n)}
        if not unknown and not bad:
            return dict(value)
        problem = f"unknown kinds {unknown}" if unknown else f"not a byte count >= 0: {bad}"
        raise ValueError(
            f"EagerMicroPipeline(min_fuse_bytes={{...}}) takes a byte count >= 0 per kind, kinds "
            f"{list(KINDS)}; got {value!r} ({problem})"
        )
    raise ValueError(
        f"EagerMicroPipeline(min_fuse_bytes=...) takes a byte count >= 0, a dict of them per kind "
        f"({', '.join(map(repr, KINDS))}; e.g. calibrate_min_fuse_bytes(...).min_fuse_bytes) or None "
        f"(the per-device default, eagertp.backends.MIN_FUSE_BYTES), got {value!r}"
    )


def _size_rule_reason(nbytes: int, threshold: int) -> str:
    return (
        f"size rule: {bytes_str(nbytes)} per rank < min_fuse_bytes {bytes_str(threshold)}, "
        f"too small for overlap to pay; EagerMicroPipeline(min_fuse_bytes=...) changes it"
    )


def _valid_names() -> str:
    return ", ".join(repr(n) for n in ["auto", *BACKENDS])
