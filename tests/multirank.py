"""A pool of gloo worker processes kept alive across tests.

Importing torch dominates the cost of a multi-rank test on 2 cores, so the pool
starts WORLD processes once per session. ``pool.run(fn, world_size, *args)``
runs ``fn(rank, group, *args)`` on ranks ``0 .. world_size - 1`` (``group`` is a
gloo group of exactly those ranks) and returns the per-rank results.

Every test is bounded in time twice over: each collective has the process
group's timeout (``COLLECTIVE_TIMEOUT``), and ``run`` gives up after ``timeout``
seconds, kills the workers and fails the test. After any failure the pool is
restarted, so one broken test cannot leave a half-finished collective behind
for the next.

A worker that dies unexpectedly fails the test with ``WorkerDied``, which says
how each dead rank ended (exit code or signal), what ``faulthandler`` wrote
when it crashed (every thread's Python stack), and the jobs the pool ran
before: a crash from memory corrupted earlier may surface tests later. A
crash is never run again into a pass: it is a bug, as a hang is.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

WORLD = 4
COLLECTIVE_TIMEOUT = timedelta(seconds=20)
SHORT_TIMEOUT = timedelta(seconds=5)  # SHORT_GROUPS: tests that wait for a peer that never comes
TEST_TIMEOUT = 60.0  # seconds, per run()

# Inside a worker: world size -> a second gloo group over ranks 0 .. n - 1.
OTHER_GROUPS: dict[int, Any] = {}
# Inside a worker: world size -> a gloo group over ranks 0 .. n - 1 with SHORT_TIMEOUT.
SHORT_GROUPS: dict[int, Any] = {}


class RankError(AssertionError):
    """A worker raised; the message holds every failing rank's traceback."""


class WorkerDied(RuntimeError):
    """A worker process exited mid-test (gloo aborts a process on some errors)."""


def fuse_every_size() -> None:
    """Tests prove fusion on small shapes, which the size rule (Note [Size rule])
    would issue as written; its own tests pass ``min_fuse_bytes`` explicitly.
    And they prove the chunked pipeline, which a landed gather skips (Note
    [Landed gathers]); its own test switches that back on."""
    from eagertp import patterns
    from eagertp.backends import MIN_FUSE_BYTES

    MIN_FUSE_BYTES.update(dict.fromkeys(MIN_FUSE_BYTES, 0))
    patterns.WHOLE_WHEN_LANDED = False


@dataclasses.dataclass
class _Job:
    fn: Callable[..., Any]
    world_size: int
    args: tuple


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, conn: multiprocessing.connection.Connection, crash_log: str) -> None:
    import faulthandler

    # NB: kept open for the process's life: faulthandler writes to its descriptor.
    crash_file = open(crash_log, "w")
    faulthandler.enable(file=crash_file, all_threads=True)
    # A job that hangs: the pool asks every rank for its stacks before killing it.
    faulthandler.register(signal.SIGUSR1, file=crash_file, all_threads=True)
    # NB: multiprocessing's temporary folder (a listener socket) goes with the
    # pool's: a worker killed by restart() never removes its own.
    tempfile.tempdir = os.path.dirname(crash_log)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    fuse_every_size()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=COLLECTIVE_TIMEOUT,
    )
    # Every rank must create every group, in the same order.
    groups = {n: dist.new_group(list(range(n)), timeout=COLLECTIVE_TIMEOUT) for n in (1, 2, 3)}
    groups[WORLD] = dist.group.WORLD
    # A second group over the same ranks, for tests that need a group the mode
    # does not manage (new_group needs every rank, so it is made here, once).
    OTHER_GROUPS.update({n: dist.new_group(list(range(n)), timeout=COLLECTIVE_TIMEOUT) for n in (2, 4)})
    SHORT_GROUPS.update({n: dist.new_group(list(range(n)), timeout=SHORT_TIMEOUT) for n in (2, 3)})
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            break
        if rank >= job.world_size:
            conn.send(("idle", None, _groups_made()))
            continue
        try:
            result = job.fn(rank, groups[job.world_size], *job.args)
        except BaseException:  # noqa: B036 - reported to the parent
            conn.send(("error", traceback.format_exc(), _groups_made()))
        else:
            conn.send(("ok", result, _groups_made()))
    # NB: tear down together: a rank that closes its connections while a peer's
    # gloo threads still use them can abort that peer.
    dist.barrier()
    dist.destroy_process_group()
    from eagertp._compat import exit_spawned_rank

    exit_spawned_rank(0)


# Note [Groups made by jobs]
# ---------------------------
# c10d names a new group by a counter every rank of the default group keeps,
# and a non-member returns from new_group without a word, so every one of the
# pool's WORLD ranks must make every group, in the same order. A job on fewer
# ranks that makes one (init_device_mesh over 2 of the 4 ranks) leaves the
# counters apart: a later job's new group then waits on the store for keys
# its peers wrote under other names, a hang far from its cause (2026-12-03 at c733743:
# test_pipelining's 2 x 2 mesh, 60 s, after a 2-rank init_device_mesh in
# test_matmul_all_gather). So each rank reports how many groups it has made
# after every job, and a job that left them apart fails by name. A job on
# fewer ranks takes its mesh from its group: DeviceMesh.from_group(group).


