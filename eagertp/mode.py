"""The dispatch mode: every ATen op the program issues, looked up in the
handler table (``eagertp.table``) that the families fill."""

from __future__ import annotations

from typing import Any

import torch
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Imported for their handlers (they register into the table).
import eagertp.collectives.all_gather  # noqa: F401
import eagertp.collectives.all_reduce  # noqa: F401
import eagertp.collectives.c10d  # noqa: F401
import eagertp.collectives.other  # noqa: F401
import eagertp.collectives.reduce_scatter  # noqa: F401
import eagertp.collectives.torch_symm_mem  # noqa: F401
import eagertp.matmuls  # noqa: F401
from eagertp.deferred import tensor_leaves
from eagertp.engine import Engine
from eagertp.op_facts import OP_FACTS, op_facts, written_tensors
from eagertp.table import HANDLERS

# Note [Subclasses desugar first]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A tensor subclass with its own __torch_dispatch__ (DTensor, funcol's
# AsyncCollectiveTensor, torchao's Float8TrainingTensor, ...) runs first: the
# mode returns NotImplemented, the subclass's __torch_dispatch__ issues its
# ops on the plain tensors inside (a gather of the FP8 data, a _scaled_mm),
# and those reach the mode, which fuses them like any other. Had the mode run
# the subclass's op itself (with the mode off inside it, as a mode does), its
# collectives would have run unseen and unrecorded (Invariant 4). The
# exceptions are torch's own tracing subclasses, which hold no data and
# re-issue every op on themselves (the FakeTensor of DTensor's sharding
# propagation, functionalization's FunctionalTensor): they never hold our
# placeholders and pass through untouched.
_PASS_THROUGH = (FakeTensor, FunctionalTensor)


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
            if types == _ASYNC_ONLY and engine.store.items:
                unwrapped = _unwrap_pending_async(engine, func, args, kwargs)
                if unwrapped is not None:  # Note [Pending async tensors]
                    return self.__torch_dispatch__(func, (), *unwrapped)
            role = _ROLES.get(types)
            if role is None:
                role = _ROLES[types] = _role_of(types)
            if role is _PASS:
                return func(*args, **kwargs)
            if role is _DESUGAR:
                engine.unseen.handed = (types, func)  # Note [Collectives the mode did not see]
                return NotImplemented  # Note [Subclasses desugar first]
        if engine.issuing:
            return func._op(*args, **kwargs)
        handler = HANDLERS.get(func._op)
        if handler is None:
            # NB: views pass whatever is pending (a view of pending work stays pending).
            if not engine.store.items or (OP_FACTS.get(func._op) or op_facts(func)).passes:
                return func._op(*args, **kwargs)
            return engine.run_plain(func, args, kwargs)
        # An in-place collective may write a shard in flight (NB: the op's facts
        # asked first: written_tensors' frame only for an op that writes).
        if engine.store.sending and (OP_FACTS.get(func._op) or op_facts(func)).written:
            written = written_tensors(func, args, kwargs)
            if written:
                engine.release_shards(func, written)
        return handler(engine, func, args, kwargs)


# Note [Pending async tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# funcol returns every collective wrapped in an AsyncCollectiveTensor (ACT). A
# program that uses the wrapper without ``.wait()`` (``all_gather_tensor(a, 0,
# group) @ b``) sends each op on it through the mode twice: the mode returns
# NotImplemented, the wrapper's Python waits on each wrapped tensor
# (``wait_tensor``, through the mode) and calls the op on them again (through
# the mode). Where every wrapper wraps one of our placeholders, that wait is a
# no-op (the placeholder is filled before anything reads it), so the mode does
# the wrapper's work itself: what the wrapper would do, in one pass, for the
# ops whose result it does not wrap (every op but views; views keep torch's own
# path, which rewraps them). A wrapper of anything else (a collective issued as
# written, on a group we do not manage) takes torch's path and really waits.
_ASYNC_ONLY = (AsyncCollectiveTensor,)


def _unwrap_pending_async(engine: Engine, func, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``args`` and ``kwargs`` with each AsyncCollectiveTensor replaced by the
    placeholder it wraps (marked waited, as its own ``__torch_dispatch__``
    would), or None where the wrapper's own path must run."""
    if (OP_FACTS.get(func._op) or op_facts(func)).funcol_view:
        return None
    # NB: loops, not comprehensions: every op on funcol's result passes here.
    owner = engine.store.owner
    wrappers = []
    for t in tensor_leaves(args, kwargs):
        if type(t) is AsyncCollectiveTensor:
            if owner(t.elem) is None:
                return None
            wrappers.append(t)
    if not wrappers:
        return None
    for w in wrappers:
        w.completed = True
    unwrapped_args = []
    for a in args:
        if type(a) is AsyncCollectiveTensor:
            a = a.elem
        elif isinstance(a, (list, tuple)):
            a = _unwrapped(a)
        unwrapped_args.append(a)
    return tuple(unwrapped_args), ({k: _unwrapped(v) for k, v in kwargs.items()} if kwargs else kwargs)


def _unwrapped(a: Any) -> Any:
    # NB: ATen arguments nest one level at most (``cat``'s list), as tensor_leaves assumes.
    if type(a) is AsyncCollectiveTensor:
        return a.elem
    if isinstance(a, (list, tuple)):
        return type(a)(_unwrapped(x) for x in a)
    return a


# What the mode does with an op on tensor subclasses ``types``, asked once per
# tuple of types (NB: the generators' frames, on every op of a DTensor program).
_PASS, _DESUGAR, _PLAIN = "pass through", "desugar first", "as a plain tensor"
_ROLES: dict[tuple[type, ...], str] = {}  # bounded by the subclasses a program uses


def _role_of(types: tuple[type, ...]) -> str:
    if any(issubclass(t, _PASS_THROUGH) for t in types):
        return _PASS
    if any(_has_dispatch_override(t) for t in types):
        return _DESUGAR
    return _PLAIN  # a Parameter, say: the mode handles the op itself


def _has_dispatch_override(t: type) -> bool:
    return t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and not issubclass(
        t, torch.nn.Parameter
    )


# Note [Dispatch without Dynamo's wrapper]
set_code_exec_strategy(
    EagerTPMode.__torch_dispatch__.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
)
