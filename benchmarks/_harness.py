"""What every benchmark here shares: spawning gloo ranks (optionally behind a
rate-limited link in fresh network namespaces), timing, and output.

Shaped links (``--link-rate RATE``), so that transfers take wire time instead
of CPU copy time, in two forms (``--duplex``):

    half (default): every rank in one namespace, its loopback shaped with tbf:
        one queue carries both ranks' sends, so a 2-rank exchange takes twice
        a one-way transfer (a shared bus; the rig the hand-schedule targets were set on)
    full: each rank in a namespace of its own, its veth port on a bridge
        shaped both ways (rank -> bridge, bridge -> rank): a switch with
        full-duplex ports, as NVLink, InfiniBand and Ethernet are; an exchange
        takes one transfer's time

    full, 2 ranks:   rank 0 [r0] ==tbf==> [s0] br0 [s1] ==tbf==> [r1] rank 1
                            [r0] <==tbf== [s0]     [s1] <==tbf== [r1]

tbf's burst (``--link-burst``) is one packet by default, as on a wire: a link
that idled moves the next bytes no faster. A larger bucket fills while the link
idles and then lets that many bytes through at memory speed: with 1 MB, a 512
KiB exchange took 0.7 ms after an idle spell against 4.2 ms back to back
(benchmarks/NOTES.md, 2026-12-02 at 445c947), which favours a collective issued after a
matmul (plain eager's) over one overlapped with it.

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
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

IN_NETNS_FLAG = "--in-netns"
# --duplex full: the ranks' namespaces, in rank order (set for the spawned ranks).
RANK_NETNS_ENV = "EAGERTP_BENCH_RANK_NETNS"
_SUBNET = "10.213.0"  # rank i is .{i + 1}, inside namespaces of its own only
# tbf's smallest burst: it must hold one packet (loopback's MTU, 64 KiB, and the
# veths' 65000, plus headers), or packets larger than the bucket never leave.
ONE_PACKET = "70kb"


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
        "--duplex",
        choices=["half", "full"],
        default="half",
        help="with --link-rate: half: one shaped loopback that both directions share (an exchange "
        "takes twice a one-way transfer); full: a namespace per rank on a bridge, each port "
        "shaped both ways, as real links are",
    )
    parser.add_argument(
        "--link-burst",
        default=ONE_PACKET,
        help="with --link-rate: tbf's burst, the bytes an idle link lets through at once before the rate "
        "applies. Default: one packet (a wire: nothing moves faster after idling). 1mb was the default "
        "before 2026-12-02: a transfer after an idle spell (plain eager's, after its matmul) then skips "
        "up to 1 MB of wire time",
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
    if args.duplex == "full" and not args.link_rate:
        raise SystemExit("--duplex full shapes a link: give its rate with --link-rate (e.g. 2gbit)")
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
    host = "127.0.0.1"
    if os.environ.get(RANK_NETNS_ENV):  # --duplex full: this rank's own namespace and port
        _enter_netns(os.environ[RANK_NETNS_ENV].split(",")[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = f"r{rank}"
        host = f"{_SUBNET}.1"  # rank 0 holds the store
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world)
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


def link_name(args: argparse.Namespace) -> str:
    """The link the ranks ran on, as the benchmarks print it."""
    if not args.link_rate:
        return "loopback"
    burst = "" if args.link_burst == ONE_PACKET else f", burst {args.link_burst}"
    return f"{args.link_rate} ({args.duplex} duplex{burst})"


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
    made: list[str] = []

    def ip(*cmd: str, ns: str | None = None) -> None:
        subprocess.run([*(["ip", "netns", "exec", ns] if ns else []), *cmd], check=True)

    def shape(dev: str, ns: str) -> None:
        ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", args.link_rate, "burst", args.link_burst,
           "latency", "100ms", ns=ns)

    def add_netns(ns: str) -> None:
        ip("ip", "netns", "add", ns)
        made.append(ns)
        ip("ip", "link", "set", "lo", "up", ns=ns)

    env = dict(os.environ)
    try:
        if args.duplex == "half":
            add_netns(name)
            shape("lo", name)
            driver_ns = name
        else:
            switch = f"{name}-sw"
            add_netns(switch)
            ip("ip", "link", "add", "br0", "type", "bridge", ns=switch)
            ip("ip", "link", "set", "br0", "up", ns=switch)
            ranks = [f"{name}-r{i}" for i in range(args.world_size)]
            for i, ns in enumerate(ranks):
                add_netns(ns)
                ip("ip", "link", "add", f"r{i}", "netns", ns, "type", "veth", "peer", "name", f"s{i}", "netns", switch)
                ip("ip", "addr", "add", f"{_SUBNET}.{i + 1}/24", "dev", f"r{i}", ns=ns)
                # NB: loopback's MTU, so that packets (and the CPU per byte) are as in half duplex.
                for dev, where in ((f"r{i}", ns), (f"s{i}", switch)):
                    ip("ip", "link", "set", dev, "mtu", "65000", ns=where)
                    shape(dev, where)
                ip("ip", "link", "set", f"s{i}", "master", "br0", ns=switch)
                ip("ip", "link", "set", f"s{i}", "up", ns=switch)
                ip("ip", "link", "set", f"r{i}", "up", ns=ns)
            driver_ns = ranks[0]
            env[RANK_NETNS_ENV] = ",".join(ranks)
        cmd = ["ip", "netns", "exec", driver_ns, sys.executable, *sys.argv, IN_NETNS_FLAG]
        done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"benchmark in network namespace {name} failed: {e}") from None
    finally:
        for ns in reversed(made):  # NB: deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "delete", ns], check=False, stderr=subprocess.DEVNULL)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _enter_netns(ns: str) -> None:
    """Move this process (before it opens any socket or starts gloo's threads,
    which inherit it) into network namespace ``ns`` (``ip netns`` made it)."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {ns} failed")
    finally:
        os.close(fd)


def time_interleaved(
    fns: dict[str, Callable[[], Any]], group, *, repeats: int, warmup: int, rounds: list[dict[str, float]] | None = None
) -> dict[str, float]:
    """For each function, the median over samples of the slowest rank's seconds,
    sampled round-robin (``eagertp.calibrate.time_round_robin``); ``rounds``,
    if given, receives each round's samples by name."""
    from eagertp.calibrate import time_round_robin

    by_round: list[list[float]] = []
    times = time_round_robin(list(fns.values()), group, repeats=repeats, warmup=warmup, rounds=by_round)
    if rounds is not None:
        rounds.extend(dict(zip(fns, r)) for r in by_round)
    return dict(zip(fns, times))


def ratio_spread(rounds: list[dict[str, float]], num: str, den: str) -> tuple[float, float, float]:
    """``num / den`` taken within each round: (lower quartile, median, upper
    quartile). Both run in the same round, close in time, so machine drift
    mostly cancels; the spread says how far one run's ratio can be trusted."""
    ratios = sorted(r[num] / r[den] for r in rounds)
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q2, q3


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
