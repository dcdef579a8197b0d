"""The oracle: the plain collective, then the consumer on every chunk."""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagertp.backends.base import ChunkConsumer, check_gather_buffers


class ReferenceBackend:
    """Unfused all-gather followed by the consumer, exactly as plain eager runs it.

    This is what ``verify=True`` compares against and what a user picks with
    ``backend="reference"`` to rule out the micro-pipeline while debugging.
    """

    name = "reference"

    def all_gather_consume(
        self,
        shard: torch.Tensor,
        consumer: ChunkConsumer | None,
        ag_out: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> None:
        check_gather_buffers(shard, ag_out, group)
        dist.all_gather_into_tensor(ag_out, shard, group=group)
        if consumer is None:
            return
        for src, chunk in enumerate(ag_out.view(group.size(), *shard.shape)):
            consumer(chunk, src)
