"""Matmuls and the ops around them: deferred so that a gather in flight can
feed them chunk by chunk, or so that a reduce-scatter can produce from them
(Note [Deferral boundary])."""

from __future__ import annotations

import math

import torch

from eagertp.deferred import Epilogue, Operand, PendingGather, PendingMatmul, Product, Scaled, operand_str
from eagertp.engine import Engine
from eagertp.operands import same_views
from eagertp.table import register

aten = torch.ops.aten


# NB: mm's handler is the engine's own method, called with mm's arguments as
# they come (its operands are ``args``): every matmul of a program, one frame
# shorter than a handler that calls it.
register([aten.mm.default])(Engine.defer_matmul)


@register([aten.addmm.default])
def _addmm(engine: Engine, func, args, kwargs):
    bias, a, b = args
    return engine.defer_matmul(func, args, kwargs, a, b, bias)


_SCALED_MM_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")


@register([aten.linear.default, aten.matmul.default])
def _whole_matmul(engine: Engine, func, args, kwargs):
    """``linear`` and ``matmul`` whole: they reach the mode so only where
    autograd is off (``inference_mode``). Decomposed, so that their mm or addmm
    defers as it does in training: a reduce-scatter or all-reduce of its output
    fuses (TP inference: HF ``generate`` under ``inference_mode``), and a gather
    in flight feeds it. While nothing is pending, one whose product could not
    be deferred (batched, or too small for the size rule: a decode step's
    projections on CPU) runs whole, as one op."""
    if not engine.store.items:
        a, b = args[0], args[1]
        if a.dim() < 2 or b.dim() != 2:  # a matrix-vector or batched product: never deferred
            return func._op(*args, **kwargs)
        cols = b.shape[0] if func is aten.linear.default else b.shape[1]  # weight [N, K]; b [K, N]
        if engine.never_fused(a.numel() // max(a.shape[-1], 1), cols, a.device):
            return func._op(*args, **kwargs)
    return engine.decompose(func, args, kwargs)


@register([aten.einsum.default])
def _einsum(engine: Engine, func, args, kwargs):
    """``einsum`` whole (``inference_mode``, as ``linear`` above): decomposed,
    so that a linear it writes runs as a ``bmm`` that defers as an mm
    (``_as_mm``), unless nothing is pending and its output is too small for
    any collective of it to fuse."""
    if not engine.store.items:
        equation, operands = args[0], args[1]
        out = _einsum_out_numel(equation, operands)
        if out is not None and operands and engine.never_fused(out, 1, operands[0].device):
            return func._op(*args, **kwargs)
    return engine.decompose(func, args, kwargs)


def _einsum_out_numel(equation: str, operands: list[torch.Tensor]) -> int | None:
    """The number of elements ``einsum(equation, *operands)`` makes, for an
    explicit equation without ellipsis; None for any other."""
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if not arrow or "." in equation or len(terms) != len(operands):
        return None
    sizes = {letter: size for term, t in zip(terms, operands) for letter, size in zip(term, t.shape)}
    return math.prod(sizes.get(letter, 1) for letter in output)


@register([aten._scaled_mm.default])
def _scaled_mm(engine: Engine, func, args, kwargs):
    """FP8 linears (float8 training): fused like mm, the scales riding along."""
    bound = {**dict(zip(_SCALED_MM_ARGS, args)), **kwargs}
    scaled = Scaled(
        bound["scale_a"],
        bound["scale_b"],
        bound.get("scale_result"),
        bound.get("out_dtype"),
        bool(bound.get("use_fast_accum", False)),
    )
    return engine.defer_matmul(func, args, kwargs, bound["self"], bound["mat2"], bound.get("bias"), scaled)


@register([aten.bmm.default, aten.baddbmm.default])
def _batched(engine: Engine, func, args, kwargs):
    """Attention's batched matmuls: never deferred, but work that overlaps the
    gathers in flight (Note [Overlap accounting]). A ``bmm`` that is a matmul
    in disguise is deferred as that matmul (``_as_mm``)."""
    if func is aten.bmm.default and not kwargs:
        as_mm = _as_mm(*args)
        if as_mm is not None:
            a, b, shape = as_mm
            return engine.defer_matmul(aten.mm.default, (a, b), {}, a, b).view(*shape)  # NB: sizes apart (3-d)
    if engine.store.items:
        engine.complete_for(func, args, kwargs)
    return engine.run_matmul(func, args, kwargs)


def _as_mm(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Size] | None:
    """``bmm(a, b)`` as ``mm(a2, b2).view(shape)``, where it is one: a batch of
    one (``torch.einsum`` writes a linear so, ``[1, B*S, K] @ [1, K, N]``), or
    the same matrix ``b`` for every batch (``torch.matmul`` of a 3-D input it
    cannot fold into rows, with a weight that does not require grad, broadcasts
    it with stride 0) and rows of ``a`` that view as ``[B*M, K]``. Then a
    collective of its output, or a gather it reads, fuses as for ``mm``."""
    batch, m, k = a.shape
    n = b.shape[2]
    if batch == 1:
        return a[0], b[0], torch.Size((1, m, n))
    if b.stride(0) == 0 and (m == 1 or a.stride(0) == m * a.stride(1)):  # a's batches: consecutive blocks of rows
        return a.view(batch * m, k), b[0], torch.Size((batch, m, n))
    return None


@register([aten.add.Tensor, aten.mul.Tensor])
def _add_or_mul(engine: Engine, func, args, kwargs):
    """A sum of two pending products (autograd accumulating an input gradient),
    or a product's output multiplied or added by a tensor or a number (Note
    [Epilogues] in eagertp.deferred): deferred, so that a collective of the
    result still produces from the products."""
    if not engine.store.items:
        return func._op(*args, **kwargs)
    if len(args) == 2 and kwargs.get("alpha", 1) == 1 and (_made(engine, args[0]) or _made(engine, args[1])):
        x, y = args
        if func is aten.add.Tensor and isinstance(y, torch.Tensor):
            deferred = engine.defer_sum(x, y)
            if deferred is not None:
                return deferred
        for target, operand in ((x, y), (y, x)):
            product = _epilogue_target(engine, target, operand, kwargs, in_place=False)
            if product is not None:
                op = torch.add if func is aten.add.Tensor else torch.mul
                return engine.defer_pointwise(product, op, operand, torch.result_type(target, operand))
    return engine.run_plain(func, args, kwargs)


def _made(engine: Engine, t) -> bool:
    """True if ``t`` may be the output of a pending product, or of a matmul
    bound to a gather: what a deferred sum or epilogue starts from. Most adds
    while work is pending read neither (the residual add of gathered rows:
    Note [Row-wise ops on gathered rows] in eagertp.rowwise)."""
    if not isinstance(t, torch.Tensor):
        return False
    owner = engine.store.owner(t)
    return owner is not None and (not isinstance(owner, PendingGather) or owner.view_of(t) is None)


@register([aten._to_copy.default])
def _to_copy(engine: Engine, func, args, kwargs):
    """A dtype cast of a whole gathered tensor (autocast before a linear) becomes
    a cast view, filled chunk by chunk: the linear on it still fuses."""
    dtype = kwargs.get("dtype")
    if engine.store.items and len(args) == 1 and set(kwargs) <= _CAST_KWARGS and dtype is not None:
        (t,) = args
        if _only_changes_dtype(t, kwargs):
            found = engine.store.gathered_view_of(t)
            # NB: a derived tensor's cast is a row-wise step (Note [Row-wise ops on gathered rows]).
            if found is not None and not found[1].derived and same_views([t], [found[1].tensor]):
                return engine.defer_cast(*found, dtype)
            product = engine.store.standalone_output(t)  # only whole outputs
            if product is not None and product[1] is None:
                return engine.defer_product_cast(product[0], t, dtype)
    return engine.run_plain(func, args, kwargs)


# _to_copy's keywords a plain dtype cast may carry.
_CAST_KWARGS = frozenset({"dtype", "layout", "device", "non_blocking", "memory_format"})


def _only_changes_dtype(t: torch.Tensor, kwargs: dict) -> bool:
    """True if ``_to_copy(t, **kwargs)`` changes nothing but the dtype."""
    return (
        kwargs.get("layout", torch.strided) == torch.strided
        and torch.device(kwargs.get("device", t.device)) == t.device
        and kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format)
    )


