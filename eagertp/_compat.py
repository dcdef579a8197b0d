"""What differs between the torch releases eagertp supports (>= 2.11), and
what works around torch itself.

Newer torch renames ``*_into_tensor`` / ``*_tensor`` collectives to ``*_single``
and deprecates the old names; use the new one where it exists.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# funcol's, same arguments: (tensor, gather_dim, group) and (tensor, reduce_op, scatter_dim, group).
funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
# Which ops funcol's AsyncCollectiveTensor rewraps (views), private to funcol: where a
# torch lacks it, every op counts as one and takes the wrapper's own path
# (Note [Pending async tensors] in eagertp.mode).
funcol_is_view_op = getattr(funcol, "_is_view_op", lambda func: True)
# The address of a tensor's StorageImpl, from C (no Python storage object); a
# torch without it reads the same address off the storage object.
storage_id = getattr(torch._C, "_storage_id", None) or (lambda t: t.untyped_storage()._cdata)


@functools.cache
def cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """CPU ``_scaled_mm`` takes row-wise scales from torch 2.12; 2.11's takes
    tensor-wise ones only (CUDA takes both on every supported release). For
    the tests and the GPU check's CPU dry run, whose plain-eager references
    need it."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def exit_spawned_rank(code: int) -> NoReturn:
    """End a rank process (spawned, or launched by torchrun) whose work is done,
    without finalising Python.

    NB: torch's, not eagertp's. After a funcol collective on a gloo group
    (plain eager, no mode at all; torch 2.13), ``destroy_process_group``
    leaves the group alive (referenced from outside Python's garbage
    collector), so its gloo threads run on to the interpreter's exit. A run
    of a short benchmark once in about 40 aborted there ("terminate called
    without an active exception"): a gloo thread freed a barrier's Work that
    needs the GIL while Python finalised. eagertp holds no group past a
    block, and its own gloo group ends with the user's (Note [eagertp's own
    connections] in eagertp.backends.ring); scripts that return normally are
    tested in tests/test_exit.py. The demo and the benchmarks, run in CI and
    in loops, still leave this way after teardown, with the rank's results
    handed over, as multiprocessing's forked children do.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
