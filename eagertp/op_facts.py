"""What the engine asks of an ATen op that touches pending work, read from
its schema once per op: what it writes, whether it reads data at all, and
whether it decomposes (``OpFacts``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from eagertp._compat import funcol_is_view_op

# Op namespaces whose ops communicate.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "symm_mem"})

# Ops that read no data of a pending tensor: views (their outputs share the
# placeholder's storage and stay pending; every other view op qualifies too,
# see _op_facts) and factories that take only its shape, dtype and device
# (autograd's AccumulateGrad makes a gradient's buffer so).
_aten = torch.ops.aten
_PENDING_PASSTHROUGH = frozenset({
    _aten._unsafe_view.default, _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_like.default,
    _aten.new_zeros.default, _aten.zeros_like.default, _aten.new_ones.default, _aten.ones_like.default,
    _aten.new_full.default, _aten.full_like.default,
})


class OpFacts(NamedTuple):
    """What the engine asks of an op that touches pending work, from its schema."""

    written: tuple[tuple[int, str], ...]  # (position, name) of each argument it writes
    metadata_only: bool  # reads no data of a pending tensor (Note [Deferral boundary])
    composite: bool  # not a collective, and has a CompositeImplicitAutograd kernel
    funcol_view: bool  # funcol's AsyncCollectiveTensor rewraps its result (Note [Pending async tensors])
    # Runs as it is, pending work or not: reads no data, writes nothing and
    # does not decompose (the views a step issues by the hundred).
    passes: bool


# NB: keyed by ``func._op`` (hashed in C; OpOverload's own ``__hash__`` is a
# Python frame, as in eagertp.table): asked for every op while work is pending.
OP_FACTS: dict[Callable[..., Any], OpFacts] = {}


def op_facts(func: torch._ops.OpOverload) -> OpFacts:
    facts = OP_FACTS.get(func._op)
    if facts is None:
        facts = OP_FACTS[func._op] = _op_facts(func)
    return facts


def _op_facts(func: torch._ops.OpOverload) -> OpFacts:
    schema = func._schema
    if func.namespace == "c10d" and schema.name.endswith("_") and schema.name != "c10d::monitored_barrier_":
        # c10d's in-place collectives write their first argument; their schemas
        # do not say so (``c10d::allreduce_(Tensor[] tensors, ...)``).
        written: tuple[tuple[int, str], ...] = ((0, schema.arguments[0].name),)
    else:
        written = tuple(
            (i, arg.name)
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
    metadata_only = func in _PENDING_PASSTHROUGH or (func.is_view and not schema.is_mutable)
    composite = func.namespace not in COLLECTIVE_NAMESPACES and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd"
    )
    return OpFacts(
        written, metadata_only, composite, funcol_is_view_op(func), metadata_only and not composite and not written
    )


def written_tensors(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes: in place, ``out=``, the lists of
    ``_foreach_*_``, the outputs of c10d's collectives (lists of lists too)."""
    facts = OP_FACTS.get(func._op) or op_facts(func)
    if not facts.written:  # NB: most ops, on the path of every op while work is pending
        return []
    found: list[torch.Tensor] = []
    pending = []
    for i, name in facts.written:  # NB: a loop: every in-place op while work is pending
        pending.append(args[i] if i < len(args) else kwargs.get(name))
    while pending:
        a = pending.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            pending.extend(a)
    return found
