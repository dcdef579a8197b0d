"""FP8: aten._scaled_mm consumers and producers fuse like mm (the ring on CPU;
torch's CPU _scaled_mm runs them). Inputs are small integers, exact in
float8_e4m3fn, so fused equals plain eager bitwise. Shapes are multiples of 16,
as _scaled_mm's (CUDA) meta kernel, which validates deferred FP8 matmuls,
requires. Selected by ``-k scaled``."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    FP8, ROWWISE_SCALES, OpCounter, PlainCollectives, all_gather, col_major, fp8_scales, fp8_tensor, fusion_report, integer_tensor,
    reduce_scatter,
)
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on
from expecttest import assert_expected_inline

from eagertp import EagerMicroPipeline

WORLDS = [2, 4]


def _gather_scaled_worker(rank, group, scales, out_dtype_name, bias):
    world = group.size()
    out_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[out_dtype_name]
    x = fp8_tensor((16, 32), seed=rank)  # [M/W, K] shard
    w = col_major(fp8_tensor((32, 16), seed=50))
    scale_a, scale_b = fp8_scales(scales, 16 * world, 16, seed=60)
    b = integer_tensor((16,), out_dtype, seed=70) if bias else None

    def program():
        # As float8 training does: gather the bytes, view them back as FP8
        # (gloo has no float8 dtypes; NCCL users do the same).
        g = all_gather(x.view(torch.uint8), group).view(FP8)
        return torch._scaled_mm(g, w, scale_a, scale_b, bias=b, out_dtype=out_dtype)

    with PlainCollectives() as plain:
        expected = program()
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = program()
    return {
        "ok": torch.equal(got, expected), "dtype": str(got.dtype), "trace": pipe.debug_string(),
        **fusion_report(pipe, counter, plain),
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scales", ["tensorwise", ROWWISE_SCALES])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_all_gather_scaled_matmul(pool, world, scales, out_dtype, bias, backend):
    for r in run_on(backend, pool, _gather_scaled_worker, world, scales, out_dtype, bias):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["plain_all_gathers"] == 0, r
        assert r["collectives_seen"] == (1, 1), r  # no invisible collective
        assert_moved_by(backend, r)


def test_scaled_trace(pool):
    r0 = pool.run(_gather_scaled_worker, 2, "tensorwise", "bf16", True)[0]
    assert_expected_inline(r0["trace"], """\
$0: u8[32, 32] = all_gather(u8[16, 32], group '2' (2 ranks))
$1: bf16[32, 16] = _scaled_mm(bf16[16], $0, f8e4m3[32, 16])
flush: block exited
all_gather_matmul($0 -> $1) [ring]""")


def _scaled_reduce_scatter_worker(rank, group, scales, scatter_dim):
    m, k, n = 32, 32, 32
    a = fp8_tensor((m, k), seed=rank)
    w = col_major(fp8_tensor((k, n), seed=80 + rank))
    scale_a, scale_b = fp8_scales(scales, m, n, seed=90 + rank)

    def program():
        y = torch._scaled_mm(a, w, scale_a, scale_b, out_dtype=torch.float32)
        return reduce_scatter(y, group, "sum", scatter_dim)

    with PlainCollectives() as plain:
        expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter, plain)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scales", ["tensorwise", ROWWISE_SCALES])
@pytest.mark.parametrize("scatter_dim", [0, 1], ids=["rows", "columns"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_scaled_matmul_reduce_scatter(pool, world, scales, scatter_dim, backend):
    for r in run_on(backend, pool, _scaled_reduce_scatter_worker, world, scales, scatter_dim):
        assert r["ok"], r
        assert r["stats"] == {"matmul_reduce_scatter": 1}, r
        assert r["plain_reduce_scatters"] == 0, r
        assert r["collectives_seen"] == (1, 1), r  # no invisible collective
        assert_moved_by(backend, r)


def _scaled_contraction_worker(rank, group):
    """FP8 contracting over the gathered rows needs the gathered tensor
    transposed into a row-major copy (_scaled_mm wants A row-major): the copy
    reads it, so the gather is issued alone, with that reason."""
    x = fp8_tensor((16, 16), seed=rank).view(torch.uint8)
    h = col_major(fp8_tensor((16 * group.size(), 16), seed=5))
    one = torch.tensor(1.0)

    def program():
        g = all_gather(x, group).view(FP8)
        return torch._scaled_mm(g.t().contiguous(), h, one, one, out_dtype=torch.float32)

    expected = program()
    with EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats), "explain": pipe.explain()}


def test_scaled_contraction_over_a_copy_of_the_gather_is_unfused_with_reason(pool):
    results = pool.run(_scaled_contraction_worker, 2)
    for r in results:
        assert r["ok"], r
        assert r["stats"] == {"unfused_all_gather": 1}, r
    assert_expected_inline(results[0]["explain"], """all_gather #0 u8[16, 16] -> u8[32, 16] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten.clone.default read $0, and none ran while it was in flight""")


