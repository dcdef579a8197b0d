"""GPU check: the symm_mem path on every visible CUDA device, against unfused eager.

    python benchmarks/gpu_check.py [--m 4096 --k 4096 --n 4096] [--json out.json]

For world size 1 on each device (one process, NCCL), runs all-gather + matmul
and matmul + reduce-scatter with ``EagerMicroPipeline(backend="symm_mem")``,
checks the results against plain eager (bf16 tolerance) and that the fused
path ran, and times both (CUDA events, medians). World size 1 skips the
workspace and its barriers, so then, correctness only, two processes share
device 0 over a gloo group (NCCL refuses two ranks on one GPU): gathers in
flight, reduce-scatter, all-reduce, row-wise FP8 with 18 rows a rank, and a
weight-gradient contraction over the gathered rows, whose chunks add into one
output behind the comm stream's per-chunk events (Note [Gathers in flight on
the comm stream]: the one multi-rank check of that ordering on a real GPU), on
the symm_mem path, each against plain eager on the CPU; then a peer that dies
mid-program (rank 0 must fail within the group's timeout, not hang). Prints a
table; exits non-zero on a mismatch, a fused path that did not run, or a part
that did not run. Without CUDA it says so and exits 0.

``--shared-dry-run`` runs the two-process part on CPU with the ring backend
(the plumbing of that part, where no GPU is at hand); on a torch whose CPU
``_scaled_mm`` takes tensor-wise scales only (2.11) it skips the row-wise FP8
case, and says so.
``bash benchmarks/gpu_check.sh [OUTDIR]`` runs the CUDA tests and then this
check, with logs in OUTDIR.
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
    parser.add_argument("--shared-timeout", type=float, default=120.0, help="seconds for the two-process part")
    parser.add_argument("--shared-dry-run", action="store_true", help="the two-process part only, on CPU (ring)")
    parser.add_argument(
        "--dead-peer-timeout", type=float, default=10.0, help="the group timeout (s) of the dead-peer part"
    )
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

    from eagertp import EagerMicroPipeline
    from eagertp._compat import funcol_all_gather, funcol_reduce_scatter

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
            "all_gather_matmul": lambda: funcol_all_gather(a, 0, group) @ b,
            "matmul_reduce_scatter": lambda: funcol_reduce_scatter(a @ b, "sum", 0, group).wait(),
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


def _shared_worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    """One of two ranks on one device: eagertp against plain eager, correctness
    only. Always answers on ``results``: its rows, or one saying what failed."""
    import warnings

    from eagertp._compat import exit_spawned_rank

    warnings.simplefilter("ignore", FutureWarning)  # funcol's deprecations
    try:
        rows = _shared_rows(rank, port, args)
    except Exception as e:  # noqa: BLE001 - reported: does symm_mem permit a shared GPU?
        rows = [{"device": "shared", "world_size": 2, "op": "both", "rank": rank, "correct": None,
                 "fused_ran": None, "explain": f"{type(e).__name__}: {e}".splitlines()[0]}]
    results.put(rows)
    results.close()
    results.join_thread()  # NB: the queue's feeder thread must deliver before os._exit
    exit_spawned_rank(0)


def _shared_rows(rank: int, port: int, args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist

    import torch.distributed._functional_collectives as funcol

    from eagertp import EagerMicroPipeline
    from eagertp._compat import cpu_scaled_mm_takes_rowwise_scales, funcol_all_gather, funcol_reduce_scatter

    device, backend = ("cpu", "ring") if args.shared_dry_run else ("cuda", "symm_mem")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.group.WORLD
    rows = []
    try:
        # NB: correctness only, checked against plain eager on the CPU: at most
        # 1024 per dim keeps that reference quick.
        m, k, n = (min(v, 1024) for v in (args.m, args.k, args.n))
        g = torch.Generator().manual_seed(rank)
        a = torch.randn(m // 2, k, generator=g).to(device, torch.bfloat16)
        b = torch.randn(k, n, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
        h = torch.randn(m, n, generator=torch.Generator().manual_seed(8)).to(device, torch.bfloat16)
        # op -> (program, the stat that proves it fused, atol)
        def two_in_flight(x):  # two gathers in flight on the comm stream, consumed in reverse order
            first, second = funcol_all_gather(x, 0, group), funcol_all_gather(x * 2, 0, group)
            later = second @ b.to(x.device)
            return torch.cat([first @ b.to(x.device), later])

        def scaled_odd_rows(x, dequantized=False):
            # Row-wise FP8 with 18 rows a rank: each chunk's scale rows start
            # 72 bytes in, off the 16-byte boundary cuBLAS requires (eagertp
            # copies them). The data gathered as bytes, as float8 training does.
            fp8 = torch.float8_e4m3fn
            x8 = x[:18].float().to(fp8)
            gathered = funcol_all_gather(x8.view(torch.uint8), 0, group).view(fp8)
            w8 = b.to(x.device).float().t().contiguous().to(fp8).t()  # column-major
            scale_a = torch.full((36, 1), 0.5, device=x.device)
            scale_b = torch.full((1, w8.shape[1]), 2.0, device=x.device)
            if dequantized:  # NB: what _scaled_mm computes, on any CPU (torch 2.11's takes tensor-wise scales only)
                return ((gathered.float() * scale_a) @ (w8.float() * scale_b)).to(torch.bfloat16)
            return torch._scaled_mm(gathered, w8, scale_a, scale_b, out_dtype=torch.bfloat16)

        cases = {
            "all_gather_matmul": (
                lambda x: funcol_all_gather(x, 0, group) @ b.to(x.device), "all_gather_matmul", 2e-2
            ),
            "scaled_rowwise_odd_rows": (scaled_odd_rows, "all_gather_matmul", 5e-1),
            "two_gathers_in_flight": (two_in_flight, "all_gather_matmul", 4e-2),
            # A weight gradient: every chunk adds into one output (ordered across
            # streams). Its sums of m products reach ~sqrt(m): a bf16 ulp is ~0.25 there.
            "all_gather_contraction": (
                lambda x: funcol_all_gather(x, 0, group).t() @ h.to(x.device), "all_gather_matmul", 5e-1
            ),
            "matmul_reduce_scatter": (
                lambda x: funcol_reduce_scatter(x @ b.to(x.device), "sum", 0, group).wait(),
                "matmul_reduce_scatter",
                2e-2,
            ),
            # Its reduce-scatter half through torch's primitive, its gather half on the comm stream.
            "matmul_all_reduce": (
                lambda x: funcol.all_reduce(x @ b.to(x.device), "sum", group).wait(), "matmul_all_reduce", 4e-2
            ),
        }
        references = {"scaled_rowwise_odd_rows": lambda x: scaled_odd_rows(x, dequantized=True)}
        for op, (program, stat, atol) in cases.items():
            row = {"device": f"{device}:0 shared", "world_size": 2, "op": op, "rank": rank}
            if op == "scaled_rowwise_odd_rows" and device == "cpu" and not cpu_scaled_mm_takes_rowwise_scales():
                row.update(correct=None, fused_ran=None, skipped="this torch's CPU _scaled_mm takes tensor-wise scales only")
                rows.append(row)
                continue
            expected = references.get(op, program)(a.cpu())  # plain eager, on gloo's CPU path
            try:
                pipe = EagerMicroPipeline(backend=backend, min_fuse_bytes=0)
                with pipe:
                    got = program(a)
                ok = torch.allclose(got.float().cpu(), expected.float(), rtol=2e-2, atol=atol)
                row.update(correct=ok, fused_ran=pipe.stats[stat] == 1, explain=pipe.explain())
            except Exception as e:  # noqa: BLE001 - reported: does symm_mem permit a shared GPU?
                row.update(correct=None, fused_ran=None, explain=f"{type(e).__name__}: {e}".splitlines()[0])
            if row["fused_ran"] is not None and op == "two_gathers_in_flight":
                row["fused_ran"] = pipe.stats[stat] == 2
            rows.append(row)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return rows


def _start_pair(worker, args: argparse.Namespace):
    """Two spawned ranks sharing one device, ``worker(rank, port, args,
    results)`` each; the processes and the queue they answer on."""
    import multiprocessing
    import socket

    # Two ranks on one device: torch's workspace rendezvous refuses "allocations
    # from overlapping devices" unless told that is intended. Without this the
    # part never reaches the gather path (world size 1 skips the workspace and
    # its barriers), so the check would prove nothing about it.
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(rank, port, args, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    return procs, results


def check_shared_device(args: argparse.Namespace) -> list[dict]:
    """Two processes on one device; a row per op and rank (correctness only),
    or one row saying why it could not run."""
    import queue

    procs, results = _start_pair(_shared_worker, args)
    rows: list[dict] = []
    try:
        for _ in procs:
            rows += results.get(timeout=args.shared_timeout)
    except queue.Empty:
        rows = [{"device": "shared", "world_size": 2, "op": "both", "correct": None, "fused_ran": None,
                 "explain": f"no answer within {args.shared_timeout:g} s (a hang or a crashed rank)"}]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    return sorted(rows, key=lambda r: (r.get("rank", -1), r["op"]))


def _dead_peer_worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    """Rank 1 dies after one fused gather; rank 0 then issues another, which
    must fail within the group's timeout (symm_mem: torch's barrier times out
    and traps, Note [Barriers time out]; the ring: a PeerError), never hang.
    Rank 0 answers on ``results`` if it can (a trap may end it first)."""
    import datetime
    import time
    import warnings

    import torch
    import torch.distributed as dist

    from eagertp import EagerMicroPipeline
    from eagertp._compat import exit_spawned_rank, funcol_all_gather

    warnings.simplefilter("ignore", FutureWarning)
    device, backend = ("cpu", "ring") if args.shared_dry_run else ("cuda", "symm_mem")
    if device == "cuda":
        torch.cuda.set_device(0)
    timeout = datetime.timedelta(seconds=args.dead_peer_timeout)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    group = dist.group.WORLD
    a = torch.ones(64, 128, device=device)
    b = torch.ones(128, 32, device=device)
    with EagerMicroPipeline(backend=backend, min_fuse_bytes=0):
        (funcol_all_gather(a, 0, group) @ b).sum().item()  # both alive: sets the group up
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        exit_spawned_rank(0)  # dies before the next collective
    start = time.monotonic()
    try:
        with EagerMicroPipeline(backend=backend, min_fuse_bytes=0):
            (funcol_all_gather(a, 0, group) @ b).sum().item()
        if device == "cuda":
            torch.cuda.synchronize()
        outcome = "no error: the gather completed without its peer"
    except Exception as e:  # noqa: BLE001 - reported: the failure is what this checks
        outcome = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    results.put({"seconds": time.monotonic() - start, "outcome": outcome})
    results.close()
    results.join_thread()
    exit_spawned_rank(0)


def check_dead_peer(args: argparse.Namespace) -> dict:
    """One row: did rank 0 fail within the group's timeout when its peer died?"""
    import queue

    procs, results = _start_pair(_dead_peer_worker, args)
    bound = args.dead_peer_timeout + 60
    row = {"device": "shared", "world_size": 2, "op": "dead_peer", "rank": 0, "fused_ran": True}
    try:
        answer = results.get(timeout=bound)
        failed = not answer["outcome"].startswith("no error")
        row.update(correct=failed, explain=f"after {answer['seconds']:.1f} s: {answer['outcome']}")
    except queue.Empty:
        procs[0].join(timeout=1)
        if procs[0].is_alive():
            row.update(correct=False, explain=f"rank 0 still waiting {bound} s after its peer died: a hang")
        else:  # a device trap ends the process: it failed, as it should, without a word
            row.update(correct=True, explain=f"rank 0 ended (exit code {procs[0].exitcode}) without answering")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return row


