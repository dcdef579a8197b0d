"""benchmarks/gpu_check.py's two-process part, dry-run on CPU: the GPU check
runs only where a CUDA device is (``bash benchmarks/gpu_check.sh``), so its
plumbing (spawning, a gloo group, comparing against plain eager, reporting)
must not rot where none is."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from eagertp._compat import cpu_scaled_mm_takes_rowwise_scales


def test_gpu_check_shared_device_part_runs_on_cpu():
    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--shared-dry-run", "--m", "256", "--k", "128", "--n", "64",
         "--shared-timeout", "60", "--dead-peer-timeout", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rowwise = cpu_scaled_mm_takes_rowwise_scales()
    for rank in (0, 1):
        for op in (
            "all_gather_matmul", "scaled_rowwise_odd_rows", "two_gathers_in_flight", "all_gather_contraction",
            "matmul_reduce_scatter", "matmul_all_reduce",
        ):
            if op == "scaled_rowwise_odd_rows" and not rowwise:
                assert f"rank {rank} {op}: skipped: this torch's CPU _scaled_mm" in done.stdout, done.stdout
                continue
            assert f"rank {rank} {op}: correct True, fused True" in done.stdout, done.stdout
    # The dead peer: rank 0's ring gather fails within the group's timeout (here 5 s).
    assert "rank 0 dead_peer: correct True, fused True" in done.stdout, done.stdout


def test_gpu_check_fails_when_a_part_did_not_run():
    """A part that could not run (torch's rendezvous refusing two ranks on one
    device, a hang) fails the check instead of dropping out of it."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    ran = {"correct": True, "fused_ran": True, "explain": ""}
    not_run = {"correct": None, "fused_ran": None, "explain": "RuntimeError: detected allocations from overlapping devices"}
    assert gpu_check.verdict([ran], [ran, ran]) == 0
    assert gpu_check.verdict([ran], [ran, not_run]) == 1
    assert gpu_check.verdict([dict(ran, fused_ran=False)], []) == 1
