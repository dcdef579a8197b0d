"""The oracle: the plain collective, then the consumer on every chunk."""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagertp._compat import all_gather_single, reduce_scatter_single
from eagertp.backends.base import (
    ALL_ROWS,
    REDUCE_OPS,
    ChunkConsumer,
    ChunkProducer,
    GatherHandle,
    ShardProducer,
    check_gather_buffers,
    check_scatter_buffers,
    consume_in_order,
    produce_then_gather,
    reduce_scatter_then_gather,
)


class ReferenceBackend:
    """The plain collective and the whole matmul, exactly as plain eager runs them.

    This is what ``verify=True`` compares against and what a user picks with
    ``backend="reference"`` to rule out the micro-pipeline while debugging.
    """

    name = "reference"

    def start_all_gather(self, shard: torch.Tensor, ag_out: torch.Tensor, group: dist.ProcessGroup) -> _AsyncGather:
        check_gather_buffers(shard, ag_out, group)
        # NB: as plain eager's async collective reads its input: from a copy, so
        # that the caller may overwrite shard at once.
        work = all_gather_single(ag_out, shard.clone(), group=group, async_op=True)
        return _AsyncGather(work, ag_out.view(group.size(), *shard.shape))

    def why_not_produce_all_gather(self, shard: torch.Tensor, group: dist.ProcessGroup) -> str | None:
        return "the reference backend gathers a shard whole, as plain eager does"

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
        full = out.new_empty((world * out.shape[0], *out.shape[1:]))
        for dst, chunk in enumerate(full.view(world, *out.shape)):
            producer(dst, chunk, ALL_ROWS)
        reduce_scatter_single(out, full, op=REDUCE_OPS[reduce_op], group=group)
        if reduce_op == "avg":
            out.div_(world)

    def start_all_reduce(
        self, producer: ChunkProducer, out: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
    ) -> _AsyncGather:
        return reduce_scatter_then_gather(self, producer, out, group, reduce_op)


class _AsyncGather:
    """The plain async collective in flight; the consumer runs once it is complete."""

    def __init__(self, work: dist.Work, chunks: torch.Tensor) -> None:
        self._work, self._chunks = work, chunks
        self._waited = False

    def consume(self, consumer: ChunkConsumer | None, *, own_chunk_unread: bool = False) -> None:
        self._wait()
        consume_in_order(consumer, self._chunks)

    def wait_chunk(self, src: int) -> None:
        self._wait()  # one collective: every chunk at once

    def _wait(self) -> None:
        if not self._waited:
            self._work.wait()
            self._waited = True

    def landed(self) -> bool | None:
        return self._work.is_completed()

    def watch(self) -> None:
        pass  # a collective's Work tells without being waited for

    def release_shard(self) -> None:
        pass  # the collective reads a copy
