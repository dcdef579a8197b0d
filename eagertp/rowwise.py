"""Row-wise ops on gathered rows: what they are, and how one runs on a chunk.

Note [Row-wise ops on gathered rows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
TP without sequence parallel all-reduces a row-parallel linear's output, and
the next column-parallel linear reads it only after the residual add and the
norm: ``h = x + all_reduce(y); q = norm(h) @ wq``. eagertp runs the all-reduce
as a fused reduce-scatter and an all-gather left in flight (Note [Matmul +
all-reduce] in eagertp.collectives.all_reduce); had the add read the gathered
tensor whole, the gather half would overlap nothing. But the add and the norm
are *row-wise*: each output row depends only on the same rows of the inputs.
So each runs on a chunk's rows as the chunk lands, and the matmul after them
consumes the chunk's normed rows, as under sequence parallelism (whose norm
runs on the shards), from the unchanged program::

    program:  h = x + AR(y)       n = norm(h)        q = n @ wq   k = n @ wk   attn(q, k)
    comm:     [RS][== AG half: chunk 0, chunk 1 ==]
    compute:                         (derived, pending)  (bound)      [h, n, q, k rows of chunk 0][chunk 1][attn]

An op whose tensors are rows of a gather in flight (its placeholder, or a
tensor derived from it so) and which ``RULES`` below says is row-wise for
these operands gives a *derived* placeholder (a ``GatheredView`` of the
gather, ``derived=True``) and a ``RowwiseStep`` on the gather. When the gather
completes, every step runs, in program order, on the rows each piece makes,
writing the derived placeholders' rows below autograd (tensors saved for
backward see data, as a gather's placeholder does); then the consumers bound
to any view run. A matmul on a derived tensor binds to the gather as on the
gathered tensor itself; any other read completes the gather, its steps and
its consumers (Note [Deferral boundary] in eagertp.deferred).

Operands of a step, each viewed as the gather's rows ``[*lead, X]`` (the
leading dims of the view the op reads, its own last dim):

- ``PIECE``: the gathered tensor itself (the gather's first view): the piece
  the backend delivers (this rank's own chunk may never be copied into the
  placeholder: Note [This rank's chunk, unread] in eagertp.engine);
- ``ROWS``: another view of the gather (a derived one, a cast, a cat along a
  dim > 0), or a tensor of the program with the same leading dims: the same
  rows of it;
- ``OTHER``: the placeholder of another gather in flight with the same rows
  per rank (DTensor's backward adds q's, k's and v's all-reduced input
  gradients before the norm's backward): chunk ``i`` waits for chunk ``i`` of
  that gather (``GatherHandle.wait_chunk``), which stays in flight, completed
  by its own reads;
- ``WHOLE``: a tensor broadcast along the rows (every leading dim 1: a norm's
  weight, a scalar), passed whole.

Any other pending operand completes what owns it first (a product, a gather's
view of another shape), and is then a tensor like any other. An op that is
not row-wise for its operands (a reduction over another dim, an operand
broadcast along some rows only, an output that is not rows, an in-place write
to the gathered tensor itself or to a view a matmul already reads) completes
the gather first, unfused, with the op named in the gather's reason.

Some ops also reduce over the rows (the norm's weight and bias gradients).
Those results are placeholders of the gather too, computed whole once every
step and consumer has run (``WholeStep``): plain eager's op on the completed
tensors.

"Row-wise" is a promise of equal results: each row is the same computation
on the same values whichever rows a call holds. That holds for IEEE's basic
operations, roundings to integers, casts, and reductions along the last dim.
It does not hold, as such, for the transcendental functions (exp, log2,
tanh, pow to most exponents): their CPU kernels round differently in their
vector loop and in the scalar loop that finishes a call's last elements, so
an element that falls at the end of a chunk could change in its last bit.
Those run on *windows* instead (Note [Aligned windows]). ``tests/test_rowwise.py``
runs every entry on chunks of random shapes and dtypes and compares bitwise
with the whole op.

Note [Aligned windows]
~~~~~~~~~~~~~~~~~~~~~~
A CPU elementwise kernel on a contiguous tensor loops over its elements in
blocks of two vectors from the first element, then finishes the last few
with scalar code (ATen's ``vectorized_loop``); an element's bits depend only
on which of the two computes it. A unary op on a chunk's rows therefore runs
on a window of the whole flattened tensor (a derived placeholder of the
gather: rows that have not landed yet hold stale values there, and the other
lanes of a vector never affect an element) that starts at a multiple of
``WINDOW`` elements (a multiple of every vector loop's block) and ends at the
next such multiple or at the tensor's end; the chunk's elements are copied
out. Each element is then computed as in the whole call: in a full block, or
in the same scalar tail. This holds while the whole call runs on one thread:
past ``GRAIN_SIZE`` elements ATen splits it over threads at boundaries of
its own, so a windowed op on a tensor that large, with more than one thread,
completes the gather instead. Other devices compute each element the same way
wherever it lies; the windows cost nothing there.

Note [Memory of a chain]
~~~~~~~~~~~~~~~~~~~~~~~~
A step's results are made when it is deferred and filled when the gather
lands, so a chain in flight holds every result it made, where plain eager
frees each once nothing reads it; and what is pending meanwhile holds its
inputs. In a plain-TP backward step the chain is the norm's backward and the
residual add on the MLP's all-reduced input gradient, and when it starts the
MLP's first weight gradient (``g.t() @ norm_out``) is still pending, holding
the norm's output, which nothing else references any more: that tensor was
the fused step's peak over unfused eager's (``benchmarks/memory.py
--no-sequence-parallel --at-peak``: 7.52 MiB against 7.02). A chain's first op
therefore computes such weight gradients before it makes its results, as a
deferred matmul does (Note [Products past their collective] in
eagertp.deferred): once per chain, not per step (a check costs a few frames),
and the fused step's peak is unfused eager's. The chain's own results stay
(they are what the program and autograd hold, or the next step's rows).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from eagertp._format import tensor_str
from eagertp.trace import Meta, Trace

if TYPE_CHECKING:
    from eagertp.deferred import GatheredView, PendingGather

aten = torch.ops.aten


class Kind(enum.Enum):
    """How an operand of a row-wise step is read (Note [Row-wise ops on gathered rows])."""

    PIECE = "piece"
    ROWS = "rows"
    OTHER = "rows of another gather"
    WHOLE = "whole"


@dataclasses.dataclass(eq=False, slots=True)
class RowOperand:
    kind: Kind
    tensor: torch.Tensor  # ROWS / OTHER / PIECE: viewed as [*lead, X]; WHOLE: as the op reads it (leading 1s dropped)
    view: GatheredView | None = None  # the gather's view it is (PIECE, a ROWS view of the gather)
    other: PendingGather | None = None  # OTHER: the gather in flight it is the placeholder of
    # The op reads the view's rows [*lead, 1] expanded to this width (a
    # reduction's gradient: ``grad.expand(..., X)``).
    width: int | None = None

    def expanded(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.width is None else t.expand(*t.shape[:-1], self.width)


# A rule: why the op is not row-wise for these arguments (None: it is), given
# the positions of the tensor arguments that are rows and the number of dims
# of the rows (``ndim``). Every op in the table is elementwise, or works on the
# last dim only, unless its check says more.
Check = Callable[[tuple, dict, int], "str | None"]


@dataclasses.dataclass(frozen=True)
class Rule:
    check: Check | None = None
    in_place: bool = False  # writes its first argument (a derived tensor)
    # For ops that also reduce over the rows: (args of the row-wise call, args
    # of the whole call) from the op's args; each result is made by one of
    # them (the other call's mask leaves it out).
    split: Callable[[tuple], tuple[tuple, tuple]] | None = None
    row_results: tuple[int, ...] = ()  # with ``split``: the results made row by row
    whole: bool = False  # computed whole when the gather completes (reduces over the rows)
    rewrite_dims: bool = False  # its dims (argument 1) are the last dim: passed as [-1] to the rows
    # True for the op's arguments if it runs on aligned windows of its input
    # (Note [Aligned windows]): a unary op not exact per element.
    window: Callable[[tuple], bool] | None = None


def _last_dim_keepdim(args: tuple, kwargs: dict, ndim: int) -> str | None:
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dims is None or [d % ndim for d in ([dims] if isinstance(dims, int) else dims)] != [ndim - 1]:
        return f"it reduces dims {dims}, not the last dim alone"
    if not keepdim:
        return "it reduces the last dim without keepdim"
    return None


def _over_leading_dims(args: tuple, kwargs: dict, ndim: int) -> str | None:
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None or sorted(d % ndim for d in dims) != list(range(ndim - 1)):
        return f"it reduces dims {dims}, not every dim but the last"
    return None


def _last_dim_normalized(args: tuple, kwargs: dict, ndim: int) -> str | None:
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    return None if len(shape) == 1 else f"it normalizes {len(shape)} dims, not the last dim alone"


def _grad_last_dim_normalized(args: tuple, kwargs: dict, ndim: int) -> str | None:
    return None if len(args[2]) == 1 else f"it normalizes {len(args[2])} dims, not the last dim alone"


# pow's exponents whose kernels are IEEE operations (x*x, sqrt, 1/x, ...):
# any other calls the libm or vector pow, which round differently.
_EXACT_EXPONENTS = frozenset({0.5, 1, 2, 3, -0.5, -1, -2})


def _always(args: tuple) -> bool:
    return True


def _half_precision(args: tuple) -> bool:
    """rsqrt: exact per element in float32 and float64 only (the CPU kernels'
    vector and scalar loops round half-precision inputs differently)."""
    return args[0].dtype not in (torch.float32, torch.float64)


def _inexact_power(args: tuple) -> bool:
    return args[1] not in _EXACT_EXPONENTS or (args[1] == -0.5 and _half_precision(args))


def _only_dtype(args: tuple, kwargs: dict, ndim: int) -> str | None:
    t = args[0]
    if kwargs.get("layout", torch.strided) != torch.strided or torch.device(kwargs.get("device", t.device)) != t.device:
        return "it moves the tensor"
    if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        return "it changes the memory format"
    return None


def _split_layer_norm_backward(args: tuple) -> tuple[tuple, tuple]:
    mask = list(args[7])
    return (*args[:7], [mask[0], False, False]), (*args[:7], [False, mask[1], mask[2]])


_POINTWISE = Rule()

# The table (Note [Row-wise ops on gathered rows]): ops whose every result row
# depends only on the same rows of their row operands, and computes the same
# bits on any set of rows.
ROW_TABLE: dict[torch._ops.OpOverload, Rule] = {
    **{
        op: _POINTWISE
        for op in (
            aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
            aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar,
            aten.sqrt.default, aten.reciprocal.default, aten.neg.default, aten.abs.default,
            aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
            aten.where.self, aten.clone.default,
            aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default, aten.sign.default,
        )
    },
    aten.pow.Tensor_Scalar: Rule(window=_inexact_power),
    aten.rsqrt.default: Rule(window=_half_precision),
    **{
        op: Rule(window=_always)
        for op in (
            aten.exp.default, aten.exp2.default, aten.log.default, aten.log2.default,
            aten.tanh.default, aten.sigmoid.default, aten.silu.default, aten.erf.default,
        )
    },
    aten._to_copy.default: Rule(_only_dtype),
    **{
        op: Rule(in_place=True)
        for op in (
            aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor,
            aten.add_.Scalar, aten.sub_.Scalar, aten.mul_.Scalar, aten.div_.Scalar,
            aten.clamp_.default, aten.clamp_min_.default, aten.clamp_max_.default,
        )
    },
    **{
        op: Rule(_last_dim_keepdim, rewrite_dims=True)
        for op in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default)
    },
    aten.native_layer_norm.default: Rule(_last_dim_normalized),
    aten.native_layer_norm_backward.default: Rule(
        _grad_last_dim_normalized, split=_split_layer_norm_backward, row_results=(0,)
    ),
}

# Reductions over the rows (a norm's weight gradient, written as ops):
# computed whole when the gather completes.
WHOLE_TABLE: dict[torch._ops.OpOverload, Rule] = {aten.sum.dim_IntList: Rule(_over_leading_dims, whole=True)}

# NB: keyed by each op's C++ entry point, as eagertp.table's HANDLERS is.
RULES = {op._op: rule for op, rule in ROW_TABLE.items()}
WHOLE_RULES = {op._op: rule for op, rule in WHOLE_TABLE.items()}


# Every op with a rule, for the engine's one lookup per op that reads pending work.
ANY_RULE = frozenset(RULES) | frozenset(WHOLE_RULES) | {aten.copy_.default._op}


# Note [Row results written in place]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A step's results go into rows of its derived placeholders, piece by piece.
# Made by the op and then copied there, each piece costs an allocation and a
# copy: one more op, and one more kernel on a GPU, per op and piece. The op's
# out= overload writes the rows where they belong instead, with the same
# kernel on the same operands: the same bits, into rows with gaps between
# them too (``test_out_overloads_into_strided_rows_give_the_same_bits``, on
# random inputs; the chain tests run every case as steps against plain
# eager). Only where every result is rows of a placeholder:
# ``native_layer_norm_backward``'s split call leaves its weight and bias
# gradients to the whole step; in-place ops write their target already; ops
# on aligned windows copy out a window's middle (Note [Aligned windows]);
# ``_to_copy``'s out overload takes no dtype.


@dataclasses.dataclass(frozen=True, slots=True)
class OutVariant:
    """An op's ``out=`` overload: the same arguments, then one buffer per result."""

    func: torch._ops.OpOverload
    names: tuple[str, ...]  # its buffers' keywords, in the order of the results


