"""Peak memory of a fused step against the unfused one.

    python benchmarks/memory.py [--m 1024 --k 1024 --n 1024] [--json out.json]
    python benchmarks/memory.py --no-sequence-parallel   # the step in plain TP: all-reduces, row-wise chains

On 2 gloo ranks, for all-gather + matmul, matmul + reduce-scatter and the
demo's transformer step (forward + backward), measures the peak of tensor
memory allocated during the step (the profiler's allocation records; tensors
that existed before the step are not counted) for unfused eager and eagertp.
The target: fused peak <= unfused peak + one chunk (the largest per-rank
chunk of a collective in the step).
"""

from __future__ import annotations

import argparse
import sys

import _harness


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/memory.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _harness.add_common_args(parser)
    parser.add_argument("--m", type=int, default=1024)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256, help="transformer step: sequence length")
    parser.add_argument("--dim", type=int, default=256, help="transformer step: model width")
    from eagertp.demo import add_sequence_parallel_arg

    add_sequence_parallel_arg(parser)
    return parser.parse_args(argv)


def peak_bytes(fn) -> int:
    """Peak bytes of tensor memory allocated while ``fn()`` runs: the running sum
    of the profiler's allocation / free records, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        current += e.nbytes()  # negative for a free
        peak = max(peak, current)
    return peak


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import argparse as ap

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh

    from eagertp import EagerMicroPipeline
    from eagertp._compat import funcol_all_gather, funcol_reduce_scatter
    from eagertp.demo import build_model, local_input

    group = dist.group.WORLD
    m, k, n = args.m, args.k, args.n
    shard = torch.randn(m // world, k)
    a, b = torch.randn(m, k), torch.randn(k, n)

    def ag_mm():
        return funcol_all_gather(shard, 0, group) @ b

    def mm_rs():
        return funcol_reduce_scatter(a @ b, "sum", 0, group).wait()

    mesh = DeviceMesh("cpu", list(range(world)))
    model_args = ap.Namespace(dim=args.dim, heads=8, layers=1, sequence_parallel=args.sequence_parallel)
    model = build_model(model_args, mesh)
    x = local_input(torch.randn(2, args.seq, args.dim), args.sequence_parallel, rank, world)

    def train_step():
        F.mse_loss(model(x), torch.zeros_like(x)).backward()
        for p in model.parameters():
            p.grad = None

    cases = [
        ("all_gather_matmul", ag_mm, m // world * n * 4),  # chunk: one rank's rows of the output
        ("matmul_reduce_scatter", mm_rs, m // world * n * 4),
        # The largest chunk: with sequence parallel the MLP's; without, the all-reduced activation's.
        ("transformer_step", train_step, 2 * args.seq // world * (4 if args.sequence_parallel else 1) * args.dim * 4),
    ]
    results = []
    for name, fn, chunk in cases:
        # NB: every collective fused whatever its size (at these sizes the
        # default rule fuses none of the step's).
        pipe = EagerMicroPipeline(min_fuse_bytes=0)
        fn()  # warm-up (allocator, caches)
        with pipe:
            fn()
        unfused = peak_bytes(fn)

        def fused(fn=fn):
            with pipe:
                fn()

        peak = peak_bytes(fused)
        calls = sum(n for key, n in pipe.stats.items() if key in _FUSED_CALLS)
        results.append({"case": name, "peak_unfused": unfused, "peak_fused": peak, "chunk": chunk, "fused_calls": calls})
    return results


# The stats that count fused calls: what says the fused column measured fusion.
_FUSED_CALLS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def main(argv=None) -> int:
    args = parse_args(argv)
    with _harness.quiet_warnings():
        results = _harness.run(args, _worker)
    print(f"memory: peak tensor bytes allocated during the step, rank 0 of {args.world_size} (MiB)")
    rows = [
        {
            **r,
            "unfused": r["peak_unfused"] / 2**20,
            "fused": r["peak_fused"] / 2**20,
            "chunk_mib": r["chunk"] / 2**20,
            "within": "yes" if r["peak_fused"] <= r["peak_unfused"] + r["chunk"] else "NO",
        }
        for r in results
    ]
    print(
        _harness.table(
            rows,
            [
                ("case", "case", ""),
                ("unfused", "unfused", ".2f"),
                ("fused", "fused", ".2f"),
                ("chunk_mib", "one chunk", ".2f"),
                ("fused_calls", "fused calls", ""),
                ("within", "fused <= unfused + chunk", ""),
            ],
        )
    )
    _harness.write_json(args.json, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