@register([aten.cat.default])
def _cat(engine: Engine, func, args, kwargs):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if engine.store.items:
        deferred = engine.defer_chunk_cat(tensors, dim)
        if deferred is not None:
            return deferred
    return engine.run_plain(func, args, kwargs)


# In-place elementwise ops that stay with the pending matmul whose output they
# change (Note [Epilogues] in eagertp.deferred), and what each applies.
_EPILOGUES = {
    aten.mul_.Tensor: torch.Tensor.mul_,
    aten.mul_.Scalar: torch.Tensor.mul_,
    aten.add_.Tensor: torch.Tensor.add_,
    aten.add_.Scalar: torch.Tensor.add_,
}


@register(list(_EPILOGUES))
def _in_place_epilogue(engine: Engine, func, args, kwargs):
    """``out *= scale`` / ``out += bias`` on a pending matmul's whole output:
    kept with the matmul, so that its collective still produces from it."""
    if not engine.store.items:
        return func._op(*args, **kwargs)
    target, operand = args[0], args[1]
    if engine.store.owner(target) is None:  # NB: most in-place adds (autograd's sums of gradients)
        return engine.run_plain(func, args, kwargs)
    product = _bound_target(engine, target, operand, kwargs)
    if product is None:
        product = _epilogue_target(engine, target, operand, kwargs, in_place=True)
    if product is None:
        return engine.run_plain(func, args, kwargs)
    engine.store.add_epilogue(product, Epilogue(_EPILOGUES[func], operand))
    if engine.trace.recording:
        engine.trace.event("${} {}= {}", product.tid, "*" if _EPILOGUES[func] is torch.Tensor.mul_ else "+", operand_str(operand))
    return target


