"""torch's own symmetric-memory ops (``torch.ops.symm_mem.*``: the fused
matmul collectives Inductor emits, one-shot all-reduces, ...) run inside the
block: ordered after eagertp's gathers in flight.

Note [torch's symmetric-memory ops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A group has one symmetric workspace, torch's. eagertp's gathers in flight copy
this rank's shard into it and pull the peers' shards out of theirs on the
group's comm stream, behind barriers of their own channel (Note [Gathers in
flight on the comm stream] in eagertp.backends.symm_mem). torch's ops write
the same workspace from the current stream after only their own barrier, so
nothing would order that write after eagertp's copy, nor after the peers'
pulls from this rank's buffer, which end only at the gather's closing
barrier: channels separate signals, not data. So before any ``symm_mem`` op,
the current stream waits for every comm stream eagertp has used (whichever
group the op names: the wait costs the GPU nothing that has not been issued
already), and the op then runs as written, after the pending work it reads
completes. Nothing waits where eagertp started no symmetric-memory gather
(the ring, CPU): then there is no comm stream.
"""

from __future__ import annotations

import torch

# NB: torch defines its Python symmetric-memory ops (the fused matmul
# collectives) where this module is imported: before the table is filled.
import torch.distributed._symmetric_memory  # noqa: F401
from eagertp.backends.symm_mem import wait_for_every_gather
from eagertp.engine import Engine
from eagertp.table import HANDLERS, register


def _torch_symm_mem_op(engine: Engine, func, args, kwargs):
    wait_for_every_gather()  # Note [torch's symmetric-memory ops]
    return engine.run_plain(func, args, kwargs)


def register_torch_symm_mem_ops() -> None:
    """Route every ``symm_mem::`` op torch has defined so far to the handler
    above; once at import, and again by whoever defines more."""
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op_name = name.partition("::")
        if namespace != "symm_mem":
            continue
        packet = getattr(torch.ops.symm_mem, op_name)
        overloads = [getattr(packet, overload) for overload in packet.overloads()]
        register([op for op in overloads if op._op not in HANDLERS])(_torch_symm_mem_op)


register_torch_symm_mem_ops()
