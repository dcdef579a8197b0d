"""Where one fused call's time goes: a matmul + reduce-scatter on 2 ranks, as
the hand schedule, as eagertp's ring called alone, and as eagertp, split into
phases.

    python benchmarks/call_cost.py [--n 256 1024] [--link-rate 2gbit] [--repeats 31]

Per N (M = K = 1024, float32), timed round-robin as in ``overlap.py`` (each
sample the slowest rank's, a ``with`` block per eagertp call):

- ``hand``: ``hand_schedules.matmul_reduce_scatter`` in one piece, its buffers
  made once (the row of ``overlap.py`` the issue #14 target compares with);
- ``ring``: ``RingBackend.produce_reduce_scatter`` called alone, producing each
  chunk with ``torch.mm``: eagertp's schedule without the mode, funcol or the
  engine;
- ``eagertp``: ``funcol.reduce_scatter_single(a @ b, ...).wait()`` in the block.

Then rank 0's eagertp calls split at marks (medians, ms):

- ``enter``: the block's ``__enter__``;
- ``a @ b``: the mode defers the matmul;
- ``funcol``: funcol's Python and torch's dispatch, until eagertp's handler runs;
- ``to ring``: eagertp's handler, until the ring starts;
- ``ring``: the ring, as in ``ring``;
- ``after``: eagertp's handler after the ring (stats, explain record, trace);
- ``return``: back through torch and funcol, and the program's ``wait()``;
- ``exit``: the block's ``__exit__``.

The marks wrap eagertp's handler (``eagertp.table.HANDLERS``) and the ring's
entry point for the whole run, two clock reads each. 2 ranks only: the hand
schedule is a 2-rank one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _harness

PHASES = ("enter", "a @ b", "funcol", "to ring", "ring", "after", "return", "exit")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/call_cost.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _harness.add_common_args(parser)
    parser.add_argument("--n", type=int, nargs="+", default=[256, 1024], help="output columns to sweep")
    parser.add_argument("--m", type=int, default=1024, help="rows of the reduce-scattered matrix (and K)")
    args = parser.parse_args(argv)
    if args.world_size != 2:
        parser.error(f"--world-size {args.world_size}: call_cost.py compares with a 2-rank hand schedule; use 2")
    return args


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist

    import hand_schedules as hand
    from eagertp import EagerMicroPipeline
    from eagertp._compat import funcol_reduce_scatter
    from eagertp.backends import ring
    from eagertp.table import HANDLERS

    group = dist.group.WORLD
    marks: dict[str, float] = {}
    rs_op = torch.ops._c10d_functional.reduce_scatter_tensor.default
    handler, produce = HANDLERS[rs_op._op], ring.RingBackend.produce_reduce_scatter

    def marked(fn, start: str, stop: str):
        def call(*a):
            marks[start] = time.perf_counter()
            try:
                return fn(*a)
            finally:
                marks[stop] = time.perf_counter()

        return call

    def one_n(n: int) -> dict:
        m = k = args.m
        g = torch.Generator().manual_seed(rank)
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        half = m // 2
        out = torch.empty(half, n)
        backend = ring.RingBackend()

        def producer(c: int, buf: torch.Tensor, rows: slice) -> None:
            torch.mm(a[c * half : (c + 1) * half][rows], b, out=buf)

        def ring_alone() -> None:
            backend.produce_reduce_scatter(producer, out, group, "sum")

        pipe = EagerMicroPipeline(min_fuse_bytes=0)
        phases: dict[str, list[float]] = {p: [] for p in PHASES}

        def with_eagertp() -> None:
            t0 = time.perf_counter()
            with pipe:
                t1 = time.perf_counter()
                y = a @ b
                t2 = time.perf_counter()
                funcol_reduce_scatter(y, "sum", 0, group).wait()
                t3 = time.perf_counter()
                del y
            t4 = time.perf_counter()
            times = (t0, t1, t2, marks["handler"], marks["ring"], marks["ringed"], marks["handled"], t3, t4)
            for phase, start, stop in zip(PHASES, times, times[1:]):
                phases[phase].append(stop - start)

        fns = {"t_hand": hand.matmul_reduce_scatter(a, b, 1), "t_ring": ring_alone, "t_eagertp": with_eagertp}
        rounds: list[dict[str, float]] = []
        t = _harness.time_interleaved(fns, group, repeats=args.repeats, warmup=args.warmup, rounds=rounds)
        assert pipe.stats["matmul_reduce_scatter"] == 1, f"the reduce-scatter did not fuse: {pipe.explain()}"
        return {
            "M": m, "K": k, "N": n, **t,
            "ring/hand": _harness.ratio_spread(rounds, "t_ring", "t_hand")[1],
            "eagertp/hand": _harness.ratio_spread(rounds, "t_eagertp", "t_hand")[1],
            # rank 0's phases of the timed calls
            **{f"p_{p}": statistics.median(v[-args.repeats :]) for p, v in phases.items()},
        }

    HANDLERS[rs_op._op] = marked(handler, "handler", "handled")
    ring.RingBackend.produce_reduce_scatter = marked(produce, "ring", "ringed")
    try:
        return [one_n(n) for n in args.n]
    finally:
        HANDLERS[rs_op._op], ring.RingBackend.produce_reduce_scatter = handler, produce


def main(argv=None) -> int:
    args = parse_args(argv)
    with _harness.quiet_warnings():
        rows = _harness.run(args, _worker)
    print(
        f"call_cost: matmul + reduce-scatter, 2 ranks, gloo on {_harness.link_name(args)}, float32, "
        f"medians of {args.repeats} (ms; ratios: medians of the per-round ratios)"
    )
    ms = [dict(r, **{k: v * 1e3 for k, v in r.items() if k.startswith(("t_", "p_"))}) for r in rows]
    print(_harness.table(ms, [
        ("M", "M", "d"), ("K", "K", "d"), ("N", "N", "d"),
        ("t_hand", "hand", ".2f"), ("t_ring", "ring", ".2f"), ("t_eagertp", "eagertp", ".2f"),
        ("ring/hand", "ring/hand", ".2f"), ("eagertp/hand", "eagertp/hand", ".2f"),
    ]))
    print("rank 0's eagertp call, by phase (ms):")
    print(_harness.table(ms, [("N", "N", "d"), *((f"p_{p}", p, ".3f") for p in PHASES)]))
    _harness.write_json(args.json, {"benchmark": "call_cost", "link": _harness.link_name(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
