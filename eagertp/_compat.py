"""What differs between the torch releases eagertp supports (>= 2.11), and
what works around torch itself.

Newer torch renames ``*_into_tensor`` / ``*_tensor`` collectives to ``*_single``
and deprecates the old names; use the new one where it exists.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

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


def exit_spawned_rank(code: int) -> NoReturn:
    """End a rank process (spawned, or launched by torchrun) whose work is done,
    without finalising Python.

    NB: once a dispatch mode has run in a process (any TorchDispatchMode, seen
    on torch 2.13), ``destroy_process_group`` leaves the gloo group's threads
    running. At interpreter exit one of them may then free a finished Work that
    holds a Python tensor, needs the GIL, and the process aborts with
    "terminate called without an active exception" (about 1 run in 40 of a
    short benchmark). Called after ``destroy_process_group``, with the rank's
    results already handed over, this skips finalisation as multiprocessing's
    forked children do.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
