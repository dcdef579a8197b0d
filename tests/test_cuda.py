"""CUDA checks: they run where a GPU is present and skip cleanly elsewhere.

On one GPU, a one-rank NCCL group still runs torch's symmetric-memory
primitives for real (workspace, barriers, the backend stream, CUDA and FP8
kernels); only the peers are missing (``benchmarks/gpu_check.py`` tries two
processes on one device). The cases are the multi-rank tests' own workers, run
with ``torch.device("cuda")`` as the default device. So that they cannot rot
where no GPU is at hand, ``test_cuda_cases_on_cpu`` runs the same table on one
gloo rank with symmetric memory emulated (tests/symm_mem_emulation.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from symm_mem_emulation import with_cpu_symm_mem
from test_matmul_reduce_scatter import _sp_mlp_worker
from test_scaled import _gather_scaled_worker, _scaled_reduce_scatter_worker
from test_scaled_gathered_scale import _rowwise_worker
from test_symm_mem import _mlp_worker

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FUSED_BOTH = {"all_gather_matmul": 1, "fused_matmuls": 1, "matmul_reduce_scatter": 1}


@dataclasses.dataclass
class Case:
    worker: Callable
    args: tuple
    stats: dict  # what pipe.stats must say: the fused path ran
    scaled_mm: tuple | None = None  # (scales, out_dtype, bias) this device's _scaled_mm must take

    def check(self, r: dict) -> None:
        assert all(r["ok"]) if isinstance(r["ok"], list) else r["ok"], r
        assert r["stats"] == self.stats, r
        # symm_mem moved the data: neither the ring nor the plain collective ran
        assert r.get("p2p_ops", 0) == 0 and r.get("plain_all_gathers", 0) == 0, r
        assert r.get("plain_reduce_scatters", 0) == 0, r
        said = r.get("explain") or r.get("trace")  # what the worker kept of the pipeline's account
        assert said is None or ("[symm_mem]" in said and "[ring" not in said), said


CASES = {
    "mlp-dim0-sum": Case(_mlp_worker, (0, "sum"), FUSED_BOTH),
    "mlp-dim1-avg": Case(_mlp_worker, (1, "avg"), FUSED_BOTH),
    "mlp-dim0-max": Case(_mlp_worker, (0, "max"), FUSED_BOTH),
    "sp-mlp-fwd-bwd-seq-first": Case(
        _sp_mlp_worker, ("symm_mem", 0), {"all_gather_matmul": 2, "fused_matmuls": 3, "matmul_reduce_scatter": 2}
    ),
    "sp-mlp-fwd-bwd-batch-first": Case(
        _sp_mlp_worker, ("symm_mem", 1), {"all_gather_matmul": 2, "fused_matmuls": 3, "matmul_reduce_scatter": 2}
    ),
    "fp8-gather-tensorwise-f32": Case(
        _gather_scaled_worker, ("tensorwise", "f32", False), {"all_gather_matmul": 1, "fused_matmuls": 1},
        scaled_mm=("tensorwise", torch.float32, False),
    ),
    "fp8-gather-tensorwise-bf16-bias": Case(
        _gather_scaled_worker, ("tensorwise", "bf16", True), {"all_gather_matmul": 1, "fused_matmuls": 1},
        scaled_mm=("tensorwise", torch.bfloat16, True),
    ),
    "fp8-gather-rowwise-bf16": Case(
        _gather_scaled_worker, ("rowwise", "bf16", False), {"all_gather_matmul": 1, "fused_matmuls": 1},
        scaled_mm=("rowwise", torch.bfloat16, False),
    ),
    "fp8-gather-rowwise-gathered-scale-bf16": Case(
        _rowwise_worker, (False, 2, True, "bf16", False),
        {"all_gather_matmul": 1, "fused_matmuls": 2, "fused_scale_gathers": 1},
        scaled_mm=("rowwise", torch.bfloat16, True),
    ),
    "fp8-scatter-tensorwise-rows": Case(
        _scaled_reduce_scatter_worker, ("tensorwise", 0), {"matmul_reduce_scatter": 1},
        scaled_mm=("tensorwise", torch.float32, False),
    ),
    "fp8-scatter-tensorwise-columns": Case(
        _scaled_reduce_scatter_worker, ("tensorwise", 1), {"matmul_reduce_scatter": 1},
        scaled_mm=("tensorwise", torch.float32, False),
    ),
}


def _scaled_mm_takes(device: str, scales: str, out_dtype: torch.dtype, bias: bool) -> bool:
    """Whether plain ``_scaled_mm`` on ``device`` takes this configuration (CUDA
    row-wise scaling wants bf16 output; CPU row-wise arrived in torch 2.12):
    with nothing to compare against, a case is skipped, not failed."""
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()
    if scales == "tensorwise":
        sa = sb = torch.tensor(1.0, device=device)
    else:
        sa, sb = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
    bias_t = torch.ones(16, device=device, dtype=out_dtype) if bias else None
    try:
        torch._scaled_mm(a, b, sa, sb, bias=bias_t, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _skip_unless_supported(case: Case, device: str) -> None:
    if case.scaled_mm is not None and not _scaled_mm_takes(device, *case.scaled_mm):
        pytest.skip(f"this torch's {device} _scaled_mm does not take {case.scaled_mm}")


@pytest.fixture(scope="module")
def cuda_group():
    """A one-rank NCCL group on device 0, for this module's tests."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_symm_mem_on_cuda(cuda_group, name):
    case = CASES[name]
    _skip_unless_supported(case, "cuda")
    with torch.device("cuda"):
        r = case.worker(0, cuda_group, *case.args)
    torch.cuda.synchronize()
    case.check(r)


@needs_cuda
def test_auto_picks_symm_mem_on_cuda(cuda_group):
    from helpers import all_gather

    from eagertp import EagerMicroPipeline

    x = torch.randn(64, 32, device="cuda")
    w = torch.randn(32, 16, device="cuda")
    with EagerMicroPipeline() as pipe:
        got = all_gather(x, cuda_group) @ w
    torch.testing.assert_close(got, x @ w)
    assert "fused with mm" in pipe.explain() and "[symm_mem]" in pipe.explain(), pipe.explain()


def _case_on_cpu(rank, group, name):
    case = CASES[name]
    return case.worker(rank, group, *case.args)


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_cases_on_cpu(pool, name):
    """The table above on one gloo rank, symmetric memory emulated."""
    case = CASES[name]
    _skip_unless_supported(case, "cpu")
    (r,) = pool.run(with_cpu_symm_mem, 1, _case_on_cpu, name)
    case.check(r)


@needs_cuda
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
