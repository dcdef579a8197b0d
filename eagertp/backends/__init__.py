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

from eagertp.backends.base import Backend, ChunkConsumer, ChunkProducer
from eagertp.backends.reference import ReferenceBackend
from eagertp.backends.ring import RingBackend

__all__ = ["BACKENDS", "Backend", "ChunkConsumer", "ChunkProducer", "resolve_backend"]

BACKENDS: dict[str, type[Backend]] = {
    "ring": RingBackend,
    "reference": ReferenceBackend,
}


def resolve_backend(name: str) -> Backend:
    """The backend for ``EagerMicroPipeline(backend=name)``.

    ``"auto"`` is ``ring``: it runs on every process group (gloo on CPU, NCCL).
    """
    if not isinstance(name, str):
        raise TypeError(
            f"EagerMicroPipeline(backend=...) takes a backend name, got "
            f"{type(name).__name__}; valid names: {_valid_names()}"
        )
    if name == "auto":
        name = "ring"
    if name not in BACKENDS:
        raise ValueError(
            f"EagerMicroPipeline: unknown backend {name!r}; valid names: {_valid_names()}"
        )
    return BACKENDS[name]()


def _valid_names() -> str:
    return ", ".join(repr(n) for n in ["auto", *BACKENDS])
