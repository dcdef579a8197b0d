"""Train a small tensor-parallel transformer with and without eagertp.

    python -m eagertp.demo                      # spawns 2 CPU ranks on gloo
    torchrun --nproc-per-node 2 -m eagertp.demo # uses the launched group
    torchrun --nproc-per-node 8 -m eagertp.demo --device cuda   # NCCL

The model is a stack of transformer blocks (attention with separate q, k, v
projections, an MLP with bias, LayerNorms) made tensor + sequence parallel by
DTensor's ``parallelize_module``: ColwiseParallel, RowwiseParallel,
SequenceParallel and PrepareModuleInput, as torchtitan does. Per block and
step that is 4 all-gathers and 4 reduce-scatters (forward and backward).
``--no-sequence-parallel`` makes it plain TP instead (ColwiseParallel and
RowwiseParallel only, activations replicated): per block and step 6
all-reduces (2 row-parallel outputs forward, 4 column-parallel input gradients
backward), which eagertp fuses as matmul + all-reduce. With
``--one-all-reduce-per-region`` as well, each region takes its input once
(PrepareModuleInput), so that q's, k's and v's input gradients are summed
before one all-reduce: 4 a block and step.

The same steps run twice from the same initial weights: plain eager, then
inside ``EagerMicroPipeline``. The demo prints both losses per step,
``explain()`` for the last step (one line per collective), the median step
times, and finally how many fused ops ran and whether the losses match.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from eagertp import EagerMicroPipeline
from eagertp._compat import exit_spawned_rank


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds once wq/wk/wv are column-parallel
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tensor_parallel_plan(sequence_parallel: bool = True, *, one_all_reduce_per_region: bool = False) -> dict:
    """The TP plan for one TransformerBlock; activations are [B, S, D].

    ``sequence_parallel=True`` (tensor + sequence parallel, as torchtitan):
    activations are sharded along the sequence (dim 1) between the parallel
    regions; each region all-gathers its input and reduce-scatters its output.
    ``False`` (plain TP): activations are replicated; the row-parallel
    outputs all-reduce in forward, the column-parallel input gradients in
    backward, each linear its own (q, k and v: three all-reduces).

    ``one_all_reduce_per_region`` (plain TP; TP + SP's regions take their
    input once already): each region (the attention, the MLP) takes its input
    as one replicated DTensor (``PrepareModuleInput``), so autograd sums its
    column-parallel linears' input gradients while they are partial and the
    region all-reduces the sum once, as Megatron's fused QKV linear does:
    4 all-reduces a block and step instead of 6 (docs/tuning.md, "One
    collective per region")."""
    if sequence_parallel and one_all_reduce_per_region:
        raise ValueError(
            "tensor_parallel_plan: one_all_reduce_per_region is for plain TP (sequence_parallel=False); "
            "with sequence parallel each region already takes its input once (one all-gather, one reduce-scatter)"
        )
    plan: dict = {}
    for norm, region, colwise, rowwise in (("ln1", "attn", ("wq", "wk", "wv"), "wo"), ("ln2", "mlp", ("w1",), "w2")):
        if sequence_parallel:
            plan[norm] = SequenceParallel()
            plan[region] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        elif one_all_reduce_per_region:
            plan[region] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        plan.update({f"{region}.{name}": ColwiseParallel() for name in colwise})
        plan[f"{region}.{rowwise}"] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    return plan


def build_model(
    args: argparse.Namespace, mesh: DeviceMesh, convert: Callable[[nn.Module], object] | None = None
) -> nn.Module:
    """The demo's blocks, each parallelized by ``tensor_parallel_plan``;
    ``convert`` rewrites the blocks first (float8 training's
    ``convert_to_float8_training``, as torchtitan applies it before TP)."""
    torch.manual_seed(0)  # the same initial weights on every rank and in both runs
    blocks = nn.Sequential(*(TransformerBlock(args.dim, args.heads) for _ in range(args.layers)))
    if convert is not None:
        convert(blocks)
    for block in blocks:
        # NB: getattr: callers' own namespaces (benchmarks/memory.py) may not set them.
        plan = tensor_parallel_plan(
            getattr(args, "sequence_parallel", True),
            one_all_reduce_per_region=getattr(args, "one_all_reduce_per_region", False),
        )
        parallelize_module(block, mesh, plan)
    return blocks.to(mesh.device_type)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m eagertp.demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda uses NCCL (torchrun only)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--batch", type=int, default=2, help="batch size")
    parser.add_argument("--seq", type=int, default=512, help="sequence length (divisible by the world size)")
    parser.add_argument("--dim", type=int, default=512, help="model width")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (divisible by the world size)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--backend", default="auto", help="eagertp backend: auto, ring, reference")
    add_plan_args(parser)
    return check_plan_args(parser, parser.parse_args(argv))


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """The TP plan's options (``tensor_parallel_plan``)."""
    parser.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="plain TP (Colwise/Rowwise, activations replicated): all-reduces instead of "
        "all-gathers and reduce-scatters",
    )
    parser.add_argument(
        "--one-all-reduce-per-region",
        action="store_true",
        help="with --no-sequence-parallel: each region takes its input once (PrepareModuleInput), so q's, k's "
        "and v's input gradients are summed before one all-reduce (4 all-reduces a block and step, not 6)",
    )