def _print_shared(rows: list[dict]) -> None:
    print("two processes sharing one device (gloo group), correctness only:")
    for r in rows:
        if r.get("skipped"):
            print(f"  rank {r['rank']} {r['op']}: skipped: {r['skipped']}")
        elif r["correct"] is None:
            print(f"  rank {r.get('rank', '-')} {r['op']}: not run: {r['explain']}")
        else:
            print(f"  rank {r['rank']} {r['op']}: correct {r['correct']}, fused {r['fused_ran']}")
            if not r["fused_ran"] or r["op"] == "dead_peer":
                print(f"    {r['explain']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.shared_dry_run:
        shared = check_shared_device(args) + [check_dead_peer(args)]
        _print_shared(shared)
        return verdict([], shared)
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
    shared = check_shared_device(args) + [check_dead_peer(args)]
    _print_shared(shared)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size_1": rows, "shared_device": shared}, f, indent=1)
    return verdict(rows, shared)


def verdict(rows: list[dict], shared: list[dict]) -> int:
    """The exit status: 0 only if every row ran, was correct and fused. A part
    that did not run fails the check, loudly: the two-process part is the only
    one that reaches the gather path on a GPU."""
    shared = [r for r in shared if not r.get("skipped")]  # printed; only the CPU dry run skips
    not_run = [r for r in rows + shared if r["correct"] is None]
    if not_run:
        print(f"gpu_check: FAILED: {len(not_run)} part(s) did not run; the first: {not_run[0]['explain']}")
        return 1
    failed = [r for r in rows + shared if not (r["correct"] and r["fused_ran"])]
    if failed:
        print(f"gpu_check: FAILED: {len(failed)} part(s) wrong or not fused")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