def _bound_target(engine: Engine, target, operand, kwargs: dict) -> PendingMatmul | None:
    """The matmul bound to a gather in flight as its rows whose whole output
    ``target`` is, if an in-place op of ``operand`` on it can stay with it,
    applied to each piece's rows (Note [Epilogues]): ``operand`` a number, a
    tensor nothing pending makes or reads, or rows the gather's row-wise steps
    make."""
    if kwargs.get("alpha", 1) != 1 or not isinstance(target, torch.Tensor):
        return None
    store = engine.store
    gather = store.owner(target)
    if not isinstance(gather, PendingGather):
        return None
    mm = gather.consumer_writing(target)
    if mm is None or mm.operand is not Operand.ROWS or not same_views([target], [mm.out]):
        return None
    if isinstance(operand, torch.Tensor):
        if operand.device != target.device or not _broadcasts_to(operand, target.shape):
            return None
        if store.owner(operand) is gather:
            view = gather.view_of(operand)
            if (
                view is None
                or not view.derived
                or not operand.is_contiguous()
                or operand.storage_offset() != view.tensor.storage_offset()
                or operand.numel() != view.tensor.numel()
                or operand.dim() != 2
                or operand.shape[0] != target.shape[0]
            ):
                return None
        elif store.touched([operand]) is not None:
            return None
    elif not isinstance(operand, (int, float)):
        return None
    if not torch.can_cast(torch.result_type(target, operand), target.dtype):
        return None  # plain eager raises its own error
    return mm


def _broadcasts_to(t: torch.Tensor, shape: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(t.shape, shape) == shape
    except RuntimeError:
        return False


def _epilogue_target(engine: Engine, target, operand, kwargs: dict, *, in_place: bool) -> Product | None:
    """The standalone pending product whose whole output ``target`` is, if an
    op of ``operand`` on it can stay with it (Note [Epilogues]): in place, a
    matmul's; out of place, any product's."""
    if kwargs.get("alpha", 1) != 1 or not isinstance(target, torch.Tensor):
        return None
    if in_place:
        engine.unbind_consumer(target, "an in-place epilogue")
    found = engine.store.standalone_output(target)
    if found is None or found[1] is not None:
        return None
    product = found[0]
    if product.absorbed or target.shape != product.out.shape or (in_place and not isinstance(product, PendingMatmul)):
        return None
    if isinstance(operand, torch.Tensor):
        if (
            engine.store.touched([operand]) is not None
            or operand.device != target.device
            or not _broadcasts_to(operand, target.shape)
        ):
            return None
    elif not isinstance(operand, (int, float)):
        return None
    if in_place and not torch.can_cast(torch.result_type(target, operand), target.dtype):
        return None  # plain eager raises its own error
    return product


