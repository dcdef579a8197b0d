"""The dispatch mode: every ATen op the program issues, looked up in the
handler table (``eagertp.table``) that the families fill."""

from __future__ import annotations

import torch
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Imported for their handlers (they register into the table).
import eagertp.collectives.all_gather  # noqa: F401
import eagertp.collectives.all_reduce  # noqa: F401
import eagertp.collectives.c10d  # noqa: F401
import eagertp.collectives.reduce_scatter  # noqa: F401
import eagertp.matmuls  # noqa: F401
from eagertp.engine import Engine, written_tensors
from eagertp.table import HANDLERS

# Subclasses that desugar into plain ops we understand: return NotImplemented so
# their __torch_dispatch__ runs first and issues funcol ops on plain tensors.
_DESUGAR_FIRST = (DTensor, AsyncCollectiveTensor)


# Note [Dispatch without Dynamo's wrapper]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# TorchDispatchMode wraps every subclass's __torch_dispatch__ in
# torch._disable_dynamo(recursive=True), so that Dynamo never traces a mode's
# Python: a wrapper that costs about 1.2 us of the 6 us an empty mode adds to
# every op on these machines (benchmarks/NOTES.md). Ours opts out
# (_should_skip_dynamo) and gets the same from Dynamo itself at no cost per op:
# its code object is marked, once, as one Dynamo skips together with every
# frame it calls (what torch._dynamo's skip_code does, made recursive). The
# block forces the eager stance anyway (Note [Compiled code inside the block]);
# the mark matters where a program sets another stance inside the block and
# calls compiled code, whose ops then reach the mode with Dynamo's frame hook
# set (tests/test_compile.py).


class EagerTPMode(TorchDispatchMode):
    """The private dispatch mode behind ``EagerMicroPipeline``."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # skipped by its mark below: Note [Dispatch without Dynamo's wrapper]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # NB: the hot path. Plain ops while nothing is pending cost one dict
        # lookup and a few attribute reads on top of an empty mode, and call the
        # op's C++ entry point (``func._op``: what ``OpOverload.__call__``, a
        # Python frame, calls).
        engine = self.engine
        if kwargs is None:
            kwargs = {}
        if types:  # tensor subclasses are involved
            if any(issubclass(t, _DESUGAR_FIRST) for t in types):
                return NotImplemented
            if any(_has_dispatch_override(t) for t in types):
                # Other subclasses (the FakeTensor of DTensor's sharding propagation)
                # never hold our placeholders: pass them through untouched.
                return func(*args, **kwargs)
        if engine.issuing:
            return func._op(*args, **kwargs)
        handler = HANDLERS.get(func._op)
        if handler is None:
            if not engine.store.items:
                return func._op(*args, **kwargs)
            return engine.run_plain(func, args, kwargs)
        if engine.store.sending:  # an in-place collective may write a shard in flight
            engine.release_shards(func, written_tensors(func, args, kwargs))
        return handler(engine, func, args, kwargs)


def _has_dispatch_override(t: type) -> bool:
    return t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and not issubclass(
        t, torch.nn.Parameter
    )


# Note [Dispatch without Dynamo's wrapper]
set_code_exec_strategy(
    EagerTPMode.__torch_dispatch__.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
)
