"""Train a small sequence-parallel MLP stack with and without eagertp.

    python -m eagertp.demo                      # spawns 2 CPU ranks on gloo
    torchrun --nproc-per-node 2 -m eagertp.demo # uses the launched group
    torchrun --nproc-per-node 8 -m eagertp.demo --device cuda   # NCCL

Each layer is Megatron-style tensor + sequence parallel, written with functional
collectives::

    x_shard [S/W, H] -> layer_norm -> all_gather -> linear(w1 shard, bias) -> gelu
        -> linear(w2 shard) -> reduce_scatter -> + x_shard

The same steps run twice from the same initial weights: plain eager, then inside
``EagerMicroPipeline``. The demo prints both losses per step, ``explain()`` for
the last step, the median step times, and finally whether the losses match.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eagertp import EagerMicroPipeline
from eagertp._compat import funcol_all_gather, funcol_reduce_scatter


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m eagertp.demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda uses NCCL (torchrun only)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    parser.add_argument("--layers", type=int, default=2, help="tensor-parallel MLP layers")
    parser.add_argument("--seq", type=int, default=512, help="sequence length (divisible by the world size)")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--ffn", type=int, default=1024, help="MLP width (divisible by the world size)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--backend", default="auto", help="eagertp backend: auto, ring, reference")
    args = parser.parse_args(argv)
    return args


class TPMLP:
    """Per-rank shards of a stack of sequence-parallel MLP layers."""

    def __init__(self, args: argparse.Namespace, group: dist.ProcessGroup, device: torch.device) -> None:
        world, rank = group.size(), group.rank()
        if args.seq % world or args.ffn % world:
            raise ValueError(
                f"--seq {args.seq} and --ffn {args.ffn} must be divisible by the world size {world}"
            )
        gen = torch.Generator().manual_seed(0)  # the same full weights on every rank
        self.group = group
        self.params: list[torch.Tensor] = []
        self.layers = []
        for _ in range(args.layers):
            w1 = torch.randn(args.ffn, args.hidden, generator=gen) / args.hidden**0.5
            b1 = torch.randn(args.ffn, generator=gen) * 0.1
            w2 = torch.randn(args.hidden, args.ffn, generator=gen) / args.ffn**0.5
            shard = [
                w1.chunk(world, 0)[rank],  # column parallel: [F/W, H]
                b1.chunk(world, 0)[rank],  # [F/W]
                w2.chunk(world, 1)[rank],  # row parallel: [H, F/W]
            ]
            shard = [p.contiguous().to(device).requires_grad_() for p in shard]
            self.layers.append(shard)
            self.params += shard

    def __call__(self, x_shard: torch.Tensor) -> torch.Tensor:
        for w1, b1, w2 in self.layers:
            h = F.layer_norm(x_shard, x_shard.shape[-1:])
            h = funcol_all_gather(h, 0, self.group)  # [S, H]
            h = F.gelu(F.linear(h, w1, b1))  # [S, F/W]
            y = F.linear(h, w2)  # [S, H], partial sums
            x_shard = x_shard + funcol_reduce_scatter(y, "sum", 0, self.group)
        return x_shard

    @torch.no_grad()
    def sgd_step(self, lr: float) -> None:
        for p in self.params:
            p -= lr * p.grad
            p.grad = None


def batch(step: int, args: argparse.Namespace, group: dist.ProcessGroup, device: torch.device):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.seq, args.hidden, generator=gen)
    target = torch.randn(args.seq, args.hidden, generator=gen)
    rank, world = group.rank(), group.size()
    return x.chunk(world)[rank].to(device), target.chunk(world)[rank].to(device)


def train(args, group, device, pipe: EagerMicroPipeline | None):
    model = TPMLP(args, group, device)
    losses, times = [], []
    for step in range(args.steps):
        x, target = batch(step, args, group, device)
        _sync(device)
        start = time.perf_counter()
        if pipe is None:
            loss = F.mse_loss(model(x), target)
            loss.backward()
        else:
            with pipe:
                loss = F.mse_loss(model(x), target)
                loss.backward()
        _sync(device)
        times.append(time.perf_counter() - start)
        model.sgd_step(args.lr)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / group.size())
    return losses, times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Both runs on this rank; rank 0 reports. Returns whether the losses match."""
    plain_losses, plain_times = train(args, group, device, None)
    pipe = EagerMicroPipeline(backend=args.backend)
    fused_losses, fused_times = train(args, group, device, pipe)
    match = all(
        abs(p - f) <= 1e-5 * max(abs(p), 1e-6) for p, f in zip(plain_losses, fused_losses)
    )
    if group.rank() != 0:
        return match
    out = sys.stdout
    out.write(
        f"eagertp demo: {group.size()} ranks ({dist.get_backend(group)}, {device.type}), "
        f"{args.layers} layers, seq {args.seq}, hidden {args.hidden}, ffn {args.ffn}, "
        f"backend {pipe.backend}\n\n"
    )
    out.write(f"{'step':>4}  {'plain loss':>12}  {'eagertp loss':>12}  {'plain ms':>9}  {'eagertp ms':>10}\n")
    for i, (pl, fl, pt, ft) in enumerate(zip(plain_losses, fused_losses, plain_times, fused_times)):
        out.write(f"{i:>4}  {pl:>12.6f}  {fl:>12.6f}  {pt * 1e3:>9.1f}  {ft * 1e3:>10.1f}\n")
    out.write("\nexplain() for the last eagertp step:\n")
    for line in pipe.explain().splitlines():
        out.write(f"  {line}\n")
    t_plain, t_fused = statistics.median(plain_times), statistics.median(fused_times)
    max_diff = max(abs(p - f) for p, f in zip(plain_losses, fused_losses))
    out.write(
        f"\nmedian step time (forward + backward): plain {t_plain * 1e3:.1f} ms, "
        f"eagertp {t_fused * 1e3:.1f} ms ({t_plain / t_fused:.2f}x)\n"
    )
    stats = pipe.stats
    out.write(
        f"fused ops in the last step: {stats['all_gather_matmul']} all_gather_matmul "
        f"({stats['fused_matmuls']} matmuls), {stats['matmul_reduce_scatter']} matmul_reduce_scatter, "
        f"{stats['unfused_all_gather']} unfused all-gathers, "
        f"{stats['unfused_reduce_scatter']} unfused reduce-scatters; "
        f"losses match plain eager: {'yes' if match else 'NO'} (max abs diff {max_diff:.2g})\n"
    )
    out.flush()
    return match


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if not run(args, dist.group.WORLD, torch.device("cpu")):
            raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        if args.device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            return 0 if run(args, dist.group.WORLD, device) else 1
        finally:
            dist.destroy_process_group()
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