def out_variant(func: torch._ops.OpOverload) -> OutVariant | None:
    """The overload of ``func``'s packet that takes its arguments (names and
    types alike) and writes each of its results into a keyword buffer
    (``add.Tensor`` -> ``add.out``, ``native_layer_norm`` -> its ``out0..2``),
    or None (``_to_copy``'s out overload takes no dtype: no such overload)."""
    arguments = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        names = tuple(a.name for a in schema.arguments if a.is_out)
        if (
            len(names) == len(func._schema.returns)
            and names
            and [(a.name, str(a.type)) for a in schema.arguments if not a.is_out] == arguments
        ):
            return OutVariant(getattr(packet, name), names)
    return None


# Note [Row results written in place]: each row-wise op's out= overload, keyed
# as RULES is (in-place ops write their target already: they have none).
OUT_VARIANTS = {op._op: found for op in ROW_TABLE if (found := out_variant(op)) is not None}


@dataclasses.dataclass(frozen=True, slots=True)
class ArgTemplate:
    """An op's arguments with each tensor (top level only: the table's ops
    take no lists of tensors) taken out, to be called on other tensors in
    their places: a step's op, once per piece."""

    args: tuple
    kwargs: dict
    arg_slots: tuple[tuple[int, int], ...]  # (position in args, index of its tensor)
    kwarg_slots: tuple[tuple[str, int], ...]  # (keyword, index of its tensor)

    @staticmethod
    def of(args: tuple, kwargs: dict) -> tuple[ArgTemplate, list[torch.Tensor]]:
        """The template of ``args`` and ``kwargs``, and their tensors in order."""
        tensors: list[torch.Tensor] = []
        held, arg_slots = list(args), []
        for pos, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                arg_slots.append((pos, len(tensors)))
                tensors.append(a)
                held[pos] = None
        held_kwargs, kwarg_slots = dict(kwargs), []
        for name, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                kwarg_slots.append((name, len(tensors)))
                tensors.append(v)
                held_kwargs[name] = None
        return ArgTemplate(tuple(held), held_kwargs, tuple(arg_slots), tuple(kwarg_slots)), tensors

    def call(self, func: torch._ops.OpOverload, values: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """``func`` on these arguments with ``values`` for their tensors: its results, as a list."""
        kwargs = dict(self.kwargs) if self.kwarg_slots else self.kwargs
        return as_results(func._op(*self._filled(values, kwargs), **kwargs))

    def call_into(self, out: OutVariant, values: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        """``call`` through ``out``, the op's out= overload, writing its
        results into ``buffers`` (each of a result's shape and dtype)."""
        kwargs = dict(self.kwargs)
        args = self._filled(values, kwargs)
        for name, buffer in zip(out.names, buffers):
            kwargs[name] = buffer
        out.func._op(*args, **kwargs)

    def _filled(self, values: Sequence[torch.Tensor], kwargs: dict) -> list:
        """The positional arguments with ``values`` in their tensors' places;
        the keyword ones written into ``kwargs`` (a copy of ``self.kwargs``
        where there are any)."""
        # NB: on the hot path (every step, every piece): loops, no frames per argument.
        args = list(self.args)
        for pos, i in self.arg_slots:
            args[pos] = values[i]
        for name, i in self.kwarg_slots:
            kwargs[name] = values[i]
        return args


def as_results(out: Any) -> list[torch.Tensor | None]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@dataclasses.dataclass(eq=False)
class RowwiseStep:
    """One row-wise op on a gather's rows, run piece by piece (Note [Row-wise
    ops on gathered rows]). ``outputs[i]``: the derived view that result ``i``
    of the op fills (None: not a row result). In place, the op writes its
    first operand's rows, a derived view of the gather."""

    func: torch._ops.OpOverload
    template: ArgTemplate  # its arguments, tensors taken out: ``operands`` go in their places
    operands: list[RowOperand]
    outputs: list[GatheredView | None]
    geometry: GatheredView  # whose rows the pieces' (src, rows) count
    tid: int
    in_place: bool = False
    windowed: bool = False  # a unary op run on aligned windows of its input (Note [Aligned windows])
    # Where every result is rows: the op's out= overload, which writes them in
    # place (Note [Row results written in place]).
    out: OutVariant | None = None

    @property
    def name(self) -> str:
        return self.func.__name__.split(".")[0]

    def run(self, piece: torch.Tensor, src: int, rows: slice) -> None:
        """The op on the rows that rows ``rows`` of rank ``src``'s shard make,
        written into the derived placeholders (a consumer step)."""
        geometry = self.geometry
        if self.windowed:
            source, (made,) = self.operands[0].tensor, self.outputs
            runs = geometry.runs_of(source, src, rows)  # [runs, rows per run, X]
            length = runs[0].numel()
            flat_in, flat_out = source.view(-1), made.tensor.view(-1)
            for run in runs:
                start = run.storage_offset() - source.storage_offset()
                flat_out[start : start + length] = in_window(
                    lambda t: self.template.call(self.func, [t])[0], flat_in, start, length
                )
            return
        values = []
        rows_read = None
        for op in self.operands:
            kind = op.kind
            if kind is Kind.WHOLE:
                values.append(op.tensor)
            else:
                if kind is Kind.PIECE:
                    rows_read = piece.reshape(1, -1, op.tensor.shape[-1])
                else:
                    if kind is Kind.OTHER and not op.other.completed:
                        op.other.handle.wait_chunk(src)
                    rows_read = geometry.runs_of(op.tensor, src, rows)
                values.append(rows_read if op.width is None else op.expanded(rows_read))  # NB: no frame, mostly
        out = self.out
        if out is not None:
            buffers = [geometry.runs_of(view.tensor, src, rows) for view in self.outputs]
            # NB: the results' rows are the operands' (a buffer of another
            # shape would be resized, not written).
            if buffers[0].shape[:-1] == rows_read.shape[:-1]:
                self.template.call_into(out, values, buffers)
                return
        results = self.template.call(self.func, values)
        for view, result in zip(self.outputs, results):
            if view is not None:
                geometry.runs_of(view.tensor, src, rows).copy_(result)

    def run_whole(self, data: dict[int, torch.Tensor]) -> None:
        """The op on whole tensors: ``data`` maps a view's id to the tensor
        that holds it (the placeholders once landed, or verify's plain eager
        tensors), outputs included; an OTHER gather's id to its whole tensor."""
        values = []
        for op in self.operands:
            if op.kind is Kind.WHOLE or (op.kind is Kind.ROWS and op.view is None):
                values.append(op.tensor)
            elif op.kind is Kind.OTHER:
                values.append(op.expanded(data[id(op.other)].view(op.tensor.shape)))
            else:
                values.append(op.expanded(data[id(op.view)].view(op.tensor.shape)))
        for view, result in zip(self.outputs, self.template.call(self.func, values)):
            if view is not None:
                data[id(view)].view(result.shape).copy_(result)

    def describe(self) -> str:
        """``add -> $7 (row by row)``: what explain() names."""
        made = next((v for v in self.outputs if v is not None), None)
        tid = made.tid if made is not None else self.operands[0].view.tid
        return f"{self.name} -> ${tid} (row by row)"

    def inputs(self) -> list[torch.Tensor]:
        """The program's tensors it reads (a write to them completes the gather
        first) and other gathers' placeholders."""
        return [op.tensor for op in self.operands if op.view is None]

    def trace_event(self) -> tuple:
        operands = [
            f"${op.view.tid}" if op.view is not None else (f"${op.other.tid}" if op.other is not None else Meta.of(op.tensor))
            for op in self.operands
        ]
        outputs = [None if v is None else (v.tid, Meta.of(v.tensor)) for v in self.outputs]
        return _render_step, self.name, operands, outputs, self.in_place


# Note [Aligned windows]: a multiple of the block of every CPU vector loop
# (two vectors of at most 64 bytes: 128 one-byte elements).
WINDOW = 256
GRAIN_SIZE = 32768  # ATen's at::internal::GRAIN_SIZE: more elements may split over threads


def in_window(
    op: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor, start: int, length: int
) -> torch.Tensor:
    """``op(flat)[start : start + length]``, bitwise, from ``op`` on an aligned
    window of the contiguous 1-d ``flat`` around those elements (Note [Aligned
    windows])."""
    lo = start - start % WINDOW
    hi = min(flat.numel(), -(-(start + length) // WINDOW) * WINDOW)
    return op(flat[lo:hi])[start - lo : start - lo + length]


def why_not_windowed(operands: list[RowOperand]) -> str | None:
    """Why a unary op not exact per element cannot run on aligned windows of
    its one operand (Note [Aligned windows]), or None."""
    if len(operands) != 1 or operands[0].kind is not Kind.ROWS or operands[0].view is None or operands[0].width:
        return "it is not exact per element, and runs on aligned windows of a row-wise result only"
    t = operands[0].tensor
    if t.is_cpu and t.numel() >= GRAIN_SIZE and torch.get_num_threads() > 1:
        return f"it is not exact per element, and its {t.numel()} elements split over threads"
    return None


def _render_step(name: str, operands: list, outputs: list, in_place: bool) -> str:
    args = ", ".join(map(str, operands))
    if in_place:
        return f"{operands[0]} = {name}({args}) [row-wise, in place]"
    made = ", ".join(f"${tid}: {meta}" for tid, meta in (o for o in outputs if o is not None))
    return f"{made} = {name}({args}) [row-wise]"


# Note [Results over the rows, taken by autograd]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A result over the rows is mostly a parameter's gradient (a norm's weight and
# bias, a bias's sum over the rows), which autograd's AccumulateGrad takes as
# ``.grad`` when ``.grad`` is unset and nothing else holds the tensor; else it
# allocates a new ``.grad`` and copies (a row-wise ``copy_`` deferred with the
# gather). The step holding the placeholder made it too shared to take: a
# plain-TP demo block copied every norm's gradients, every step
# (benchmarks/NOTES.md, 2026-12-04 at ec3a99e). So the program gets an alias
# (``detach()``, its own tensor on the same storage): autograd takes it, the
# step fills the storage when the gather completes, and every read of
# ``.grad`` still finds the pending work by its storage (``PendingStore.owner``).


@dataclasses.dataclass(eq=False)
class WholeStep:
    """An op's results that reduce over a gather's rows (a norm's weight
    gradient): placeholders of the gather, computed by plain eager's op on the
    completed tensors once every step and consumer has run."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor | None]  # placeholders, per result of the op (None: another call makes it)
    tid: int
    # A tensor of the program it writes (``copy_``): the gather's until then.
    writes: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.func.__name__.split(".")[0]

    def run(self) -> None:
        for out, result in zip(self.outputs, as_results(self.func._op(*self.args, **self.kwargs))):
            if out is not None:
                out.copy_(result)

    def placeholders(self) -> list[torch.Tensor]:
        return [t for t in (*self.outputs, self.writes) if t is not None]

    def inputs(self) -> list[torch.Tensor]:
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)]

    def trace_event(self) -> tuple:
        return _render_whole, self.name, self.tid, [Meta.of(t) for t in self.placeholders()]


def _render_whole(name: str, tid: int, outputs: list[Meta]) -> str:
    return f"${tid}: {', '.join(map(str, outputs))} = {name}(...) [over the rows, when the gather completes]"


def leading_ones(t: torch.Tensor) -> bool:
    """True if ``t`` is broadcast along every row (0-dim, or leading dims all 1)."""
    return math.prod(t.shape[:-1]) == 1 if t.dim() else True


def _rows_view(t: torch.Tensor, view: GatheredView) -> bool:
    """True if ``t`` is the whole of ``view``, seen with its rows: the same
    data, contiguous, in its dtype and with its last dim; and the view is
    gathered along a dim of rows (along the last dim, chunks are columns)."""
    v = view.tensor
    return (
        view.dim < v.dim() - 1
        and t.is_contiguous()
        and t.dtype == v.dtype
        and t.storage_offset() == v.storage_offset()
        and t.numel() == v.numel()
        and t.dim() > 0
        and t.shape[-1] == v.shape[-1]
    )


def _rows_width(t: torch.Tensor, view: GatheredView) -> int | None:
    """How ``t`` reads ``view`` as rows: 0 if it is the whole view seen with
    its rows (``_rows_view``), the width if it is per-row ``[*lead, 1]`` rows
    expanded along the last dim, None if neither."""
    if _rows_view(t, view):
        return 0
    v = view.tensor
    if view.dim >= v.dim() - 1 or v.shape[-1] != 1 or t.dim() == 0 or t.dtype != v.dtype or t.stride(-1) != 0:
        return None
    rows = v.view(*t.shape[:-1], 1) if math.prod(t.shape[:-1]) == v.numel() else None
    if rows is None or t.storage_offset() != v.storage_offset() or t.stride() != rows.expand(t.shape).stride():
        return None
    return t.shape[-1]


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor broadcast along the rows (a norm's weight: one row
    at most), taken where the program reads it. Its value then is the
    program's, whatever happens to it before the gather completes: FSDP2
    frees an unsharded parameter's storage after backward (``reshard``,
    ``storage.resize_(0)``, no op the mode sees) before it reads the
    gradients whose completion runs the steps."""
    return t.clone()


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


# (op, its arguments' shapes, strides, dtypes and other values) -> the meta
# kernel's results. The meta kernels of pointwise ops are Python references
# (about 0.3 ms a call here: 10% of a step whose norms run row by row); a
# training loop repeats the same calls every step.
_META_CACHE: collections.OrderedDict[tuple, list[torch.Tensor | None]] = collections.OrderedDict()
_META_CACHE_SIZE = 4096


def _meta_results(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor | None]:
    """The results of ``func(*args, **kwargs)`` as meta tensors (shapes,
    strides, dtypes), from the meta kernel, cached by the arguments' metadata."""
    key = (func, _key(args), (tuple(kwargs), _key(kwargs.values())) if kwargs else ())
    found = _META_CACHE.get(key)
    if found is not None:
        _META_CACHE.move_to_end(key)
        return found
    results = as_results(
        func._op(*(_meta(a) if isinstance(a, torch.Tensor) else a for a in args),
                 **{k: _meta(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    )
    _META_CACHE[key] = results
    if len(_META_CACHE) > _META_CACHE_SIZE:
        _META_CACHE.popitem(last=False)
    return results


def _key(values: Iterable[Any]) -> tuple:
    """What the meta kernel reads of these arguments: each tensor's
    metadata, any other value itself (lists and tuples item by item)."""
    key = []
    for a in values:  # NB: a loop: every row-wise op's arguments pass here
        if isinstance(a, torch.Tensor):
            # NB: a 0-dim CPU tensor beside others (a wrapped Python number) promotes
            # by its value's kind only: the dtype and device say all the kernel reads.
            key.append((a.shape, a.stride(), a.dtype, a.device))  # NB: the device, not its type: .type makes a string
        elif isinstance(a, (list, tuple)):
            key.append(_key(a))
        else:
            key.append(a)
    return tuple(key)


def defer(
    engine: Any, func: torch._ops.OpOverload, args: tuple, kwargs: dict, tensors: list[torch.Tensor]
) -> tuple[Any, str | None]:
    """``func(*args, **kwargs)`` deferred as a row-wise step on the rows of a
    gather in flight (Note [Row-wise ops on gathered rows]): its results,
    placeholders the step fills. Or ``(None, why)`` if it is not one (the
    caller completes what it reads and runs it); why is None where the op
    reads no gathered rows at all. ``tensors``: its tensor arguments, in order."""
    from eagertp.deferred import GatheredView, PendingGather

    if func is aten.copy_.default:
        done = not kwargs and len(args) == 2 and defer_copy(engine, *args)
        return (args[0], None) if done else (None, None)
    store = engine.store
    primary = None
    for t in tensors:
        found = store.gathered_view_of(t)
        if found is not None:
            width = _rows_width(t, found[1])
            if width is not None:
                primary = (found[0], found[1], t, width)
                break
    if primary is None:
        return None, None
    gather, geometry, program_rows, program_width = primary
    ndim = program_rows.dim()
    rule, why = _rule_for(func, args, kwargs, ndim)
    if rule is None:
        return None, why
    if not gather.steps and not gather.wholes:
        # NB: a chain's first op, before its results are made: the weight
        # gradients whose inputs only pending work holds are computed now
        # (Note [Memory of a chain]).
        engine.complete_orphaned_weight_gradients(func)
    if rule.split is not None:
        row_args, whole_args = rule.split(args)
    elif rule.whole:
        row_args, whole_args = None, args
    else:
        row_args, whole_args = args, None
    if rule.rewrite_dims and row_args is not None:
        row_args = (row_args[0], [-1], *row_args[2:])
    template, step_tensors = ArgTemplate.of(row_args if row_args is not None else args, kwargs)
    lead = geometry.tensor.shape[:-1]
    program_lead = program_rows.shape[:-1]
    operands: list[RowOperand] = []
    reads_other_gather = False
    for i, t in enumerate(step_tensors):
        if t is program_rows:  # NB: its view and width found above
            owner, view, width = gather, geometry, program_width
        else:
            owner = store.owner(t)
            if owner is gather:
                view = gather.view_of(t)
                width = None if view is None else _rows_width(t, view)
        target = rule.in_place and i == 0
        if owner is gather:
            if width is None or view.tensor.shape[:-1] != lead:
                return None, f"it reads {tensor_str(t)} of the gather, not as its rows"
            if target and (width or not view.derived):
                return None, "it writes the gathered tensor itself in place"
            if target and _read_whole(gather, view):
                return None, "it writes in place rows that a matmul or a reduction over the rows already reads"
            kind = Kind.PIECE if view is gather.views[0] else Kind.ROWS
            operands.append(RowOperand(kind, view.tensor, view, width=width or None))
            continue
        if isinstance(owner, PendingGather):
            view = owner.view_of(t)
            if (
                view is owner.views[0]
                and geometry.dim == 0
                and not target
                and whole_args is None
                and _rows_view(t, view)
                and view.tensor.shape[:-1] == lead
                and owner.group.size() == gather.group.size()
            ):
                operands.append(RowOperand(Kind.OTHER, view.tensor, other=owner))
                reads_other_gather = True
                continue
        if owner is not None:  # a product, or another gather's tensor in another shape: made first
            engine.complete_owners([t], func, f"read ${store.tid_of(t)} beside the rows of all_gather ${gather.tid}")
        if target:
            return None, "it writes a tensor that is not rows of the gather in place"
        if leading_ones(t):
            operands.append(RowOperand(Kind.WHOLE, _snapshot(t.reshape(t.shape[-1]) if t.dim() else t)))
        elif t.shape[:-1] == program_lead:
            operands.append(RowOperand(Kind.ROWS, t.reshape(*lead, t.shape[-1])))
        else:
            return None, f"its operand {tensor_str(t)} is broadcast along some rows only"
    windowed = rule.window is not None and rule.window(args)
    if windowed and (why := why_not_windowed(operands)) is not None:
        return None, why
    # NB: the shapes and dtypes of the results from the meta kernels (the mode
    # is off while it handles an op: these calls do not come back to it).
    try:
        row_meta = _meta_results(func, row_args, kwargs) if row_args is not None else []
        whole_meta = _meta_results(func, whole_args, kwargs) if whole_args is not None else []
    except Exception:  # noqa: BLE001 - plain eager raises its own error for these arguments
        return None, "plain eager rejects its arguments"
    row_results = rule.row_results or tuple(range(len(row_meta)))
    for i in row_results if not rule.in_place else ():
        r = row_meta[i]
        if r is not None and (not r.is_contiguous() or r.dim() == 0 or r.shape[:-1] != program_lead):
            return None, f"its result {tensor_str(r)} is not rows of the gather"
    results: list[torch.Tensor | None] = [None] * max(len(row_meta), len(whole_meta))
    views: list[GatheredView | None] = [None] * len(row_meta)
    if not rule.in_place:
        for i in row_results:
            r = row_meta[i]
            if r is None:
                continue
            out = engine.placeholder(program_rows, r.shape, r.dtype)
            results[i] = out
            views[i] = GatheredView(
                out.view(*lead, r.shape[-1]), geometry.dim, geometry.world, store.next_tid(), derived=True
            )
    made = [v for v in views if v is not None]
    step = None
    if row_args is not None and (rule.in_place or made):
        every_result_rows = not rule.in_place and not windowed and None not in views
        step = RowwiseStep(
            func, template, operands, views, geometry, store.next_tid(),
            in_place=rule.in_place, windowed=windowed, out=OUT_VARIANTS.get(func._op) if every_result_rows else None,
        )
    whole = None
    if whole_args is not None:
        outputs = [
            None if r is None or (row_args is not None and i in row_results) else engine.placeholder(program_rows, r.shape, r.dtype)
            for i, r in enumerate(whole_meta)
        ]
        for i, out in enumerate(outputs):
            if out is not None:
                # NB: the program gets an alias, the step keeps the placeholder:
                # Note [Results over the rows, taken by autograd].
                results[i] = out.detach()
        whole_args = tuple(
            _snapshot(a) if isinstance(a, torch.Tensor) and store.owner(a) is None and leading_ones(a) else a
            for a in whole_args
        )
        whole = WholeStep(func, whole_args, kwargs, outputs, store.next_tid())
    if reads_other_gather and (func is aten.add.Tensor or func is aten.add_.Tensor):
        _note_summed_all_reduces(engine.trace, gather, operands)
    store.add_rowwise(gather, step, made, whole)
    if engine.trace.recording:
        for recorded in (step, whole):
            if recorded is not None:
                engine.trace.event(*recorded.trace_event())
    if rule.in_place:
        return args[0], None
    return (results[0] if len(results) == 1 else tuple(results)), None


def _note_summed_all_reduces(trace: Trace, gather: PendingGather, operands: list[RowOperand]) -> None:
    """An add of the gather halves of two sum-all-reduces on one group: say so
    (Note [Sums of all-reduced tensors] in eagertp.trace)."""
    record = gather.record
    if not (gather.half_of_all_reduce and record.kind == "all_reduce(sum)"):
        return
    for op in operands:
        other = op.other
        if other is not None and other.half_of_all_reduce and other.record.kind == record.kind:
            if other.record.group == record.group:
                trace.note_summed(record, other.record)


def _read_whole(gather: PendingGather, view: GatheredView) -> bool:
    """True if a consumer (or its epilogue) or a reduction over the rows
    already reads ``view`` (after the steps): an in-place step would change
    what they read."""
    from eagertp.deferred import storage_key

    key = storage_key(view.tensor)
    return any(mm.view is view or any(storage_key(t) == key for t in mm.inputs()) for mm in gather.consumers) or any(
        storage_key(t) == key for w in gather.wholes for t in w.inputs()
    )


def _rule_for(func: torch._ops.OpOverload, args: tuple, kwargs: dict, ndim: int) -> tuple[Rule | None, str | None]:
    """The table's rule for this call, or None and why it is not row-wise."""
    whys = []
    for rule in (RULES.get(func._op), WHOLE_RULES.get(func._op)):
        if rule is None:
            continue
        why = None if rule.check is None else rule.check(args, kwargs, ndim)
        if why is None:
            return rule, None
        whys.append(why)
    return None, whys[0] if whys else "it is not in eagertp's table of row-wise ops"


def defer_copy(engine: Any, dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src)`` of a result over a gather's rows (autograd's
    AccumulateGrad copying a norm's weight gradient into the parameter's
    gradient buffer): deferred as one more ``WholeStep``, ``dst`` the gather's
    until it completes. False if that is not it."""
    from eagertp.deferred import PendingGather, storage_key

    store = engine.store
    gather = store.owner(src)
    if not isinstance(gather, PendingGather) or store.owner(dst) is not None or store.readers([dst]):
        return False
    key = storage_key(src)
    made = [t for w in gather.wholes for t in w.outputs if t is not None and storage_key(t) == key]
    if (
        not made
        or src.shape != dst.shape
        or src.dtype != dst.dtype
        or src.device != dst.device
        or not src.is_contiguous()
        or src.numel() != made[0].numel()
    ):
        return False
    whole = WholeStep(aten.copy_.default, (dst, src), {}, [], store.next_tid(), writes=dst)
    store.add_rowwise(gather, None, [], whole)
    if engine.trace.recording:
        engine.trace.event("{} = copy_(${}) [when the gather completes]", Meta.of(dst), store.tid_of(src))
    return True
