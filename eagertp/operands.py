"""How a matmul meets the pending work it reads: its output dtype, and which
gather in flight it consumes and how (Note [Matmul operands of a gather] in
eagertp.deferred), with its row-wise scale's gather (Note [Gathered row-wise
scales]); or why it cannot."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from eagertp._format import tensor_str
from eagertp.deferred import GatheredView, Operand, PendingGather, PendingStore, Scaled, storage_key


def match_gather_operand(
    store: PendingStore, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scaled: Scaled | None = None
) -> tuple[PendingGather | None, GatheredView | None, Operand | None, PendingGather | None, str | None]:
    """Which gather in flight a matmul consumes and how, and the gather in
    flight its row-wise ``scale_a`` comes from, if any; or why it cannot."""
    found_a, found_b = store.gathered_view_of(a), store.gathered_view_of(b)
    if found_a is None and found_b is None:
        return None, None, None, None, None
    if found_a is not None and found_b is not None:
        return None, None, None, None, "reads pending gathers as both operands"
    gather, view = found_a or found_b
    g = a if found_a is not None else b
    if g.numel() == 0:
        return None, None, None, None, "reads an empty gathered tensor: there is nothing to overlap"
    if g.element_size() != view.tensor.element_size():
        return None, None, None, None, (
            f"reads the gathered {tensor_str(view.tensor)} as {tensor_str(g)}, another element size"
        )
    if found_a is not None and view.is_rows(a):
        operand = Operand.ROWS
    elif found_a is not None and view.is_rows(a.t()):
        operand = Operand.ROWS_T
    elif found_a is not None and view.is_cols(a):
        operand = Operand.COLS
    elif found_b is not None and view.is_rows(b):
        operand = Operand.B_ROWS
    else:
        return None, None, None, None, (
            f"reads the gathered tensor (gather dim {view.dim}) as {tensor_str(g)} with strides "
            f"{g.stride()}, which does not split into per-rank blocks"
        )
    if scaled is not None and operand is not Operand.ROWS:
        return None, None, None, None, (
            f"is a scaled (FP8) matmul reading the gathered tensor as {operand.value}: only A rows fuse"
        )
    if g.dtype != view.tensor.dtype and operand is not Operand.ROWS:
        return None, None, None, None, f"reads the gathered {tensor_str(view.tensor)} as {g.dtype} in a contraction"
    scale_gather, own_scale = None, False
    if scaled is not None and store.touched([scaled.scale_a]) is not None:
        own_scale = _rows_of_own_gather(gather, view, a, scaled.scale_a)
        if not own_scale:
            scale_gather, why_not = _match_scale_gather(store, gather, view, a, scaled.scale_a)
            if why_not is not None:
                return None, None, None, None, why_not
    skip = scaled.scale_a if scale_gather is not None or own_scale else g  # NB: a scale_a read as gathered rows
    others = []
    for t in (a, b, bias, *scaled.tensors()) if scaled is not None else (a, b, bias):  # NB: a loop: every matmul
        if t is not None and t is not g and t is not skip:
            others.append(t)
    if store.touched(others) is not None:
        if gather in store.owners(others):
            return None, None, None, None, "has a second pending operand of the same gather"
        return gather, None, None, None, OTHER_PENDING_OPERAND
    return gather, view, operand, scale_gather, None


# ``match_gather_operand``'s answer (with the gather) for a matmul on a gather
# in flight whose other operands are pending work of other items: the caller
# completes those (plain eager made them before this matmul: a product, or
# another gather with its consumers) and matches again, the gather still in
# flight. A weight gradient whose output gradient is itself a matmul's, two
# linears with nothing between them (a checkpointed SP layer's recompute
# gathers the input again while the output gradient's gather is pending).
OTHER_PENDING_OPERAND = "reads other pending work beside the gathered tensor"


def _match_scale_gather(
    store: PendingStore, gather: PendingGather, view: GatheredView, a: torch.Tensor, scale_a: torch.Tensor
) -> tuple[PendingGather | None, str | None]:
    """The gather in flight whose whole placeholder is the row-wise
    ``scale_a`` [M, 1] of a scaled matmul on rows ``a`` of ``view``, split by
    rank as A's rows are; or None and why not (Note [Gathered row-wise scales])."""
    found = store.gathered_view_of(scale_a)
    if found is None or found[0] is gather:
        return None, None  # a pending product (made first: OTHER_PENDING_OPERAND), or A's own gather
    scale_gather, scale_view = found
    what = f"reads its row-wise scale_a {tensor_str(scale_a)} from all_gather #{scale_gather.record.index}"
    if scale_gather.group.group_name != gather.group.group_name:
        return None, f"{what}, on another group than A's ({scale_gather.record.group})"
    if gather.scale_of or scale_gather.scale_gathers():
        return None, f"{what}, and one of the two gathers is already another matmul's gathered scale"
    if not _scale_rows_of(scale_a, scale_view, a):
        return None, f"{what}, not as the whole gathered tensor seen as A's rows [{a.shape[0]}, 1]"
    # Rank i's scale shard, flattened, must be the scales of rank i's data
    # shard's rows, in order: the same gather dim and leading dims, one
    # scale per row, and A's rows the gathered rows.
    if (
        scale_view.dim != view.dim
        or scale_view.tensor.shape[:-1] != view.tensor.shape[:-1]
        or scale_view.tensor.shape[-1] != 1
        or a.shape[1] != view.tensor.shape[-1]
    ):
        return None, (
            f"{what} (gathered along dim {scale_view.dim}, {tensor_str(scale_view.tensor)}), whose rows per "
            f"rank do not follow A's (gathered along dim {view.dim}, {tensor_str(view.tensor)})"
        )
    return scale_gather, None


