"""``verify=True``: every rank issues the same collective, and every fused
result equals plain eager's, or a clear error says which and where."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from eagertp._format import group_str


class VerificationError(RuntimeError):
    """``verify=True`` found a fused result that differs from plain eager."""


def check_ranks_agree(signature: str, group: dist.ProcessGroup) -> None:
    """verify=True: every rank issues the same collective, or all raise the same
    clear error (instead of mismatched messages, which gloo answers by aborting
    the process and NCCL by hanging or corrupting)."""
    signatures: list[str | None] = [None] * group.size()
    dist.all_gather_object(signatures, signature, group=group)
    if any(s != signature for s in signatures):
        per_rank = "; ".join(f"rank {r}: {s}" for r, s in enumerate(signatures))
        raise VerificationError(
            f"eagertp verify: ranks of {group_str(group)} issue different collectives at the "
            f"same point ({per_rank}). Every rank must issue the same collectives with the "
            f"same shapes in the same order."
        )


def check_equal(
    what: str, got: torch.Tensor, want: torch.Tensor, group: dist.ProcessGroup, *, exact: bool
) -> None:
    """verify=True: ``got`` equals plain eager's ``want``, or a clear error names ``what``."""
    try:
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(got, want, equal_nan=True)
    except AssertionError as e:
        # NB: torch.testing keeps its failure in a reference cycle through its
        # frames, whose f_back reaches every frame of the block below (the
        # pipeline's pending work and tensors): cleared, as nothing reads them.
        traceback.clear_frames(e.__traceback__)
        diff = (got.double() - want.double()).abs()
        rel = diff / want.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
        raise VerificationError(
            f"eagertp verify: {what} differs from plain eager on rank {group.rank()}: "
            f"max abs diff {diff.max().item():.3g}, max rel diff {rel.max().item():.3g}. "
            f"Run with backend='reference' to take eagertp's pipeline out of the picture, "
            f"and report this with the shapes above."
        ) from None
