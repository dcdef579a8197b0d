"""Deferred work: pending all-gathers and matmuls.

Note [Deferral boundary]
~~~~~~~~~~~~~~~~~~~~~~~~
A pending all-gather hands the program a placeholder (``torch.empty`` of the
gathered shape) instead of data; a pending matmul hands it a placeholder for its
output. A tensor is *pending* when its storage is a placeholder's storage: the
placeholder itself, and any view of it (views share storage, so
``view``/``t``/``split``/``_unsafe_view`` outputs stay pending with no
bookkeeping). An op that would read or write pending storage other than through
a handler that understands it forces a flush first, so no program ever observes
an unfilled placeholder.

Pending entries are keyed by storage identity (``StorageImpl`` address). The
store holds the placeholders, so their storages stay alive and a key cannot be
reused while it is pending; a flush drops every entry.

Note [Matmul operands of a gather]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Let ``G = ag.view(W*r, C)`` be the gathered tensor seen as rows, ``r`` rows per
rank, so rank ``i``'s chunk is ``G[i*r:(i+1)*r]``. A matmul can meet ``G`` in
three ways, and each splits into per-chunk work that can start as soon as that
chunk has arrived::

    ROWS     mm(G, B)      out[i*r:(i+1)*r]  = G_i @ B             (forward; dgrad)
    ROWS_T   mm(G.t(), H)  out              += G_i.t() @ H[i*r:..]  (wgrad: contraction
    B_ROWS   mm(H, G)      out              += H[:, i*r:..] @ G_i    over the gathered rows)

ROWS writes disjoint rows, so it equals plain eager bitwise whenever the
per-row products do. The accumulating forms add ``W`` partial products, in
chunk arrival order: exact on integer-valued inputs, and within the tolerance
of a chunked reduction otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from eagertp._format import tensor_str
from eagertp.trace import CollectiveRecord


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Operand(enum.Enum):
    """How a matmul reads a pending gather (Note [Matmul operands of a gather])."""

    ROWS = "A"
    ROWS_T = "A.t()"
    B_ROWS = "B"


@dataclasses.dataclass(eq=False)
class PendingMatmul:
    """``out = addmm(bias, a, b, beta=beta, alpha=alpha)``, or ``mm(a, b)`` when
    ``bias`` is None, not yet computed.

    For a consumer of a pending gather, ``operand`` says where the gather enters
    and that operand (``a`` or ``b``) is None; a standalone matmul has both.
    """

    op: torch._ops.OpOverload
    a: torch.Tensor | None
    b: torch.Tensor | None
    out: torch.Tensor  # placeholder [M, N]
    tid: int
    bias: torch.Tensor | None = None
    beta: float = 1
    alpha: float = 1
    operand: Operand | None = None

    @property
    def name(self) -> str:
        return self.op.__name__.split(".")[0]

    def describe(self) -> str:
        via = "" if self.operand in (None, Operand.ROWS) else f" (gathered {self.operand.value})"
        return f"{self.name}{via} -> ${self.tid}"

    def render(self, gather_tid: int | None = None) -> str:
        """``$3: f32[8, 6] = addmm(f32[6], $0, f32[16, 6])`` for the trace."""
        g = f"${gather_tid}"
        a = g if self.a is None else tensor_str(self.a)
        b = g if self.b is None else tensor_str(self.b)
        if self.operand is Operand.ROWS_T:
            a = f"{g}.t()"
        operands = f"{a}, {b}" if self.bias is None else f"{tensor_str(self.bias)}, {a}, {b}"
        return f"${self.tid}: {tensor_str(self.out)} = {self.name}({operands})"

    def compute(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """Plain eager on whole operands, into ``out``."""
        if self.bias is None:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(self.bias, a, b, beta=self.beta, alpha=self.alpha, out=out)

    def inputs(self) -> list[torch.Tensor]:
        return [t for t in (self.a, self.b, self.bias) if t is not None]


@dataclasses.dataclass(eq=False)
class PendingGather:
    """``out = all_gather_into_tensor(shard, group)`` not yet issued."""

    shard: torch.Tensor  # contiguous
    out: torch.Tensor  # placeholder [W * shard.shape[0], *shard.shape[1:]]
    group: dist.ProcessGroup
    tid: int
    record: CollectiveRecord
    consumers: list[PendingMatmul] = dataclasses.field(default_factory=list)

    def rows_per_rank(self, g: torch.Tensor) -> int | None:
        """Rows of rank i's chunk in ``g``, a 2-D row-major view of ``out``, or
        None if the rows of ``g`` do not split into per-rank blocks."""
        if g.dim() != 2 or g.shape[1] == 0 or not g.is_contiguous():
            return None
        if g.storage_offset() != self.out.storage_offset() or g.numel() != self.out.numel():
            return None
        shard_numel = self.shard.numel()
        if shard_numel == 0 or shard_numel % g.shape[1]:
            return None
        return shard_numel // g.shape[1]


Pending = PendingGather | PendingMatmul


class PendingStore:
    """Pending work in record order, and which storages it owns and reads."""

    def __init__(self) -> None:
        self.items: list[Pending] = []  # gathers and standalone matmuls
        self._owner: dict[int, Pending] = {}  # placeholder storage -> item
        self._inputs: set[int] = set()  # storages that pending work will read
        self._ids = itertools.count()

    def __bool__(self) -> bool:
        return bool(self.items)

    def next_tid(self) -> int:
        return next(self._ids)

    def add_gather(self, gather: PendingGather) -> None:
        self.items.append(gather)
        self._owner[storage_key(gather.out)] = gather
        self._inputs.add(storage_key(gather.shard))

    def add_matmul(self, mm: PendingMatmul, gather: PendingGather | None = None) -> None:
        """A consumer of ``gather``, or a standalone matmul when it is None."""
        if gather is None:
            self.items.append(mm)
        else:
            gather.consumers.append(mm)
        self._owner[storage_key(mm.out)] = gather or mm
        self._inputs.update(storage_key(t) for t in mm.inputs())

    def remove(self, mm: PendingMatmul) -> None:
        """Take a standalone matmul out: its consumer issues it (fused)."""
        self.items.remove(mm)
        del self._owner[storage_key(mm.out)]

    def gather_output_of(self, t: torch.Tensor) -> PendingGather | None:
        """The pending gather whose placeholder ``t`` views, if any."""
        item = self._owner.get(storage_key(t))
        if isinstance(item, PendingGather) and storage_key(item.out) == storage_key(t):
            return item
        return None

    def matmul_output_of(self, t: torch.Tensor) -> PendingMatmul | None:
        """The standalone pending matmul whose whole output ``t`` is, if any."""
        item = self._owner.get(storage_key(t))
        if (
            isinstance(item, PendingMatmul)
            and t.is_contiguous()
            and t.storage_offset() == item.out.storage_offset()
            and t.numel() == item.out.numel()
        ):
            return item
        return None

    def tid_of(self, t: torch.Tensor) -> int:
        key = storage_key(t)
        item = self._owner[key]
        candidates = [item] + (item.consumers if isinstance(item, PendingGather) else [])
        return next(c.tid for c in candidates if storage_key(c.out) == key)

    def touched(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """The first of ``tensors`` that is pending, if any."""
        return next((t for t in tensors if storage_key(t) in self._owner), None)

    def is_input(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._inputs

    def drain(self) -> list[Pending]:
        """Every pending item in record order; the store forgets them all."""
        items, self.items = self.items, []
        self._owner.clear()
        self._inputs.clear()
        return items

    def reset(self) -> None:
        assert not self.items, "reset with pending work would lose collectives"
        self._ids = itertools.count()


def tensor_leaves(args: object) -> list[torch.Tensor]:
    return [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
