"""A user's script that runs a block and returns normally exits cleanly: exit
code 0 on every rank, no "terminate called" from a gloo thread at the
interpreter's exit. Each case launches fresh rank processes
(``tests/exit_script.py``), once by default; ``EAGERTP_EXIT_RUNS=100`` for
the long manual check (200 script runs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from multirank import _free_port

RUNS = int(os.environ.get("EAGERTP_EXIT_RUNS", "1"))
SCRIPT = os.path.join(os.path.dirname(__file__), "exit_script.py")


def _launch(world: int, destroy: bool) -> list[tuple[int, str]]:
    """Every rank's (exit code, stderr), as torchrun would start them."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DESTROY="1" if destroy else "0",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, SCRIPT], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, err))
    return results


@pytest.mark.parametrize("world, destroy", [(2, True), (4, False)], ids=["2_ranks_destroyed", "4_ranks_left_to_exit"])
def test_a_users_script_exits_cleanly(world, destroy):
    for run in range(RUNS):
        for rank, (code, err) in enumerate(_launch(world, destroy)):
            assert code == 0 and "terminate called" not in err, f"run {run}, rank {rank}: exit code {code}\n{err[-3000:]}"
