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
            producer(dst, buf[dst])
        out = reduce(buf[rank] over all ranks)       # sum, avg, max, min, product

``consumer`` may be ``None`` (the gather alone). Invariant 2 of the design: the
messages a backend exchanges depend only on the buffers' shapes, ``reduce_op``
and the group, never on the consumer or producer, so a rank that issues a
collective alone interoperates with a peer that fuses it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagertp.backends.base import Backend, ChunkConsumer, ChunkProducer
from eagertp.backends.reference import ReferenceBackend
from eagertp.backends.ring import RingBackend
from eagertp.backends import symm_mem
from eagertp.backends.symm_mem import SymmMemBackend

__all__ = ["BACKENDS", "Backend", "BackendChoice", "ChunkConsumer", "ChunkProducer"]

BACKENDS: dict[str, type[Backend]] = {
    "ring": RingBackend,
    "reference": ReferenceBackend,
    "symm_mem": SymmMemBackend,
}


class BackendChoice:
    """``EagerMicroPipeline(backend=name)``: which backend serves each collective.

    ``"auto"`` picks ``symm_mem`` for CUDA tensors where torch's symmetric-memory
    primitives exist, and ``ring`` otherwise (every process group: gloo on CPU,
    NCCL). The choice depends on the device and the torch build only, so every
    rank makes the same one (Invariant 2).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"EagerMicroPipeline(backend=...) takes a backend name, got "
                f"{type(name).__name__}; valid names: {_valid_names()}"
            )
        if name != "auto" and name not in BACKENDS:
            raise ValueError(f"EagerMicroPipeline: unknown backend {name!r}; valid names: {_valid_names()}")
        self.name = name
        self._instances = {key: cls() for key, cls in BACKENDS.items()}

    def for_collective(self, t: torch.Tensor, group: dist.ProcessGroup) -> tuple[Backend, str | None]:
        """The backend for a collective on ``t`` over ``group``, and a note for
        ``explain()`` when ``auto`` could not use symmetric memory on CUDA."""
        if self.name == "auto":
            why_not = symm_mem.unavailable_reason(t, group)
            if why_not is None:
                return self._instances["symm_mem"], None
            # Say why only where symmetric memory was a candidate (not for CPU tensors).
            candidate = t.is_cuda or symm_mem.static_reason(t) is None
            return self._instances["ring"], (f"symm_mem unavailable: {why_not}" if candidate else None)
        if self.name == "symm_mem":
            why_not = symm_mem.unavailable_reason(t, group)
            if why_not is not None:
                raise ValueError(
                    f"EagerMicroPipeline(backend='symm_mem') cannot serve this collective: {why_not}. "
                    f"Use backend='ring' (any process group) or backend='auto' (symm_mem where it works)."
                )
        return self._instances[self.name], None


def _valid_names() -> str:
    return ", ".join(repr(n) for n in ["auto", *BACKENDS])