def _small_fp8_worker(rank, group):
    """FP8 shapes the meta kernel rejects (not multiples of 16) run as plain
    eager would: unfused, with that reason."""
    x = fp8_tensor((4, 16), seed=rank).view(torch.uint8)
    w = col_major(fp8_tensor((16, 8), seed=1))
    one = torch.tensor(1.0)

    def program():
        return torch._scaled_mm(all_gather(x, group).view(FP8), w, one, one, out_dtype=torch.float32)

    expected = program()
    with EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats), "explain": pipe.explain()}


def test_scaled_matmul_the_meta_kernel_rejects_runs_unfused_with_reason(pool):
    results = pool.run(_small_fp8_worker, 2)
    for r in results:
        assert r["ok"] and r["stats"] == {"unfused_all_gather": 1}, r
    assert_expected_inline(results[0]["explain"], """all_gather #0 u8[4, 16] -> u8[8, 16] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten._scaled_mm.default reads it with operands that do not defer (_scaled_mm's meta kernel: Expected both dimensions of mat2 to be divisible by 16 but got torch.Size([16, 8])), and none ran while it was in flight""")


def _unaligned_scale_rows_worker(rank, group):
    """Row-wise scales selected per piece start at ``4 * rows`` bytes: with
    pieces of 6 and 5 rows, off the 16-byte boundary cuBLAS's row-wise kernel
    requires. Every ``_scaled_mm`` eagertp issues gets aligned scales (copied
    where needed), and the result is plain eager's."""
    from unittest import mock

    from eagertp.backends import ring

    world = group.size()
    x = fp8_tensor((16, 32), seed=rank)
    w = col_major(fp8_tensor((32, 16), seed=50))
    scale_a, scale_b = fp8_scales("rowwise", 16 * world, 16, seed=60)
    offsets = []
    original = torch._scaled_mm

    def recording(a, b, sa, sb, *args, **kwargs):
        offsets.extend(t.data_ptr() % 16 for t in (sa, sb) if t.numel() > 1)
        return original(a, b, sa, sb, *args, **kwargs)

    def program():
        g = all_gather(x.view(torch.uint8), group).view(FP8)
        return torch._scaled_mm(g, w, scale_a, scale_b, out_dtype=torch.float32)

    expected = program()
    saved = dict(ring.PIECES)
    ring.PIECES["all_gather"] = (3, 1)  # 16 rows: pieces of 6, 5 and 5
    try:
        with mock.patch.object(torch, "_scaled_mm", recording), EagerMicroPipeline() as pipe:
            got = program()
    finally:
        ring.PIECES.update(saved)
    return {"ok": torch.equal(got, expected), "offsets": offsets, "stats": dict(pipe.stats)}


@pytest.mark.parametrize("scales", [ROWWISE_SCALES])
def test_scaled_matmul_pieces_get_aligned_row_wise_scales(pool, scales):
    for r in pool.run(_unaligned_scale_rows_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert len(r["offsets"]) > 2 and set(r["offsets"]) == {0}, r
