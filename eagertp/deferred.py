"""Deferred work: pending all-gathers and the matmuls that consume them.

Note [Deferral boundary]
~~~~~~~~~~~~~~~~~~~~~~~~
A pending all-gather hands the program a placeholder (``torch.empty`` of the
gathered shape) instead of data. A tensor is *pending* when its storage is the
storage of a placeholder: the placeholder itself, any view of it (views share
storage, so ``view``/``t``/``split``/``_unsafe_view`` outputs stay pending with no
bookkeeping), and the output placeholder of a deferred matmul. An op that would
read or write pending storage other than through a handler that understands it
forces a flush first, so no program ever observes an unfilled placeholder.

Pending entries are keyed by storage identity (``StorageImpl`` address). The
store holds the placeholders, so their storages stay alive and a key cannot be
reused while it is pending; a flush drops every entry.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from eagertp.trace import CollectiveRecord


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclasses.dataclass(eq=False)
class PendingMatmul:
    """``out = addmm(bias, A, B, beta=beta, alpha=alpha)`` (or ``mm(A, B)`` when
    ``bias`` is None) whose ``A`` is a row-chunked view of a pending gather."""

    op: torch._ops.OpOverload
    b: torch.Tensor  # [K, N]
    out: torch.Tensor  # placeholder [M, N]
    tid: int
    bias: torch.Tensor | None = None
    beta: float = 1
    alpha: float = 1

    def describe(self) -> str:
        return f"{self.op.__name__.split('.')[0]} -> ${self.tid}"


@dataclasses.dataclass(eq=False)
class PendingGather:
    """``out = all_gather_into_tensor(shard, group)`` not yet issued."""

    shard: torch.Tensor  # contiguous
    out: torch.Tensor  # placeholder [W * shard.shape[0], *shard.shape[1:]]
    group: dist.ProcessGroup
    tid: int
    record: CollectiveRecord
    consumers: list[PendingMatmul] = dataclasses.field(default_factory=list)

    def rows_per_rank(self, a: torch.Tensor) -> int | None:
        """Rows of rank i's chunk in ``a``, a 2-D view of ``out``, or None if the
        rows of ``a`` do not split into per-rank blocks (then it cannot fuse)."""
        if a.dim() != 2 or a.shape[1] == 0 or not a.is_contiguous():
            return None
        if a.storage_offset() != self.out.storage_offset() or a.numel() != self.out.numel():
            return None
        shard_numel = self.shard.numel()
        if shard_numel == 0 or shard_numel % a.shape[1]:
            return None
        return shard_numel // a.shape[1]


class PendingStore:
    """Pending gathers in record order, and which storages they own."""

    def __init__(self) -> None:
        self.gathers: list[PendingGather] = []
        self._owner: dict[int, PendingGather] = {}  # placeholder storage -> gather
        self._inputs: set[int] = set()  # storages that pending work will read
        self._ids = itertools.count()

    def __bool__(self) -> bool:
        return bool(self.gathers)

    def next_tid(self) -> int:
        return next(self._ids)

    def add_gather(self, gather: PendingGather) -> None:
        self.gathers.append(gather)
        self._owner[storage_key(gather.out)] = gather
        self._inputs.add(storage_key(gather.shard))

    def add_matmul(self, gather: PendingGather, mm: PendingMatmul) -> None:
        gather.consumers.append(mm)
        self._owner[storage_key(mm.out)] = gather
        for t in (mm.b, mm.bias):
            if t is not None:
                self._inputs.add(storage_key(t))

    def gather_output_of(self, t: torch.Tensor) -> PendingGather | None:
        """The pending gather whose placeholder ``t`` views, if any."""
        gather = self._owner.get(storage_key(t))
        if gather is not None and storage_key(gather.out) == storage_key(t):
            return gather
        return None

    def tid_of(self, t: torch.Tensor) -> int | None:
        gather = self._owner.get(storage_key(t))
        if gather is None:
            return None
        key = storage_key(t)
        if key == storage_key(gather.out):
            return gather.tid
        return next(mm.tid for mm in gather.consumers if storage_key(mm.out) == key)

    def touched(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """The first of ``tensors`` that is pending, if any."""
        return next((t for t in tensors if storage_key(t) in self._owner), None)

    def is_input(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._inputs

    def drain(self) -> list[PendingGather]:
        """Every pending gather in record order; the store forgets them all."""
        gathers, self.gathers = self.gathers, []
        self._owner.clear()
        self._inputs.clear()
        return gathers

    def reset(self) -> None:
        assert not self.gathers, "reset with pending work would lose collectives"
        self._ids = itertools.count()


def tensor_leaves(args: object) -> list[torch.Tensor]:
    return [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
