"""The op -> handler table: one entry per ATen op eagertp understands.

The families fill it (``eagertp.collectives.*`` for the collectives,
``eagertp.matmuls`` for the matmuls and the ops around them), each handler
``(engine, func, args, kwargs)``; the dispatch mode (``eagertp.mode``) looks
ops up in it. Families import this module and the engine, never the mode or
the public class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from eagertp.engine import Engine

Handler = Callable[["Engine", torch._ops.OpOverload, tuple, dict], Any]
# NB: keyed by each OpOverload's ``_op``, its C++ entry point, whose hash is C's:
# the OpOverload's own ``__hash__`` is a Python method, a frame on every op the
# program runs (``HANDLERS.get(func._op)``). One OpOverload object per op: the
# dispatcher hands a mode the one ``torch.ops`` holds.
HANDLERS: dict[Callable[..., Any], Handler] = {}


def register(ops: Sequence[torch._ops.OpOverload]) -> Callable[[Handler], Handler]:
    """Fill the op -> handler table; an op may have one handler only."""

    def decorator(handler: Handler) -> Handler:
        for op in ops:
            if op._op in HANDLERS:
                raise RuntimeError(
                    f"eagertp: {op} already handled by {HANDLERS[op._op].__name__}; "
                    f"cannot also register {handler.__name__}"
                )
            HANDLERS[op._op] = handler
        return handler

    return decorator