def check_plan_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args``, once ``add_plan_args``' options are known to go together."""
    if args.one_all_reduce_per_region and args.sequence_parallel:
        parser.error(
            "--one-all-reduce-per-region needs --no-sequence-parallel (TP + SP's regions take their input once)"
        )
    return args


def train(args, mesh: DeviceMesh, pipe: EagerMicroPipeline | None) -> tuple[list[float], list[float]]:
    group = mesh.get_group()
    rank, world = group.rank(), group.size()
    model = build_model(args, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses, times = [], []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(args.batch, args.seq, args.dim, generator=gen)
        target = torch.randn(args.batch, args.seq, args.dim, generator=gen)
        x, target = (local_input(t, args.sequence_parallel, rank, world).to(mesh.device_type) for t in (x, target))
        _sync(mesh)
        start = time.perf_counter()
        with pipe if pipe is not None else contextlib.nullcontext():
            loss = F.mse_loss(model(x), target)
            loss.backward()
        _sync(mesh)
        times.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / world)
    return losses, times


def local_input(t: torch.Tensor, sequence_parallel: bool, rank: int, world: int) -> torch.Tensor:
    """This rank's part of a [B, S, D] input: its block of the sequence with
    sequence parallel, else all of it (replicated)."""
    return t.chunk(world, dim=1)[rank].contiguous() if sequence_parallel else t


def _sync(mesh: DeviceMesh) -> None:
    if mesh.device_type == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace, mesh: DeviceMesh) -> bool:
    """Both runs on this rank; rank 0 reports. Returns whether the losses match."""
    plain_losses, plain_times = train(args, mesh, None)
    pipe = EagerMicroPipeline(backend=args.backend)
    fused_losses, fused_times = train(args, mesh, pipe)
    max_diff = max(abs(p - f) for p, f in zip(plain_losses, fused_losses))
    match = all(abs(p - f) <= 1e-5 * max(abs(p), 1e-6) for p, f in zip(plain_losses, fused_losses))
    if mesh.get_group().rank() == 0:
        _report(args, mesh, pipe, (plain_losses, fused_losses), (plain_times, fused_times), match, max_diff)
    return match


def _report(args, mesh, pipe, losses, times, match: bool, max_diff: float) -> None:
    out = sys.stdout
    group = mesh.get_group()
    out.write(
        f"eagertp demo: {group.size()} ranks ({dist.get_backend(group)}, {mesh.device_type}), "
        f"{args.layers} transformer blocks, batch {args.batch}, seq {args.seq}, dim {args.dim}, "
        f"backend {pipe.backend}\n\n"
    )
    out.write(f"{'step':>4}  {'plain loss':>12}  {'eagertp loss':>12}  {'plain ms':>9}  {'eagertp ms':>10}\n")
    for i, (pl, fl, pt, ft) in enumerate(zip(*losses, *times)):
        out.write(f"{i:>4}  {pl:>12.6f}  {fl:>12.6f}  {pt * 1e3:>9.1f}  {ft * 1e3:>10.1f}\n")
    out.write("\nexplain() for the last eagertp step, one line per collective:\n")
    for line in pipe.explain().splitlines():
        out.write(f"  {line}\n")
    t_plain, t_fused = (statistics.median(t) for t in times)
    out.write(
        f"\nmedian step time (forward + backward): plain {t_plain * 1e3:.1f} ms, "
        f"eagertp {t_fused * 1e3:.1f} ms ({t_plain / t_fused:.2f}x)\n"
    )
    if "RANK" not in os.environ:  # spawned here (main), not launched by torchrun
        out.write(
            "(a few steps on one host, whose cores run gloo's transfers as copies beside the matmuls: noisy, "
            "with little to hide; `python benchmarks/train_step.py [--link-rate 2gbit]` measures it properly)\n"
        )
    stats = pipe.stats
    if args.sequence_parallel:
        fused = (
            f"{stats['all_gather_matmul']} all_gather_matmul "
            f"({stats['fused_matmuls']} matmuls), {stats['matmul_reduce_scatter']} matmul_reduce_scatter, "
            f"{stats['unfused_all_gather']} unfused all-gathers, "
            f"{stats['unfused_reduce_scatter']} unfused reduce-scatters"
        )
    else:
        fused = (
            f"{stats['matmul_all_reduce']} matmul_all_reduce, {stats['all_gather_matmul']} all_gather_matmul "
            f"({stats['fused_matmuls']} matmuls) on their gather halves, "
            f"{stats['unfused_all_reduce']} unfused all-reduces"
        )
    out.write(
        f"fused ops in the last step: {fused}; "
        f"losses match plain eager: {'yes' if match else 'NO'} (max abs diff {max_diff:.2g})\n"
    )
    out.flush()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        match = run(args, DeviceMesh("cpu", list(range(world))))
        # NB: tear down together: a rank that closes its connections while a
        # peer's gloo threads still use them can abort that peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_spawned_rank(0 if match else 1)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            match = run(args, DeviceMesh(args.device, list(range(dist.get_world_size()))))
            dist.barrier()  # tear down together (see _worker)
        finally:
            dist.destroy_process_group()
        exit_spawned_rank(0 if match else 1)
    if args.device == "cuda":
        raise SystemExit("--device cuda needs one process per GPU: launch with torchrun")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_worker, args=(args.world_size, port, args), nprocs=args.world_size)
    except mp.ProcessExitedException:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
