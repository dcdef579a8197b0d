"""What every benchmark here shares: spawning gloo ranks (optionally behind a
rate-limited loopback in a fresh network namespace), timing, and output.

Timing: every sample is taken on all ranks between barriers, and the slowest
rank's time counts (a collective is as fast as its slowest member). Reported
numbers are medians over ``--repeats`` samples after ``--warmup`` unrecorded
ones, the variants of one measurement sampled round-robin. Compare ratios taken
in the same run: these machines are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

IN_NETNS_FLAG = "--in-netns"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--repeats", type=int, default=15, help="timed samples per measurement (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed samples first")
    parser.add_argument(
        "--link-rate",
        default=None,
        help="run the ranks in a new network namespace whose loopback is shaped with "
        "`tc qdisc ... tbf rate RATE` (e.g. 2gbit): transfers take wire time instead of "
        "CPU copy time. Needs root and iproute2.",
    )
    parser.add_argument(
        "--ring-pieces",
        nargs="+",
        default=[],
        metavar="[KIND=]N",
        help="override the ring's maximum pieces per chunk (eagertp.backends.ring.PIECES): N for every "
        "collective, or KIND=N for one (all_gather, reduce_scatter, all_reduce)",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    parser.add_argument(IN_NETNS_FLAG, action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace, worker: Callable[[int, int, argparse.Namespace], Any]) -> Any:
    """Run ``worker(rank, world, args)`` on every rank; return rank 0's result.

    With ``--link-rate`` (and not yet inside), re-run this script inside a
    shaped network namespace and return what it wrote.
    """
    if args.link_rate and not args.in_netns:
        return _run_in_shaped_netns(args)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    mp.start_processes(_entry, args=(args.world_size, port, args, worker, results), nprocs=args.world_size, start_method="spawn")
    result = results.get()
    if args.in_netns:
        print(json.dumps(result))  # the parent outside the namespace reads this line
        raise SystemExit(0)
    return result


def _entry(rank, world, port, args, worker, results) -> None:
    import faulthandler

    faulthandler.enable()  # a crash in a rank prints where it was
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore", FutureWarning)  # funcol's deprecations, once per rank otherwise
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    apply_ring_pieces(args.ring_pieces)
    try:
        result = worker(rank, world, args)
        if rank == 0:
            results.put(result)
        # NB: tear down together: a rank that closes its connections while a
        # peer's gloo threads still use them can abort that peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    from eagertp._compat import exit_spawned_rank

    exit_spawned_rank(0)


def apply_ring_pieces(overrides: list[str]) -> None:
    """``--ring-pieces``: set the ring's maximum pieces per chunk, in a rank."""
    from eagertp.backends import ring

    for item in overrides:
        kind, _, n = item.rpartition("=")
        for k in [kind] if kind else list(ring.PIECES):
            if k not in ring.PIECES:
                raise SystemExit(f"--ring-pieces: unknown kind {k!r}; kinds: {', '.join(ring.PIECES)}")
            ring.PIECES[k] = (int(n), ring.PIECES[k][1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_in_shaped_netns(args: argparse.Namespace) -> Any:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("--link-rate needs root and iproute2 (ip, tc); run without it for plain loopback")
    name = f"eagertp-bench-{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        # NB: burst must hold at least one loopback packet (MTU 64 KiB).
        subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", args.link_rate, "burst", "1mb", "latency", "100ms"],
            check=True,
        )
        cmd = ["ip", "netns", "exec", name, sys.executable, *sys.argv, IN_NETNS_FLAG]
        done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"benchmark in network namespace {name} failed: {e}") from None
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, stderr=subprocess.DEVNULL)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_interleaved(fns: dict[str, Callable[[], Any]], group, *, repeats: int, warmup: int) -> dict[str, float]:
    """For each function, the median over samples of the slowest rank's seconds,
    sampled round-robin (``eagertp.calibrate.time_round_robin``)."""
    from eagertp.calibrate import time_round_robin

    times = time_round_robin(list(fns.values()), group, repeats=repeats, warmup=warmup)
    return dict(zip(fns, times))


def write_json(path: str | None, payload: dict) -> None:
    if path is not None:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Render ``rows`` with ``columns`` of (key, header, format)."""
    widths = [max(len(h), *(len(format(r[k], f)) for r in rows)) for k, h, f in columns]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths))]
    for r in rows:
        lines.append("  ".join(format(r[k], f).rjust(w) for (k, _, f), w in zip(columns, widths)))
    return "\n".join(lines)


@contextlib.contextmanager
def quiet_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
