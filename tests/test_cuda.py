"""CUDA checks: they run where a GPU is present and skip cleanly elsewhere."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_symm_mem_gpu_check_passes_on_one_rank():
    """benchmarks/gpu_check.py on every visible device: correct and fused."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--m", "1024", "--k", "1024", "--n", "1024", "--repeats", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