def _groups_made() -> int:
    import torch.distributed.distributed_c10d as c10d

    return c10d._world.group_count


class WorkerPool:
    def __init__(self) -> None:
        self._procs: list[mp.Process] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._crash_dir = tempfile.mkdtemp(prefix="eagertp-workers-")
        self._recent: list[str] = []  # jobs since the pool started
        self._start()

    def _crash_log(self, rank: int) -> str:
        return os.path.join(self._crash_dir, f"rank{rank}.log")

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._recent.clear()
        for rank in range(WORLD):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, port, child, self._crash_log(rank)), daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + 120
        for conn in self._conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise TimeoutError("gloo worker pool did not start within 120 s")
            assert conn.recv() == "ready"

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []
        shutil.rmtree(self._crash_dir, ignore_errors=True)

    def _how_workers_died(self) -> str:
        """For WorkerDied: how each dead rank ended, what faulthandler wrote,
        and the jobs the pool ran since it started."""
        lines = []
        for rank, proc in enumerate(self._procs):
            proc.join(timeout=2)
            if proc.exitcode is None:
                continue
            code = proc.exitcode
            lines.append(f"rank {rank}: " + (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"))
            lines += self._faulthandler_output(rank)
        lines.append(self._jobs_since_start())
        return "\n".join(lines)

    def _stacks_of_live_workers(self) -> str:
        """For a hang: every live rank's threads' stacks (faulthandler, on
        SIGUSR1), and the jobs the pool ran since it started."""
        live = [(rank, proc) for rank, proc in enumerate(self._procs) if proc.is_alive()]
        for _, proc in live:
            os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)  # NB: faulthandler writes from the signal handler, at once
        lines = [line for rank, _ in live for line in self._faulthandler_output(rank)]
        return "\n".join([*lines, self._jobs_since_start()])

    def _faulthandler_output(self, rank: int) -> list[str]:
        try:
            with open(self._crash_log(rank), errors="replace") as f:
                out = f.read()[-4000:]
        except OSError:  # it died before faulthandler opened its file
            out = ""
        return [f"rank {rank}'s faulthandler:\n{out}"] if out else []

    def _jobs_since_start(self) -> str:
        shown = self._recent[-40:]
        head = f"jobs since the pool started ({len(self._recent)}; the last {len(shown)}, oldest first):"
        return "\n  ".join([head, *shown])

    def restart(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join()
        self._procs, self._conns = [], []
        self._start()

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout: float = TEST_TIMEOUT,
        dying_ranks: frozenset[int] = frozenset(),
    ) -> list[Any]:
        """``fn(rank, group, *args)`` on ``world_size`` ranks; their results in rank order.

        ``dying_ranks``: ranks whose process is meant to exit mid-job; their
        result is None, and the pool restarts afterwards (the survivors' groups
        are broken). Any other worker that dies raises ``WorkerDied``."""
        assert 1 <= world_size <= WORLD, f"world_size {world_size} not in 1..{WORLD}"
        job = _Job(fn, world_size, args)
        self._recent.append(f"{fn.__name__} on {world_size} ranks, args {args!r:.100}")
        deadline = time.monotonic() + timeout
        replies: list[tuple[str, Any] | None] = [None] * WORLD
        try:
            for conn in self._conns:
                conn.send(job)
            for rank, conn in enumerate(self._conns):
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    stacks = self._stacks_of_live_workers()
                    self.restart()
                    raise TimeoutError(
                        f"{fn.__name__} on {world_size} ranks: rank {rank} did not finish "
                        f"within {timeout} s (hang); worker pool restarted\n{stacks}"
                    )
                try:
                    replies[rank] = conn.recv()
                except EOFError:
                    if rank not in dying_ranks:
                        raise
                    replies[rank] = ("ok", None)
        except TimeoutError:  # NB: a hang, not a death (TimeoutError is an OSError): never run again
            raise
        except (EOFError, OSError) as e:  # a worker process died (e.g. gloo aborted it)
            how = self._how_workers_died()
            self.restart()
            raise WorkerDied(
                f"{fn.__name__} on {world_size} ranks: a worker process died ({e!r}); pool restarted\n{how}"
            ) from e
        if dying_ranks:
            self.restart()
        errors = [f"--- rank {r} ---\n{rep[1]}" for r, rep in enumerate(replies) if rep[0] == "error"]
        made = [rep[2] for rep in replies if len(rep) > 2]  # NB: a dying rank's reply is ("ok", None)
        if len(set(made)) > 1:  # Note [Groups made by jobs]
            errors.append(
                f"groups made so far, by rank: {made}: this job made process groups on some of the pool's "
                f"{WORLD} ranks only (new_group needs every rank; later groups would hang). Take a mesh "
                "from the job's group instead: DeviceMesh.from_group(group, 'cpu')"
            )
        if errors:
            self.restart()
            raise RankError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(errors))
        return [rep[1] for rep in replies[:world_size]]
