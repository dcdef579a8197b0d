"""Pass-through overhead: the per-op cost of a stream of small non-distributed
ops with no mode, with an empty TorchDispatchMode, and with EagerMicroPipeline.

    python benchmarks/overhead.py [--ops 2000] [--repeats 15] [--json out.json]

Single process: no collective is involved, so this is pure dispatch cost. Two
streams, timed interleaved in one run: ``mixed`` (elementwise ops, views, a
reduction and one small matmul per 8 ops) and ``elementwise`` (the same without
the matmul: pure pass-through). eagertp runs matmuls this small at once (no
reduce-scatter of them could fuse: Note [Deferral boundary]); the "deferring
all" column (``min_fuse_bytes=0``) defers every matmul until the next op shows
what it feeds, which is what each matmul large enough to feed a fused
reduce-scatter costs. The JSON's top-level keys are the mixed stream's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagertp import EagerMicroPipeline


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def mixed(n_ops: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """About ``n_ops`` dispatched ops: 8 per iteration, one of them a matmul."""
    for _ in range(n_ops // 8):
        y = x @ w  # mm
        y = y.relu()  # reads the matmul
        y = y.view(-1).view(x.shape)  # views
        y = y * 0.5 + x  # mul, add
        x = y - y.mean()  # mean, sub
    return x


def elementwise(n_ops: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``mixed`` with an add in place of the matmul."""
    for _ in range(n_ops // 8):
        y = x + w
        y = y.relu()
        y = y.view(-1).view(x.shape)
        y = y * 0.5 + x
        x = y - y.mean()
    return x


STREAMS = {"mixed": mixed, "elementwise": elementwise}


def measure(stream, context, n_ops: int, repeats: int) -> float:
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    samples = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        with context():
            stream(n_ops, x, w)
        if i >= 2:  # warm-up
            samples.append((time.perf_counter() - start) / n_ops)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="ops per sample")
    parser.add_argument("--repeats", type=int, default=9, help="samples per round (median)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, each timing every variant in turn (median)")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import contextlib

    # Interleave everything so that machine noise hits all alike.
    contexts = {
        "t_none": contextlib.nullcontext,
        "t_empty_mode": EmptyMode,
        "t_eagertp": EagerMicroPipeline,
        # Every matmul deferred (no size rule): what a matmul large enough to
        # feed a fused reduce-scatter costs in Python.
        "t_eagertp_defer_all": functools.partial(EagerMicroPipeline, min_fuse_bytes=0),
    }
    samples = {(name, key): [] for name in STREAMS for key in contexts}
    for _ in range(args.rounds):
        for name, stream in STREAMS.items():
            for key, context in contexts.items():
                samples[name, key].append(measure(stream, context, args.ops, args.repeats))
    results = {name: {key: statistics.median(samples[name, key]) for key in contexts} for name in STREAMS}
    print(f"overhead: per-op cost of a stream of {args.ops} small ops, median of {args.rounds} rounds")
    print(
        f"  {'stream':<12} {'no mode':>9} {'empty mode':>11} {'eagertp':>9} {'eagertp/empty':>14}"
        f" {'deferring all':>14} {'/empty':>7}"
    )
    for name, r in results.items():
        ratio = r["t_eagertp"] / r["t_empty_mode"]
        ratio_all = r["t_eagertp_defer_all"] / r["t_empty_mode"]
        print(
            f"  {name:<12} {r['t_none'] * 1e6:7.2f}us {r['t_empty_mode'] * 1e6:9.2f}us "
            f"{r['t_eagertp'] * 1e6:7.2f}us {ratio:13.2f}x {r['t_eagertp_defer_all'] * 1e6:12.2f}us {ratio_all:6.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results["mixed"], "streams": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
