"""Communication ops eagertp does not fuse (point-to-point messages,
broadcasts, barriers, the list and coalesced forms of the collectives): run
as written. A list or coalesced all-gather, reduce-scatter or all-reduce on a
managed group gets its explain() line, with the reason, as any collective
issued as written (Invariant 4); the group counts them all, so the watch for
communication the mode did not see knows of them (Note [Collectives the mode
did not see] in eagertp.unseen)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from eagertp._format import tensor_str
from eagertp.deferred import tensors_in
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

# The kind of each collective explain() accounts for, by its op's name.
_KINDS = (("allgather", "all_gather"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
          ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"))


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
    name = func._opname.lstrip("_")
    kind = next((kind for prefix, kind in _KINDS if name.startswith(prefix)), None)
    group = None if kind is None else _group(args, kwargs)
    if group is not None:
        group = engine.managed_group(func, group.size(), group)
    if group is not None:
        # NB: raw c10d's gathers and reduce-scatters take their outputs first.
        outputs_first = func.namespace == "c10d" and kind != "all_reduce"
        # NB: the inputs argument (a list in the list forms); funcol's _out forms take their outputs as out=.
        inputs = tensors_in(args[1:2] if outputs_first else args[:1]) or tensors_in((args, kwargs))
        reason = f"eagertp fuses the single-tensor forms; {func} issued as written"
        signature = f"{func} {', '.join(map(tensor_str, inputs))}"
        return engine.issue_as_is(func, args, kwargs, kind, inputs[0], group, reason, signature, inputs=inputs)
    engine.check_unseen()
    result = engine.run_plain(func, args, kwargs) if engine.store.items else func._op(*args, **kwargs)
    if engine.unseen.known:
        engine.unseen.refresh()
    return result


def _group(args: tuple, kwargs: dict) -> dist.ProcessGroup | None:
    """The process group a c10d op (boxed) or a funcol op (by name) runs on."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp, or another boxed object
                continue
        if isinstance(a, str):
            try:
                return c10d._resolve_process_group(a)
            except (ValueError, RuntimeError, KeyError):
                continue
    return None

