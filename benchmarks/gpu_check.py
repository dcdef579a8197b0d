"""GPU check: the symm_mem path on every visible CUDA device, against unfused eager.

    python benchmarks/gpu_check.py [--m 4096 --k 4096 --n 4096] [--json out.json]

For world size 1 on each device (one process, NCCL), runs all-gather + matmul
and matmul + reduce-scatter with ``EagerMicroPipeline(backend="symm_mem")``,
checks the results against plain eager (bf16 tolerance) and that the fused
path ran, and times both (CUDA events, medians). Prints a table; exits non-zero
on a mismatch. Without CUDA it says so and exits 0. Two processes sharing one
GPU are not attempted: CUDA symmetric memory maps one device per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", default=None)
    return parser.parse_args(argv)


def cuda_median_ms(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_device(device: int, args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from eagertp import EagerMicroPipeline

    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + device))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", device))
    group = dist.group.WORLD
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(args.k, args.n, device="cuda", dtype=torch.bfloat16, generator=g)
        cases = {
            "all_gather_matmul": lambda: funcol.all_gather_tensor(a, 0, group) @ b,
            "matmul_reduce_scatter": lambda: funcol.reduce_scatter_tensor(a @ b, "sum", 0, group).wait(),
        }
        rows = []
        for op, program in cases.items():
            expected = program()
            pipe = EagerMicroPipeline(backend="symm_mem")
            with pipe:
                got = program()
            torch.cuda.synchronize()
            ok = torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
            fused = pipe.stats[op] == 1

            def fused_program(pipe=pipe, program=program):
                with pipe:
                    program()

            rows.append(
                {
                    "device": torch.cuda.get_device_name(device),
                    "world_size": 1,
                    "op": op,
                    "correct": ok,
                    "fused_ran": fused,
                    "t_unfused_ms": cuda_median_ms(program, args.repeats),
                    "t_fused_ms": cuda_median_ms(fused_program, args.repeats),
                    "explain": pipe.explain(),
                }
            )
        return rows
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    rows = [row for device in range(torch.cuda.device_count()) for row in check_device(device, args)]
    print(f"gpu_check: M={args.m} K={args.k} N={args.n} bf16, medians of {args.repeats} (ms)")
    print(f"{'device':<28} {'W':>2} {'op':<22} {'correct':>7} {'fused':>6} {'unfused':>9} {'eagertp':>9}")
    for r in rows:
        print(
            f"{r['device'][:28]:<28} {r['world_size']:>2} {r['op']:<22} {str(r['correct']):>7} "
            f"{str(r['fused_ran']):>6} {r['t_unfused_ms']:>9.3f} {r['t_fused_ms']:>9.3f}"
        )
    for r in rows:
        if not r["fused_ran"]:
            print(f"  {r['op']} did not fuse:\n    {r['explain']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["correct"] and r["fused_ran"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
