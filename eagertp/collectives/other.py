"""Communication ops eagertp does not fuse (point-to-point messages,
broadcasts, barriers, the list and coalesced forms): run as written. The
group counts them, so the watch for communication the mode did not see knows
of them (Note [Collectives the mode did not see] in eagertp.unseen)."""

from __future__ import annotations

import torch

from eagertp.engine import Engine
from eagertp.table import HANDLERS, register

_OTHER = {
    "c10d": (
        "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_", "allreduce_coalesced_",
        "alltoall_", "alltoall_base_", "barrier", "broadcast_", "gather_", "monitored_barrier_", "recv_",
        "recv_any_source_", "reduce_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "scatter_", "send",
    ),
    "_c10d_functional": (
        "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out", "all_reduce_coalesced",
        "all_reduce_coalesced_", "all_to_all_single", "batch_p2p_ops", "broadcast", "broadcast_", "irecv", "isend",
        "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out",
    ),
}


def _overloads() -> list[torch._ops.OpOverload]:
    ops = []
    for namespace, names in _OTHER.items():
        for name in names:
            packet = getattr(getattr(torch.ops, namespace), name, None) if hasattr(torch.ops, namespace) else None
            if packet is None:
                continue  # not in this torch
            ops += [getattr(packet, overload) for overload in packet.overloads()]
    return [op for op in ops if op._op not in HANDLERS]


@register(_overloads())
def _other_communication(engine: Engine, func, args, kwargs):
    watch = engine.unseen
    if watch.known:
        found = watch.check_all()
        if found:
            engine.record_unseen(found)
    result = engine.run_plain(func, args, kwargs) if engine.store.items else func._op(*args, **kwargs)
    if watch.known:
        watch.refresh()
    return result
