"""How the engine issues its own work (Note [Issuing work]), and the profiler
ranges around its fused calls."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from eagertp.engine import Engine

# Note [Issuing work]
# ~~~~~~~~~~~~~~~~~~~
# ``with engine.issuing_work():`` ops issued inside pass through the mode, and
# fill placeholders below autograd: tensors autograd saved for backward are
# these same storages, and their version counters must not move. The
# outermost one also reads the watched groups' operation counts before and
# after (Note [Collectives the mode did not see] in eagertp.unseen).


class IssuingWork:
    """``Engine.issuing_work()``: Note [Issuing work]. NB: a class, not a
    generator under ``contextlib.contextmanager``: entered twice or more per
    fused call, where the generator's machinery cost about 1.5 us each
    (benchmarks/NOTES.md, 2026-12-02 at 5ce2715)."""

    __slots__ = ("engine", "was_issuing", "below_autograd")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        engine = self.engine
        if not engine.issuing and engine.unseen.known:  # Note [Collectives the mode did not see]
            found = engine.unseen.check_all()  # NB: Engine.check_unseen, one frame shorter
            if found:
                engine.record_unseen(found)
        self.below_autograd = torch._C._AutoDispatchBelowADInplaceOrView()
        self.below_autograd.__enter__()
        self.was_issuing, engine.issuing = engine.issuing, True

    def __exit__(self, *exc) -> None:
        try:
            self.below_autograd.__exit__(*exc)
        finally:
            engine = self.engine
            engine.issuing = self.was_issuing
            if not engine.issuing and engine.unseen.known:
                engine.unseen.refresh()


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A named range in profiler traces; nothing (not even two dispatched ops)
    when no profiler runs."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
