"""Backends: one contract, several implementations.

A backend moves the data of one deferred collective and calls the pattern's
consumer on each rank's chunk as it becomes available::

    all_gather_consume(shard, consumer, ag_out, group)

        ag_out = all_gather(shard, group)              # gather dim 0, into ag_out
        for src, chunk in enumerate(ag_out.chunk(group.size())):
            consumer(chunk, src)                       # in whatever order chunks land

``consumer`` may be ``None`` (materialise the gather alone). Invariant 2 of the
design: the messages a backend exchanges depend only on ``shard``, ``ag_out``
and ``group``, never on ``consumer``, so a rank that materialises a gather
alone interoperates with a peer that fuses it.

The reduce-scatter direction (``produce_reduce_scatter(producer, out, group,
reduce_op)``, where the producer computes the chunk bound for each rank) joins
this contract with matmul + reduce-scatter fusion.
"""

from __future__ import annotations

from eagertp.backends.base import ChunkConsumer
from eagertp.backends.reference import ReferenceBackend
from eagertp.backends.ring import RingBackend

__all__ = ["BACKENDS", "Backend", "ChunkConsumer", "resolve_backend"]

Backend = RingBackend | ReferenceBackend

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
