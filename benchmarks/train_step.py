"""A DTensor tensor + sequence parallel transformer training step: unfused
eager against eagertp, timed in the same run.

    python benchmarks/train_step.py                    # 2 CPU ranks, plain loopback
    python benchmarks/train_step.py --link-rate 2gbit  # wire-limited loopback
    python benchmarks/train_step.py --no-sequence-parallel   # plain TP: all-reduces

The model and the TP plan are the demo's (eagertp.demo); with
``--no-sequence-parallel`` the plan is plain TP (Colwise/Rowwise, activations
replicated), whose collectives are all-reduces (matmul + all-reduce fused). Each sample is one
forward + backward; the optimizer step is outside the timed region. CUDA and a
torch.compile peer (Inductor's micro-pipeline TP) are not measured here yet:
the CPU machines this runs on have neither a GPU nor symmetric memory.
"""

from __future__ import annotations

import argparse
import sys

import _harness


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/train_step.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _harness.add_common_args(parser)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--backend", default="auto", help="eagertp backend")
    from eagertp.demo import add_sequence_parallel_arg

    add_sequence_parallel_arg(parser)
    return parser.parse_args(argv)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh

    from eagertp import EagerMicroPipeline
    from eagertp.demo import build_model, local_input

    mesh = DeviceMesh("cpu", list(range(world)))
    group = mesh.get_group()
    model = build_model(args, mesh)
    g = torch.Generator().manual_seed(0)
    x = local_input(torch.randn(args.batch, args.seq, args.dim, generator=g), args.sequence_parallel, rank, world)

    def step(context) -> None:
        with context:
            F.mse_loss(model(x), torch.zeros_like(x)).backward()
        for p in model.parameters():
            p.grad = None

    pipe = EagerMicroPipeline(backend=args.backend)
    t = _harness.time_interleaved(
        {"t_unfused": lambda: step(contextlib.nullcontext()), "t_fused": lambda: step(pipe)},
        group,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    stats = dict(pipe.stats)
    return {
        "world_size": world,
        "layers": args.layers,
        "batch": args.batch,
        "seq": args.seq,
        "dim": args.dim,
        "sequence_parallel": args.sequence_parallel,
        "backend": pipe.backend,
        **t,
        "fused_ops_per_step": sum(
            stats.get(k, 0) for k in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
        ),
        "unfused_ops_per_step": sum(
            stats.get(k, 0) for k in ("unfused_all_gather", "unfused_reduce_scatter", "unfused_all_reduce")
        ),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with _harness.quiet_warnings():
        r = _harness.run(args, _worker)
    link = args.link_rate or "loopback"
    r["link"] = link
    print(
        f"train_step: {r['world_size']} ranks, gloo on {link}, "
        f"{'TP + SP' if r['sequence_parallel'] else 'TP without SP (all-reduces)'}, {r['layers']} blocks, "
        f"batch {r['batch']}, "
        f"seq {r['seq']}, dim {r['dim']}; forward + backward, median of {args.repeats}"
    )
    print(f"  unfused eager  {r['t_unfused'] * 1e3:8.1f} ms")
    print(
        f"  eagertp        {r['t_fused'] * 1e3:8.1f} ms   ({r['t_unfused'] / r['t_fused']:.2f}x; "
        f"{r['fused_ops_per_step']} fused, {r['unfused_ops_per_step']} unfused collectives per step)"
    )
    _harness.write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
