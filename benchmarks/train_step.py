"""A DTensor tensor + sequence parallel transformer training step: unfused
eager against eagertp and against the bound (the same step with no
communication), timed in the same run.

    python benchmarks/train_step.py                    # 2 CPU ranks, plain loopback
    python benchmarks/train_step.py --link-rate 2gbit  # wire-limited loopback
    python benchmarks/train_step.py --no-sequence-parallel   # plain TP: all-reduces
    python benchmarks/train_step.py --no-sequence-parallel --one-all-reduce-per-region   # q, k, v's summed first
    python benchmarks/train_step.py --inference        # the forward alone, under inference_mode
    python benchmarks/train_step.py --float8 rowwise   # torchao's float8 training, row-wise scaling

The model and the TP plan are the demo's (eagertp.demo); with
``--no-sequence-parallel`` the plan is plain TP (Colwise/Rowwise, activations
replicated), whose collectives are all-reduces (matmul + all-reduce fused), and
with ``--one-all-reduce-per-region`` as well, one all-reduce of q's, k's and
v's summed input gradients instead of one each (the demo's
``tensor_parallel_plan``). Each sample is one forward + backward; the
optimizer step is outside the timed region. With ``--inference`` it is one
forward under ``torch.inference_mode()``, as TP inference (a prefill) runs
it. CUDA and a torch.compile peer (Inductor's micro-pipeline TP) are not measured here yet:
the CPU machines this runs on have neither a GPU nor symmetric memory.

The bound runs the step under ``_NoCommunication``, which replaces every
collective DTensor issues with a local op of the same output shape and dtype
(all-gather: the shard repeated; reduce-scatter: a copy of this rank's chunk;
all-reduce: the input), so the step keeps its compute and memory traffic but
sends nothing. No overlap can beat it; ``hidden`` is the share of the
communication time eagertp removes from the step:

    hidden = (t_unfused - t_fused) / (t_unfused - t_bound)

Besides the ratio of medians, the speedup is taken within each round
(unfused and eagertp run in the same round, close in time, so this shared
machine's drift mostly cancels): its median and quartiles say how far one
run's ratio can be trusted.

``as written`` is eagertp in the step with every collective issued as the
program wrote it (``min_fuse_bytes`` above any buffer): the mode's cost
without fusion's effect. ``as written / eagertp`` (taken within each round) is
what fusing itself gains or loses on this link, ``unfused / as written`` what
the mode costs when nothing fuses.

The floor is the bound run under an empty ``TorchDispatchMode`` (overhead.py's
``BareEmptyMode``, which skips Dynamo's wrapper as eagertp's mode does): what
any Python dispatch mode adds to every op of the step. eagertp's pass-through
costs a little more per op (overhead.py), so it cannot go below the floor;
``floor - bound`` is the dispatch share of eagertp's excess over the bound, the
rest is its fused calls and the communication they leave exposed.

Its values differ from the real step's (partial sums are not summed), which
does not matter for timing: they are copies of real data, never uninitialised
memory that could hold NaN or inf and slow the matmuls down.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import _harness
from overhead import BareEmptyMode
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode


def _group_rank(group_name) -> int:
    group = group_name if isinstance(group_name, dist.ProcessGroup) else c10d._resolve_process_group(group_name)
    return group.rank()


# What each collective becomes in the bound: a local op of the same output
# shape and dtype over real data (never uninitialised memory: NaN or inf would
# slow the matmuls), as cheap as the output allows.
_LOCAL_STAND_INS = {
    # [rows, ...] -> [world * rows, ...]: the shard repeated
    "all_gather_into_tensor": lambda shard, world, group_name: shard.repeat(world, *[1] * (shard.dim() - 1)),
    # [world * rows, ...] -> [rows, ...]: this rank's chunk, unreduced
    "reduce_scatter_tensor": lambda full, op, world, group_name: full.chunk(world)[_group_rank(group_name)].clone(),
    "all_reduce": lambda t, op, group_name: t.clone(),
    "all_reduce_": lambda t, op, group_name: t,
    "wait_tensor": lambda t: t,
}


class _NoCommunication:
    """While entered, funcol's collectives (all DTensor issues here) run as
    the local stand-ins above: the step with its communication removed.

    NB: kernels registered for CPU, not a TorchDispatchMode: a Python mode
    would add its own per-op overhead to every op of the step (measured: more
    than the communication it removes on loopback), and the bound would no
    longer bound anything. Leaving removes the registrations, which restores
    the real kernels. ``_OnlyStandIns`` checks once that nothing else
    communicates.
    """

    def __enter__(self) -> _NoCommunication:
        self._lib = torch.library.Library("_c10d_functional", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "overriding a previously registered kernel"
            for name, stand_in in _LOCAL_STAND_INS.items():
                self._lib.impl(name, stand_in, "CPU")
        return self

    def __exit__(self, *exc) -> None:
        self._lib._destroy()
        del self._lib


class _OnlyStandIns(TorchDispatchMode):
    """Fails on a communication op the bound has no stand-in for (raw c10d, or
    another funcol collective): the bound would include its time."""

    _KNOWN = frozenset(_LOCAL_STAND_INS) | {"_wrap_tensor_autograd"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and func._opname not in self._KNOWN:
            raise NotImplementedError(f"the bound has no local stand-in for {func}: add one to _LOCAL_STAND_INS")
        return func(*args, **(kwargs or {}))


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
    parser.add_argument(
        "--inference", action="store_true", help="time the forward alone, under torch.inference_mode()"
    )
    parser.add_argument(
        "--float8",
        choices=["rowwise", "rowwise_exact_scales"],
        help="torchao's float8 training, row-wise scaling (torchtitan's rowwise recipe, with torch's TP "
        "styles; its scales rounded to powers of 2, or not): needs torchao (the test extra)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the size rule on this link first (eagertp.calibrate_min_fuse_bytes, k = --dim) "
        "and run eagertp with it, as the README tells users to; default: the built-in rule",
    )
    from eagertp.demo import add_plan_args, check_plan_args

    add_plan_args(parser)
    return check_plan_args(parser, parser.parse_args(argv))


def _float8_conversion(recipe: str):
    """torchao's ``convert_to_float8_training`` with row-wise scaling, for
    ``build_model`` to apply before TP (as torchtitan does)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("rowwise")
    if recipe == "rowwise_exact_scales":
        config = dataclasses.replace(config, round_scales_to_power_of_2=False)
    return lambda blocks: convert_to_float8_training(blocks, config=config)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh

    from eagertp import EagerMicroPipeline
    from eagertp.demo import build_model, local_input

    mesh = DeviceMesh("cpu", list(range(world)))
    group = mesh.get_group()
    model = build_model(args, mesh, _float8_conversion(args.float8) if args.float8 else None)
    g = torch.Generator().manual_seed(0)
    x = local_input(torch.randn(args.batch, args.seq, args.dim, generator=g), args.sequence_parallel, rank, world)

    def step(*contexts) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            if args.inference:
                stack.enter_context(torch.inference_mode())
            for context in contexts:
                stack.enter_context(context)
            loss = F.mse_loss(model(x), torch.zeros_like(x))
            if not args.inference:
                loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.detach()

    with _OnlyStandIns():
        loss = step(_NoCommunication())
    if not torch.isfinite(loss.full_tensor() if hasattr(loss, "full_tensor") else loss):
        raise RuntimeError(f"the bound's step computed a loss of {loss}: its stand-ins must keep values finite")
    min_fuse_bytes = None
    if args.calibrate:
        from eagertp.calibrate import calibrate_min_fuse_bytes

        min_fuse_bytes = calibrate_min_fuse_bytes(group, k=args.dim, repeats=5, warmup=1).min_fuse_bytes
    pipe = EagerMicroPipeline(backend=args.backend, min_fuse_bytes=min_fuse_bytes)
    as_written = EagerMicroPipeline(backend=args.backend, min_fuse_bytes=1 << 62)
    rounds: list[dict[str, float]] = []
    t = _harness.time_interleaved(
        {
            "t_unfused": lambda: step(contextlib.nullcontext()),
            "t_fused": lambda: step(pipe),
            "t_as_written": lambda: step(as_written),
            "t_bound": lambda: step(_NoCommunication()),
            "t_floor": lambda: step(_NoCommunication(), BareEmptyMode()),
        },
        group,
        repeats=args.repeats,
        warmup=args.warmup,
        rounds=rounds,
    )
    stats = dict(pipe.stats)
    fused_kinds = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
    if any(as_written.stats.get(k, 0) for k in fused_kinds):
        raise RuntimeError(f"the as-written step fused collectives ({dict(as_written.stats)}): its row would mislead")
    return {
        "world_size": world,
        "layers": args.layers,
        "batch": args.batch,
        "seq": args.seq,
        "dim": args.dim,
        "sequence_parallel": args.sequence_parallel,
        "one_all_reduce_per_region": args.one_all_reduce_per_region,
        "backend": pipe.backend,
        "min_fuse_bytes": min_fuse_bytes,
        **t,
        # unfused / eagertp within each round: quartiles
        "speedup_in_rounds": _harness.ratio_spread(rounds, "t_unfused", "t_fused"),
        # what fusing gains over the same mode issuing everything as written, and what the mode costs alone
        "fusion_in_rounds": _harness.ratio_spread(rounds, "t_as_written", "t_fused"),
        "mode_in_rounds": _harness.ratio_spread(rounds, "t_unfused", "t_as_written"),
        "floor_in_rounds": _harness.ratio_spread(rounds, "t_floor", "t_bound"),
        "fused_ops_per_step": sum(stats.get(k, 0) for k in fused_kinds),
        "unfused_ops_per_step": sum(
            stats.get(k, 0) for k in ("unfused_all_gather", "unfused_reduce_scatter", "unfused_all_reduce")
        ),
    }


