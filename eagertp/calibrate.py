"""Measure the size rule's thresholds on your own group, device and link.

The defaults in ``eagertp.backends.MIN_FUSE_BYTES`` were measured on 2-core
CPU machines over gloo (CUDA: not measured). Where fusing starts to pay depends
on the link, the device and the ranks, so measure it where you run::

    >>> cal = calibrate_min_fuse_bytes(tp_group, device="cuda")   # on every rank
    >>> print(cal.render())
    >>> with EagerMicroPipeline(group=tp_group, min_fuse_bytes=cal.min_fuse_bytes):
    ...     train_step()

(or, for every pipeline in the process, ``MIN_FUSE_BYTES["cuda", kind] = nbytes``
for each kind).

For each kind and per-rank size S (a ladder of powers of two), it times, on
every rank and interleaved, the program the size rule governs issued as
written and fused: an all-gather of an ``[r, K]`` shard consumed by a
``[K, K]`` matmul, an ``[W*r, K] @ [K, K]`` matmul reduce-scattered to
``[r, K]``, with ``r * K`` elements = S bytes, and that matmul all-reduced,
then the residual add and the norm before the next matmul (TP without
sequence parallel). A sample's time is the slowest
rank's; medians decide. The threshold is the smallest S from which fusing is no
slower (within ``tolerance``, 3%) at every larger S measured. Every rank must
call it at the same point (it issues collectives), and every rank gets the same
answer.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed._functional_collectives as funcol

from eagertp._compat import funcol_all_gather, funcol_reduce_scatter
from eagertp._format import dtype_str, group_str
from eagertp.backends import KINDS
from eagertp.pipeline import EagerMicroPipeline

__all__ = ["Calibration", "calibrate_min_fuse_bytes", "time_round_robin"]

DEFAULT_SIZES = tuple(1 << p for p in range(16, 25))  # 64 KiB .. 16 MiB per rank


@dataclasses.dataclass
class Calibration:
    """What ``calibrate_min_fuse_bytes`` measured and concluded."""

    min_fuse_bytes: dict[str, int]  # per kind: the size rule's threshold
    table: list[dict]  # per kind and size: t_plain, t_fused (seconds, medians)
    where: str  # group, device, dtype, K

    def render(self) -> str:
        lines = [f"size rule calibration on {self.where} (ms, medians; slowest rank)"]
        lines.append(f"  {'kind':<15}{'bytes/rank':>12}{'as written':>12}{'fused':>9}{'ratio':>7}")
        for r in self.table:
            lines.append(
                f"  {r['kind']:<15}{r['nbytes']:>12}{r['t_plain'] * 1e3:>12.3f}{r['t_fused'] * 1e3:>9.3f}"
                f"{r['t_plain'] / r['t_fused']:>6.2f}x"
            )
        lines += [f"  min_fuse_bytes[{kind!r}] = {nbytes}" for kind, nbytes in self.min_fuse_bytes.items()]
        return "\n".join(lines)


def calibrate_min_fuse_bytes(
    group: dist.ProcessGroup | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    k: int = 1024,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
    warmup: int = 2,
    tolerance: float = 0.03,
) -> Calibration:
    """Measure where fusing starts to pay on ``group`` (default: the world)
    for tensors on ``device``; see the module docstring. Fused counts as no
    slower within ``tolerance`` (a fraction of the time issued as written)."""
    group = group if group is not None else dist.group.WORLD
    device = torch.device(device)
    element = torch.empty((), dtype=dtype).element_size()
    if not sizes or any(s < k * element or s % (k * element) for s in sizes):
        raise ValueError(
            f"calibrate_min_fuse_bytes: every size must be a positive multiple of one row, "
            f"k * element size = {k * element} bytes for k={k} and {dtype_str(dtype)}; got sizes={list(sizes)}"
        )
    world = group.size()
    b = torch.randn(k, k, dtype=dtype, device=device) / k**0.5
    plain = EagerMicroPipeline(group=group, min_fuse_bytes=1 << 62)  # issues everything as written
    fused = EagerMicroPipeline(group=group, min_fuse_bytes=0)
    table: list[dict] = []
    for kind in KINDS:
        for nbytes in sorted(sizes):
            rows = nbytes // (k * element)
            if kind == "all_gather":
                x = torch.randn(rows, k, dtype=dtype, device=device)

                def program(x=x) -> None:
                    funcol_all_gather(x, 0, group) @ b
            elif kind == "reduce_scatter":
                x = torch.randn(world * rows, k, dtype=dtype, device=device)

                def program(x=x) -> None:
                    funcol_reduce_scatter(x @ b, "sum", 0, group).wait()
            else:
                x = torch.randn(world * rows, k, dtype=dtype, device=device)
                residual = torch.randn(world * rows, k, dtype=dtype, device=device)

                def program(x=x, residual=residual) -> None:
                    # As TP without sequence parallel runs it: the residual add
                    # and the norm read the all-reduced tensor before the next
                    # matmul (fused, they run row by row on its gather half).
                    h = residual + funcol.all_reduce(x @ b, "sum", group)
                    F.layer_norm(h, (k,)) @ b

            fns = [_inside(plain, program), _inside(fused, program)]
            times = time_round_robin(fns, group, device=device, repeats=repeats, warmup=warmup)
            assert fused.stats[_FUSED[kind]] == 1 and plain.stats[f"unfused_{kind}"] == 1, (
                f"calibration of {kind} at {nbytes} bytes did not run both paths: {fused.explain()}"
            )
            table.append({"kind": kind, "nbytes": nbytes, "t_plain": times[0], "t_fused": times[1]})
    thresholds = {kind: _threshold([r for r in table if r["kind"] == kind], tolerance) for kind in KINDS}
    where = f"{group_str(group)}, {device.type}, {dtype_str(dtype)}, k={k}"
    return Calibration(thresholds, table, where)


_FUSED = {"all_gather": "all_gather_matmul", "reduce_scatter": "matmul_reduce_scatter", "all_reduce": "matmul_all_reduce"}


def _inside(pipe: EagerMicroPipeline, program: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with pipe:
            program()

    return run


def time_round_robin(
    fns: Sequence[Callable[[], object]],
    group: dist.ProcessGroup,
    *,
    device: str | torch.device = "cpu",
    repeats: int,
    warmup: int,
    rounds: list[list[float]] | None = None,
) -> list[float]:
    """Per function, the median over samples of the slowest rank's seconds.

    Every sample is taken on all ranks between barriers (CUDA work is waited
    for). Round ``i`` runs every function once, in an order shuffled anew each
    round, so that drift on a shared machine lands on all of them alike and
    their ratios stay meaningful. All ranks must call it together. ``rounds``,
    if given, receives each timed round's samples (one per function, in the
    order of ``fns``), for ratios taken within a round.
    """
    if repeats < 1:
        raise ValueError(f"time_round_robin: repeats={repeats}; the medians need at least one timed round")
    device = torch.device(device)
    timed: list[list[float]] = []  # per timed round, one sample per function
    for i in range(warmup + repeats):
        this_round = [0.0] * len(fns)
        # NB: a new order each round, the same on every rank (seeded by the
        # round): drift hits all alike, and no function always follows the same
        # one (a shaped link's token bucket refills behind a transfer-free one).
        order = list(range(len(fns)))
        random.Random(i).shuffle(order)
        for f in order:
            dist.barrier(group=group)
            start = time.perf_counter()
            fns[f]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            this_round[f] = elapsed.item()
        if i >= warmup:
            timed.append(this_round)
    if rounds is not None:
        rounds.extend(timed)
    return [statistics.median(samples) for samples in zip(*timed)]


def _threshold(rows: list[dict], tolerance: float) -> int:
    """The smallest measured size from which fused is no slower (within
    ``tolerance``) at every larger one; past the largest measured size if even
    that one was slower."""
    threshold = 2 * rows[-1]["nbytes"]
    for r in reversed(rows):
        if r["t_fused"] > r["t_plain"] * (1 + tolerance):
            break
        threshold = r["nbytes"]
    return threshold
