"""benchmarks/gpu_check.py's two-process part, dry-run on CPU: the GPU check
runs only where a CUDA device is (``bash benchmarks/gpu_check.sh``), so its
plumbing (spawning, a gloo group, comparing against plain eager, reporting)
must not rot where none is."""

from __future__ import annotations

import pathlib
import subprocess
import sys


def test_gpu_check_shared_device_part_runs_on_cpu():
    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--shared-dry-run", "--m", "256", "--k", "128", "--n", "64",
         "--shared-timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        for op in ("all_gather_matmul", "all_gather_contraction", "matmul_reduce_scatter"):
            assert f"rank {rank} {op}: correct True, fused True" in done.stdout, done.stdout