def _spread(quartiles: tuple[float, float, float]) -> str:
    q1, q2, q3 = quartiles
    return f"median {q2:.2f}x, quartiles {q1:.2f}x-{q3:.2f}x"


def main(argv=None) -> int:
    args = parse_args(argv)
    with _harness.quiet_warnings():
        r = _harness.run(args, _worker)
    link = _harness.link_name(args)
    r["link"] = link
    if r["sequence_parallel"]:
        plan = "TP + SP"
    else:
        plan = f"TP without SP (all-reduces{', one per region' if r['one_all_reduce_per_region'] else ''})"
    print(
        f"train_step: {r['world_size']} ranks, gloo on {link}, {plan}, {r['layers']} blocks, "
        f"{'float8 ' + args.float8 + ' (torchao), ' if args.float8 else ''}"
        f"batch {r['batch']}, "
        f"seq {r['seq']}, dim {r['dim']}; "
        f"{'forward under inference_mode' if args.inference else 'forward + backward'}, median of {args.repeats}"
    )
    if r["min_fuse_bytes"] is not None:
        print(f"  size rule calibrated on this link: min_fuse_bytes = {r['min_fuse_bytes']}")
    print(f"  unfused eager  {r['t_unfused'] * 1e3:8.1f} ms")
    print(
        f"  eagertp        {r['t_fused'] * 1e3:8.1f} ms   ({r['t_unfused'] / r['t_fused']:.2f}x; "
        f"{r['fused_ops_per_step']} fused, {r['unfused_ops_per_step']} unfused collectives per step)"
    )
    print(f"  speedup within each round: {_spread(r['speedup_in_rounds'])}")
    print(
        f"  as written     {r['t_as_written'] * 1e3:8.1f} ms   (eagertp, every collective issued as written; "
        f"unfused / as written within each round: {_spread(r['mode_in_rounds'])})"
    )
    print(f"  fusing alone: as written / eagertp within each round: {_spread(r['fusion_in_rounds'])}")
    print(f"  bound (no communication)  {r['t_bound'] * 1e3:8.1f} ms")
    print(
        f"  floor (the bound under an empty TorchDispatchMode)  {r['t_floor'] * 1e3:8.1f} ms   "
        f"(floor / bound within each round: {_spread(r['floor_in_rounds'])})"
    )
    exposed = r["t_unfused"] - r["t_bound"]
    r["hidden"] = (r["t_unfused"] - r["t_fused"]) / exposed if exposed > 0 else None
    if r["hidden"] is None:
        print("  hidden: undefined (unfused is no slower than the bound: no exposed communication measured)")
    else:
        print(f"  hidden: (unfused - eagertp) / (unfused - bound) = {r['hidden']:.2f} of the exposed communication")
    _harness.write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