def _rows_of_own_gather(gather: PendingGather, view: GatheredView, a: torch.Tensor, scale_a: torch.Tensor) -> bool:
    """True if a scaled matmul on rows ``a`` of ``view`` takes its row-wise
    ``scale_a`` [M, 1] from a derived view of the same gather, with the same
    rows: float8's row-wise quantization of the gathered rows, whose steps
    make each chunk's scales before the matmul reads them (Note [Row-wise ops
    on gathered rows] in eagertp.rowwise); ``PendingMatmul.compute`` selects
    them with A's rows."""
    found = gather.view_of(scale_a)
    return (
        found is not None
        and found.derived
        and found.dim == view.dim
        and found.tensor.shape[:-1] == view.tensor.shape[:-1]
        and a.shape[0] == math.prod(view.tensor.shape[:-1])
        and _scale_rows_of(scale_a, found, a)
    )


def _scale_rows_of(scale_a: torch.Tensor, view: GatheredView, a: torch.Tensor) -> bool:
    """True if ``scale_a`` is the whole of ``view`` seen as one scale per row
    of ``a``: ``[a.shape[0], 1]``, contiguous."""
    return (
        scale_a.shape == (a.shape[0], 1)
        and scale_a.is_contiguous()
        and scale_a.storage_offset() == view.tensor.storage_offset()
        and scale_a.numel() == view.tensor.numel()
    )


def same_views(tensors: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
    """True if ``tensors`` are exactly the views ``expected``: the same storage,
    offsets, shapes and strides."""
    if len(tensors) != len(expected):
        return False
    for t, e in zip(tensors, expected):  # NB: a loop: every cat of pending work
        if (
            t.shape != e.shape
            or t.stride() != e.stride()
            or t.storage_offset() != e.storage_offset()
            or storage_key(t) != storage_key(e)
        ):
            return False
    return True


def matmul_out_dtype(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scaled: Scaled | None
) -> tuple[torch.dtype | None, str]:
    """The output dtype of the matmul, or None and why if these operands do not
    defer (plain eager rejects them, or, for FP8, its meta kernel does)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or b.device != a.device:
        return None, f"{tensor_str(a)} @ {tensor_str(b)}"
    if scaled is not None:
        # FP8 rules (dtypes, layouts, scale shapes, alignment) are many: ask the
        # meta kernel, which applies CUDA's (stricter than CPU's).
        try:
            meta = torch._scaled_mm(
                *(t.to("meta") for t in (a, b, scaled.scale_a, scaled.scale_b)),
                bias=None if bias is None else bias.to("meta"),
                scale_result=None if scaled.scale_result is None else scaled.scale_result.to("meta"),
                out_dtype=scaled.out_dtype,
                use_fast_accum=scaled.use_fast_accum,
            )
        except (RuntimeError, ValueError, NotImplementedError) as e:
            return None, f"_scaled_mm's meta kernel: {str(e).splitlines()[0]}"
        return meta.dtype, ""
    if b.dtype != a.dtype or (bias is not None and (bias.dtype != a.dtype or bias.device != a.device)):
        return None, "mixed dtypes or devices"
    if bias is None:
        return a.dtype, ""
    out_shape = (a.shape[0], b.shape[1])
    try:
        if torch.broadcast_shapes(bias.shape, out_shape) == out_shape:
            return a.dtype, ""
    except RuntimeError:
        pass
    return None, f"bias {tensor_str(bias)} does not broadcast to {list(out_shape)}"
