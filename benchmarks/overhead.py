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
reduce-scatter costs. Every pass of every variant is interleaved with the
others in a new order each round; ``eagertp/empty`` is the median of the
per-round ratios. ``bare mode`` is an empty mode without the Dynamo wrapper
that TorchDispatchMode adds and eagertp does without: ``eagertp/bare`` is the
cost of eagertp's own Python per op. The JSON's top-level keys are the mixed
stream's.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagertp import EagerMicroPipeline


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class BareEmptyMode(TorchDispatchMode):
    """An empty mode without the Dynamo wrapper TorchDispatchMode puts around
    every subclass's dispatch, which eagertp's mode does without (Note [Dispatch
    without Dynamo's wrapper] in eagertp/mode.py): eagertp over this one is the
    cost of eagertp's own Python."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

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


def sample(stream, context, n_ops: int, x: torch.Tensor, w: torch.Tensor) -> float:
    """Seconds per op of one pass of ``stream`` inside ``context``."""
    start = time.perf_counter()
    with context():
        stream(n_ops, x, w)
    return (time.perf_counter() - start) / n_ops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="ops per sample")
    parser.add_argument("--repeats", type=int, default=9, help="samples per variant and round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (samples per variant: rounds x repeats)")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import contextlib

    # Interleave everything so that machine noise hits all alike.
    contexts = {
        "t_none": contextlib.nullcontext,
        "t_empty_mode": EmptyMode,
        "t_bare_mode": BareEmptyMode,
        "t_eagertp": EagerMicroPipeline,
        # Every matmul deferred (no size rule): what a matmul large enough to
        # feed a fused reduce-scatter costs in Python.
        "t_eagertp_defer_all": functools.partial(EagerMicroPipeline, min_fuse_bytes=0),
    }
    # NB: one pass of each variant after another, in a new order every time, so
    # that the machine's drift (other tenants, frequency) lands on all alike;
    # ratios are taken per pass set and their median reported.
    variants = [(name, key) for name in STREAMS for key in contexts]
    samples = {v: [] for v in variants}
    rng = random.Random(0)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    for i in range(2 + args.rounds * args.repeats):  # the first two: warm-up
        rng.shuffle(variants)
        for name, key in variants:
            t = sample(STREAMS[name], contexts[key], args.ops, x, w)
            if i >= 2:
                samples[name, key].append(t)
    results = {name: {key: statistics.median(samples[name, key]) for key in contexts} for name in STREAMS}
    for name, r in results.items():
        for key, base in [("t_eagertp", "t_empty_mode"), ("t_eagertp_defer_all", "t_empty_mode"), ("t_eagertp", "t_bare_mode")]:
            paired = [a / b for a, b in zip(samples[name, key], samples[name, base])]
            r[f"ratio_{key[2:]}_over_{base[2:]}"] = statistics.median(paired)
    n = args.rounds * args.repeats
    print(f"overhead: per-op cost of a stream of {args.ops} small ops, median of {n} interleaved samples")
    print(
        f"  {'stream':<12} {'no mode':>9} {'empty mode':>11} {'eagertp':>9} {'eagertp/empty':>14}"
        f" {'deferring all':>14} {'/empty':>7} {'bare mode':>10} {'eagertp/bare':>13}"
    )
    for name, r in results.items():
        print(
            f"  {name:<12} {r['t_none'] * 1e6:7.2f}us {r['t_empty_mode'] * 1e6:9.2f}us "
            f"{r['t_eagertp'] * 1e6:7.2f}us {r['ratio_eagertp_over_empty_mode']:13.2f}x "
            f"{r['t_eagertp_defer_all'] * 1e6:12.2f}us {r['ratio_eagertp_defer_all_over_empty_mode']:6.2f}x "
            f"{r['t_bare_mode'] * 1e6:8.2f}us {r['ratio_eagertp_over_bare_mode']:12.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results["mixed"], "streams": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
