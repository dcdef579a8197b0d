"""Where one fused call's time goes: a matmul + reduce-scatter or an all-gather +
matmul on 2 ranks, as the hand schedule, as eagertp's ring called alone, and as
eagertp, split into phases; or the prefetch form, as plain eager and as
eagertp, both split.

    python benchmarks/call_cost.py [--form all_gather_matmul] [--n 256 1024] [--link-rate 2gbit] [--repeats 31]
    python benchmarks/call_cost.py --form all_gather_indep_matmul --n 1024 --link-rate 2gbit

Per N (M = K = 1024, float32), timed round-robin as in ``overlap.py`` (each
sample the slowest rank's, a ``with`` block per eagertp call):

- ``hand``: ``hand_schedules.<form>`` in the ring's pieces (the reduce-scatter's
  one, the gather's ``piece_rows``), its buffers made once (the row of
  ``overlap.py`` compares eagertp with);
- ``ring``: eagertp's ring called alone (``RingBackend.produce_reduce_scatter``
  producing each chunk with ``torch.mm``; ``start_all_gather``, then
  ``consume`` multiplying each piece): eagertp's schedule without the mode,
  funcol or the engine;
- ``eagertp``: ``funcol.reduce_scatter_single(a @ b, ...).wait()``, or
  ``y = funcol.all_gather_single(shard, ...) @ b``, in the block.

Then rank 0's eagertp calls split at marks (medians, ms). The reduce-scatter:

- ``enter``: the block's ``__enter__``;
- ``a @ b``: the mode defers the matmul;
- ``funcol``: funcol's Python and torch's dispatch, until eagertp's handler runs;
- ``to ring``: eagertp's handler, until the ring starts;
- ``ring``: the ring, as in ``ring``;
- ``after``: eagertp's handler after the ring (stats, explain record, trace);
- ``return``: back through torch and funcol, and the program's ``wait()``;
- ``exit``: the block's ``__exit__``.

The all-gather + matmul, whose matmul runs at the block's exit:

- ``enter``, ``funcol``, ``to ring``: as above;
- ``posts``: the ring's start (every message posted, Note [Receives first]);
- ``after``: eagertp's handler after the ring;
- ``@ b``: back through funcol (its result wrapper, ``AsyncCollectiveTensor``,
  made by a Python custom op through the mode) and the matmul's deferral (the
  mode unwraps the wrapper of a placeholder: Note [Pending async tensors]);
- ``to consume``: the block's exit until the ring consumes (the flush's plan);
- ``consume``: the matmuls on this rank's shard and on each piece as it lands;
- ``exit``: the rest of the exit.

Everything before ``consume`` delays the first matmul, which the hand
schedule starts as soon as it has posted its messages (benchmarks/NOTES.md,
2026-12-03 at c0b0836). The marks wrap eagertp's handler (``eagertp.table.HANDLERS``)
and the ring's entry points for the whole run, two clock reads each. 2 ranks
only: the hand schedules are 2-rank ones.

``--form all_gather_indep_matmul`` is ``overlap.py``'s prefetch form
(``ag = funcol.all_gather_single(shard, ...); z = a2 @ b2; y = ag @ b``), where
plain eager's asynchronous gather hides behind the independent matmul: it
times plain eager (``eager``, the baseline Invariant 7 holds eagertp to)
against eagertp, and splits both. Plain eager's call, rank 0:

- ``issue``: funcol's gather, until it returns (gloo queues it);
- ``z``: the independent matmul (the gather in flight);
- ``y``: the wait for the gather and its matmul.

eagertp's, whose consumer runs at the block's exit:

- ``enter``: the block's ``__enter__``;
- ``issue``: funcol's gather through eagertp (every message posted);
- ``z``: the independent matmul (the gather in flight), run at once from the
  second block on (Note [Deferrals that gained nothing] in
  eagertp.deferring; the first block is a warm-up);
- ``@ b``: the consumer deferred;
- ``to y``: the block's exit until the gather's consumer runs (the plan, and
  any wait for the gather's last piece);
- ``y``: the gather's consumer (whole once the gather has landed: Note
  [Landed gathers] in eagertp.patterns);
- ``exit``: the rest of the exit.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from unittest import mock

import _harness

PHASES = {
    "matmul_reduce_scatter": ("enter", "a @ b", "funcol", "to ring", "ring", "after", "return", "exit"),
    "all_gather_matmul": ("enter", "funcol", "to ring", "posts", "after", "@ b", "to consume", "consume", "exit"),
    "all_gather_indep_matmul": ("enter", "issue", "z", "@ b", "to y", "y", "exit"),
}
EAGER_PHASES = ("issue", "z", "y")  # plain eager's call of the prefetch form


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/call_cost.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _harness.add_common_args(parser)
    parser.add_argument("--form", choices=list(PHASES), default="matmul_reduce_scatter", help="the fused call")
    parser.add_argument("--n", type=int, nargs="+", default=[256, 1024], help="output columns to sweep")
    parser.add_argument("--m", type=int, default=1024, help="rows of the reduce-scattered or gathered matrix (and K)")
    args = parser.parse_args(argv)
    if args.world_size != 2:
        parser.error(f"--world-size {args.world_size}: call_cost.py compares with a 2-rank hand schedule; use 2")
    return args


def _marked(fn, marks: dict[str, float], start: str, stop: str):
    def call(*a, **kw):
        marks[start] = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            marks[stop] = time.perf_counter()

    return call


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist

    import hand_schedules as hand
    from eagertp import EagerMicroPipeline
    from eagertp._compat import funcol_all_gather, funcol_reduce_scatter
    from eagertp.backends import RowsConsumer, ring
    from eagertp.patterns import AllGatherMatmulPlan
    from eagertp.table import HANDLERS

    group = dist.group.WORLD
    marks: dict[str, float] = {}
    phases = PHASES[args.form]
    gather = args.form == "all_gather_matmul"
    prefetch = args.form == "all_gather_indep_matmul"
    op = (torch.ops._c10d_functional.all_gather_into_tensor if gather
          else torch.ops._c10d_functional.reduce_scatter_tensor).default
    # (class, method, start mark, stop mark): the ring's (or the engine's) entry points, wrapped for the whole run
    if prefetch:
        entries = [(AllGatherMatmulPlan, "run", "y", "y done")]
    elif gather:
        entries = [(ring.RingBackend, "start_all_gather", "ring", "ringed"),
                   (ring._P2PGather, "consume", "consume", "consumed")]
    else:
        entries = [(ring.RingBackend, "produce_reduce_scatter", "ring", "ringed")]

    def one_n(n: int) -> dict:
        m = k = args.m
        g = torch.Generator().manual_seed(rank)
        b = torch.randn(k, n, generator=g)
        half = m // 2
        backend = ring.RingBackend()
        pipe = EagerMicroPipeline(min_fuse_bytes=0)
        split: dict[str, list[float]] = {p: [] for p in phases}

        def record(times: tuple[float, ...], names: tuple[str, ...] = phases) -> None:
            for phase, start, stop in zip(names, times, times[1:]):
                split.setdefault(phase, []).append(stop - start)

        if prefetch:
            shard = torch.randn(half, k, generator=g)
            a2, b2 = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            stamps: list[float] = []

            def program() -> tuple[torch.Tensor, torch.Tensor]:
                stamps[:] = [time.perf_counter()]
                ag = funcol_all_gather(shard, 0, group)
                stamps.append(time.perf_counter())
                z = a2 @ b2
                stamps.append(time.perf_counter())
                y = ag @ b
                stamps.append(time.perf_counter())
                return z, y  # NB: both held, so that neither matmul is skipped as unobserved

            def eager() -> tuple[torch.Tensor, torch.Tensor]:
                out = program()
                record(tuple(stamps), tuple(f"eager {p}" for p in EAGER_PHASES))
                return out

            def with_eagertp() -> tuple[torch.Tensor, torch.Tensor]:
                t0 = time.perf_counter()
                with pipe:
                    out = program()
                t1 = time.perf_counter()
                record((t0, *stamps, marks["y"], marks["y done"], t1))
                return out

            fns = {"t_eager": eager, "t_eagertp": with_eagertp}
        elif gather:
            shard = torch.randn(half, k, generator=g)
            ag_out, y = torch.empty(m, k), torch.empty(2, half, n)

            def ring_alone() -> None:
                def mm(piece: torch.Tensor, src: int, rows: slice) -> None:
                    torch.mm(piece, b, out=y[src][rows])

                backend.start_all_gather(shard, ag_out, group).consume(RowsConsumer(mm))

            def with_eagertp() -> torch.Tensor:
                t0 = time.perf_counter()
                with pipe:
                    t1 = time.perf_counter()
                    out = funcol_all_gather(shard, 0, group) @ b  # NB: held: computed at the block's exit
                    t2 = time.perf_counter()
                t3 = time.perf_counter()
                record((t0, t1, marks["handler"], marks["ring"], marks["ringed"], marks["handled"], t2,
                        marks["consume"], marks["consumed"], t3))
                return out

            fns = {"t_hand": hand.all_gather_matmul(shard, b, len(ring.piece_rows(shard, "all_gather"))),
                   "t_ring": ring_alone, "t_eagertp": with_eagertp}
        else:
            a = torch.randn(m, k, generator=g)
            out = torch.empty(half, n)

            def producer(c: int, buf: torch.Tensor, rows: slice) -> None:
                torch.mm(a[c * half : (c + 1) * half][rows], b, out=buf)

            def ring_alone() -> None:
                backend.produce_reduce_scatter(producer, out, group, "sum")

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
                record((t0, t1, t2, marks["handler"], marks["ring"], marks["ringed"], marks["handled"], t3, t4))

            fns = {"t_hand": hand.matmul_reduce_scatter(a, b, 1), "t_ring": ring_alone, "t_eagertp": with_eagertp}

        rounds: list[dict[str, float]] = []
        t = _harness.time_interleaved(fns, group, repeats=args.repeats, warmup=args.warmup, rounds=rounds)
        fused = "all_gather_matmul" if prefetch else args.form
        assert pipe.stats[fused] == 1, f"{args.form} did not fuse: {pipe.explain()}"
        ratios = (
            {"eagertp/eager": _harness.ratio_spread(rounds, "t_eagertp", "t_eager")[1]} if prefetch else
            {"ring/hand": _harness.ratio_spread(rounds, "t_ring", "t_hand")[1],
             "eagertp/hand": _harness.ratio_spread(rounds, "t_eagertp", "t_hand")[1]}
        )
        return {
            "M": m, "K": k, "N": n, **t, **ratios,
            # rank 0's phases of the timed calls
            **{f"p_{p}": statistics.median(v[-args.repeats :]) for p, v in split.items()},
        }

    with contextlib.ExitStack() as stack:
        if not prefetch:
            handler = _marked(HANDLERS[op._op], marks, "handler", "handled")
            stack.enter_context(mock.patch.dict(HANDLERS, {op._op: handler}))
        for owner, name, start, stop in entries:
            stack.enter_context(mock.patch.object(owner, name, _marked(getattr(owner, name), marks, start, stop)))
        return [one_n(n) for n in args.n]


def main(argv=None) -> int:
    args = parse_args(argv)
    with _harness.quiet_warnings():
        rows = _harness.run(args, _worker)
    print(
        f"call_cost: {args.form}, 2 ranks, gloo on {_harness.link_name(args)}, float32, "
        f"medians of {args.repeats} (ms; ratios: medians of the per-round ratios)"
    )
    ms = [dict(r, **{k: v * 1e3 for k, v in r.items() if k.startswith(("t_", "p_"))}) for r in rows]
    shape = [("M", "M", "d"), ("K", "K", "d"), ("N", "N", "d")]
    if args.form == "all_gather_indep_matmul":
        print(_harness.table(ms, [*shape, ("t_eager", "eager", ".2f"), ("t_eagertp", "eagertp", ".2f"),
                                  ("eagertp/eager", "eagertp/eager", ".2f")]))
        print("rank 0's plain eager call, by phase (ms):")
        print(_harness.table(ms, [("N", "N", "d"), *((f"p_eager {p}", p, ".3f") for p in EAGER_PHASES)]))
    else:
        print(_harness.table(ms, [
            *shape, ("t_hand", "hand", ".2f"), ("t_ring", "ring", ".2f"), ("t_eagertp", "eagertp", ".2f"),
            ("ring/hand", "ring/hand", ".2f"), ("eagertp/hand", "eagertp/hand", ".2f"),
        ]))
    print("rank 0's eagertp call, by phase (ms):")
    print(_harness.table(ms, [("N", "N", "d"), *((f"p_{p}", p, ".3f") for p in PHASES[args.form])]))
    _harness.write_json(
        args.json, {"benchmark": "call_cost", "form": args.form, "link": _harness.link_name(args), "rows": rows}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
