"""Short, stable renderings of tensors and groups for traces and error messages."""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPE_ABBREVIATIONS = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.float8_e4m3fn: "f8e4m3",
    torch.float8_e5m2: "f8e5m2",
}


def dtype_str(dtype: torch.dtype) -> str:
    return _DTYPE_ABBREVIATIONS.get(dtype, str(dtype).removeprefix("torch."))


def tensor_str(t: torch.Tensor) -> str:
    """``f32[8, 32]``: dtype and shape, never an address."""
    return f"{dtype_str(t.dtype)}{list(t.shape)}"  # NB: on the hot path; list's repr is the format


def group_str(group: dist.ProcessGroup) -> str:
    """``group '3' (2 ranks)``: the c10d group name, stable within one program."""
    return f"group {group.group_name!r} ({group.size()} ranks)"


def bytes_str(n: int) -> str:
    """``1 MiB``, ``512 KiB``, ``1.5 KiB``, ``0 B``."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
