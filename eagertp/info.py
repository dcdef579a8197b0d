"""What a bug report needs: ``python -m eagertp.info``.

Prints the versions (eagertp, torch, its CUDA and NCCL, Python), the devices,
the process-group backends this torch has, which of eagertp's backends can
serve collectives here and why not, and the size rule's thresholds in force.
It communicates nothing and needs no process group.
"""

from __future__ import annotations

import os
import platform
import sys

import torch
import torch.distributed as dist

import eagertp
from eagertp._format import bytes_str
from eagertp.backends import BACKENDS, KINDS, MIN_FUSE_BYTES
from eagertp.backends import symm_mem


def report() -> str:
    """The report ``python -m eagertp.info`` prints."""
    cuda = torch.cuda.is_available()
    lines = [
        f"eagertp {eagertp.__version__}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}"
        + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if cuda else "")
        + ")",
        f"Python {platform.python_version()} on {platform.platform()}",
        "",
        "devices:",
        f"  cpu: {os.cpu_count()} cores",
    ]
    if cuda:
        for i in range(torch.cuda.device_count()):
            lines.append(f"  cuda:{i}: {torch.cuda.get_device_name(i)}")
    else:
        lines.append("  cuda: not available")
    lines += ["", "process-group backends:"]
    if not dist.is_available():
        lines.append("  torch.distributed is not available in this build: eagertp cannot run")
    else:
        for name, available in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())):
            lines.append(f"  {name}: {'yes' if available else 'no'}")
    lines += ["", "eagertp backends (backend='auto' picks symm_mem for CUDA tensors where it can serve, else ring):"]
    for name in BACKENDS:
        if name == "symm_mem":
            why = symm_mem._static_reason("cuda") if cuda else "no CUDA device here (it needs CUDA tensors)"
            verdict = "can serve a group whose workspace rendezvous succeeds" if why is None else f"no: {why}"
            lines.append(f"  symm_mem: {verdict}")
        elif name == "ring":
            lines.append("  ring: any process group (point-to-point ops)")
        else:
            lines.append(f"  {name}: the plain collective, then the matmuls (an oracle)")
    lines += ["", "size rule in force (a collective whose per-rank buffer is smaller is issued as written):"]
    for device in sorted({d for d, _ in MIN_FUSE_BYTES}):
        per_kind = ", ".join(f"{kind} {bytes_str(MIN_FUSE_BYTES.get((device, kind), 0))}" for kind in KINDS)
        lines.append(f"  {device}: {per_kind}")
    return "\n".join(lines)


def main() -> None:
    sys.stdout.write(report() + "\n")


if __name__ == "__main__":
    main()
