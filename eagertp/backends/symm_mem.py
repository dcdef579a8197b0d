"""CUDA symmetric memory: torch's own micro-pipelined primitives, on the fly.

The primitives Inductor's micro-pipeline TP pass lowers to take per-chunk
callbacks and output buffers, so eagertp's consumers and producers plug in
directly and the placeholders are written in place::

    _pipelined_all_gather_and_consume(shard, shard_consumer, ag_out, group_name)
    _pipelined_produce_and_all2all(chunk_producer, output, group_name)

Both are private to torch and may move between releases: ``unavailable_reason``
detects them (and CUDA) and says why this backend cannot serve a collective,
and probes each group's workspace once, so that ``backend="auto"`` falls back
to the ring with that reason and ``backend="symm_mem"`` raises it.

The reduce-scatter gathers every rank's contribution to this rank's chunk
(all-to-all of produced chunks) and reduces locally, as torch's
``_fused_matmul_reduce_scatter_impl`` does: W chunk-sized buffers instead of the
ring's 3.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.distributed as dist

from eagertp._format import group_str, tensor_str
from eagertp.backends.base import (
    ChunkConsumer,
    ChunkProducer,
    OrderedConsumer,
    check_gather_buffers,
    check_scatter_buffers,
)

_PRIMITIVES = ("_pipelined_all_gather_and_consume", "_pipelined_produce_and_all2all")


def _symm_mem_module():
    try:
        return importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return None


def unavailable_reason(t: torch.Tensor, group: dist.ProcessGroup) -> str | None:
    """Why the symm_mem backend cannot serve a collective on ``t`` over
    ``group``, or None. The first call for a group rendezvouses its
    symmetric-memory workspace, a collective: every rank reaches it at the same
    collective, since the answer before it depends on the device and the torch
    build only."""
    return static_reason(t) or _group_reason(group)


def static_reason(t: torch.Tensor) -> str | None:
    """What the device and the torch build say, without communicating."""
    if t.device.type != "cuda":
        return f"symmetric memory needs CUDA tensors, this collective's are on {t.device.type}"
    module = _symm_mem_module()
    if module is None:
        return "this torch has no torch.distributed._symmetric_memory"
    missing = [name for name in (*_PRIMITIVES, "get_symm_mem_workspace") if not hasattr(module, name)]
    if missing:
        return f"this torch ({torch.__version__}) lacks {', '.join(missing)} in torch.distributed._symmetric_memory"
    return None


# group name -> why symmetric memory cannot serve it (None: it can), probed once.
_group_reasons: dict[str, str | None] = {}


def _group_reason(group: dist.ProcessGroup) -> str | None:
    name = group.group_name
    if name not in _group_reasons:
        try:
            _symm_mem_module().get_symm_mem_workspace(name, min_size=1)
            _group_reasons[name] = None
        except (RuntimeError, ValueError) as e:  # e.g. no peer access between the devices
            _group_reasons[name] = f"its workspace rendezvous on {group_str(group)} failed: {e}"
    return _group_reasons[name]


class SymmMemBackend:
    """torch's pipelined symmetric-memory primitives with eagertp's callbacks."""

    name = "symm_mem"

    def all_gather_consume(
        self,
        shard: torch.Tensor,
        consumer: ChunkConsumer | None,
        ag_out: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> None:
        check_gather_buffers(shard, ag_out, group)
        rows = slice(0, shard.shape[0])
        if isinstance(consumer, OrderedConsumer):
            consumer = _in_call_order(consumer)

        def shard_consumer(chunk: torch.Tensor, src: int) -> None:
            if consumer is not None:
                consumer(chunk, src, rows)

        # NB: with no consumer this is the same protocol (Invariant 2).
        with _torch_errors(f"all_gather of {tensor_str(shard)} on {group_str(group)}"):
            _symm_mem_module()._pipelined_all_gather_and_consume(shard, shard_consumer, ag_out, group.group_name)

    def produce_reduce_scatter(
        self,
        producer: ChunkProducer,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        reduce_op: str,
    ) -> None:
        check_scatter_buffers(out, reduce_op)
        world = group.size()
        # stacked[i]: rank i's contribution to this rank's chunk
        stacked = out.new_empty((world, *out.shape))
        with _torch_errors(f"reduce_scatter({reduce_op}) to {tensor_str(out)} on {group_str(group)}"):
            _symm_mem_module()._pipelined_produce_and_all2all(
                producer, stacked.view(world * out.shape[0], *out.shape[1:]), group.group_name
            )
        _REDUCE[reduce_op](stacked, out)


# Note [Consumers on two streams]
# torch's _pipelined_all_gather_and_consume runs the consumer of this rank's own
# shard on the current stream, then the consumer of step s on the backend stream
# (s odd) or the current stream (s even), each after that step's copy, so
# consecutive calls overlap (``cp s``: the copy of step s's shard):
#
#   current: [ consume own ]           [ cp 2 ][ consume 2 ]
#   backend:    [ cp 1 ][ consume 1 ]             [ cp 3 ][ consume 3 ]
#
# Right for consumers writing disjoint rows. An OrderedConsumer accumulates into
# one tensor (a weight gradient contracting the gathered rows), so each of its
# calls first waits for the event recorded after the previous call; each copy
# still overlaps the other stream's consumer:
#
#   current: [ consume own ]e0[ cp 2 ]            [ consume 2 ]e2
#   backend: [ cp 1 ]         [ consume 1 ]e1[ cp 3 ]           [ consume 3 ]


def _in_call_order(consumer: OrderedConsumer) -> ChunkConsumer:
    """``consumer``, its calls ordered across CUDA streams (Note [Consumers on
    two streams])."""
    previous: torch.cuda.Event | None = None

    def ordered(piece: torch.Tensor, src: int, rows: slice) -> None:
        nonlocal previous
        stream = torch.cuda.current_stream(piece.device)  # the stream torch runs this call on
        if previous is not None:
            stream.wait_event(previous)
        consumer(piece, src, rows)
        previous = torch.cuda.Event()
        previous.record(stream)

    return ordered


@contextlib.contextmanager
def _torch_errors(what: str):
    """Name the collective in torch's errors (its text carries the fix, e.g. for
    a workspace that cannot grow during CUDA graph capture)."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"eagertp symm_mem backend, {what}: {e}") from e


def _sum(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.sum(stacked, dim=0, out=out)


def _avg(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.sum(stacked, dim=0, out=out)
    out.div_(stacked.shape[0])


def _max(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.amax(stacked, dim=0, out=out)


def _min(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.amin(stacked, dim=0, out=out)


def _product(stacked: torch.Tensor, out: torch.Tensor) -> None:
    torch.prod(stacked, dim=0, out=out)


_REDUCE = {"sum": _sum, "avg": _avg, "max": _max, "min": _min, "product": _product}
