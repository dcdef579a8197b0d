"""What every backend shares: the consumer type and the buffer invariants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

# consumer(piece, src_rank, rows): piece is rows `rows` (a slice along dim 0) of
# rank src_rank's shard. A backend delivers each shard whole or in pieces; the
# pieces of one shard arrive in order, as views of its chunk of ag_out, so the
# last one completes the shard there. A shard delivered whole may be any tensor
# holding it: ag_out may not hold it yet (symm_mem copies this rank's own shard
# into ag_out last).
ChunkConsumer = Callable[[torch.Tensor, int, slice], None]


class OrderedConsumer:
    """A consumer whose calls share state (it accumulates into one output), so
    each call must see the writes of the calls before it. The ring calls
    consumers one after another on one stream anyway; symm_mem, which runs
    them on two CUDA streams, chains this one's calls with events."""

    __slots__ = ("fn",)

    def __init__(self, fn: ChunkConsumer) -> None:
        self.fn = fn

    def __call__(self, piece: torch.Tensor, src: int, rows: slice) -> None:
        self.fn(piece, src, rows)


# producer(dst_rank, buf): writes into buf this rank's contribution to the chunk
# that rank dst_rank keeps after the reduce-scatter.
ChunkProducer = Callable[[int, torch.Tensor], None]


class Backend(Protocol):
    """The contract every backend implements (see eagertp.backends)."""

    name: str

    def all_gather_consume(
        self, shard: torch.Tensor, consumer: ChunkConsumer | None, ag_out: torch.Tensor, group: dist.ProcessGroup
    ) -> None: ...

    def produce_reduce_scatter(
        self, producer: ChunkProducer, out: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
    ) -> None: ...


def consume_in_order(consumer: ChunkConsumer | None, chunks: torch.Tensor) -> None:
    """Run ``consumer`` on every rank's whole chunk, rank order (all present)."""
    if consumer is not None:
        for src, chunk in enumerate(chunks):
            consumer(chunk, src, slice(0, chunk.shape[0]))


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
