"""FP8 with row-wise scales gathered alongside the data: each rank
quantizes its shard row-wise, then gathers the FP8 bytes (as uint8) and the
per-row scales, and multiplies ``_scaled_mm(gathered, w, gathered_scale,
scale_b)``. The matmul fuses with the data's gather and the scale's gather
rides along (Note [Gathered row-wise scales]). Values are small integers and
powers of two, exact in float8_e4m3fn, so fused equals plain eager bitwise.
Selected by ``-k scaled``."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    FP8, NEEDS_ROWWISE_SCALED_MM, OpCounter, all_gather, col_major, fusion_report, integer_tensor,
)
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on
from expecttest import assert_expected_inline

from eagertp import EagerMicroPipeline

WORLDS = [2, 4]
pytestmark = NEEDS_ROWWISE_SCALED_MM


def _quantized_shard(rank, rows, k=32):
    """A row-wise quantized shard: FP8 data [rows, k] and its scales [rows, 1]
    (powers of two), as float8 training makes them before the all-gather."""
    data = integer_tensor((rows, k), torch.float32, seed=rank).to(FP8)
    g = torch.Generator().manual_seed(100 + rank)
    scale = 2.0 ** torch.randint(-1, 2, (rows, 1), generator=g).float()
    return data, scale.to(torch.get_default_device())


def _gather_both(data, scale, group, scale_first):
    """Gather the FP8 bytes and the scales, in either program order."""
    if scale_first:
        s = all_gather(scale, group)
        g = all_gather(data.view(torch.uint8), group).view(FP8)
    else:
        g = all_gather(data.view(torch.uint8), group).view(FP8)
        s = all_gather(scale, group)
    return g, s


def _rowwise_worker(rank, group, scale_first, consumers, bias, out_dtype_name, fast_accum):
    out_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[out_dtype_name]
    data, scale = _quantized_shard(rank, 16)
    ws = [col_major(integer_tensor((32, 16), torch.float32, seed=50 + i).to(FP8)) for i in range(consumers)]
    g = torch.Generator().manual_seed(60)
    scale_b = (2.0 ** torch.randint(-1, 2, (1, 16), generator=g).float()).to(torch.get_default_device())
    b = integer_tensor((16,), out_dtype, seed=70) if bias else None

    def program():
        x, x_scale = _gather_both(data, scale, group, scale_first)
        return [
            torch._scaled_mm(x, w, x_scale, scale_b, bias=b, out_dtype=out_dtype, use_fast_accum=fast_accum)
            for w in ws
        ]

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=0, trace=True) as pipe:
        got = program()
    return {
        "ok": all(torch.equal(x, y) for x, y in zip(got, expected)),
        "explain": pipe.explain(),
        "trace": pipe.debug_string(),
        **fusion_report(pipe, counter),
    }


def _check_fused(r, backend, consumers=1):
    assert r["ok"], r
    assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": consumers, "fused_scale_gathers": 1}, r
    assert r["plain_all_gathers"] == 0, r
    assert_moved_by(backend, r)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scale_first", [False, True], ids=["data_first", "scale_first"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_rowwise_scale_gathered_with_the_data_fuses(pool, world, scale_first, backend):
    for r in run_on(backend, pool, _rowwise_worker, world, scale_first, 1, False, "f32", False):
        _check_fused(r, backend)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["accum", "fast_accum"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_rowwise_gathered_scale_with_bias_out_dtype_fast_accum(pool, bias, out_dtype, fast_accum, backend):
    for r in run_on(backend, pool, _rowwise_worker, 2, False, 1, bias, out_dtype, fast_accum):
        _check_fused(r, backend)


@pytest.mark.parametrize("scale_first", [False, True], ids=["data_first", "scale_first"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_consumers_sharing_the_gathered_pair(pool, scale_first, backend):
    """Q, K and V of one quantized input: one fused call, one scale gather."""
    for r in run_on(backend, pool, _rowwise_worker, 2, scale_first, 3, True, "bf16", False):
        _check_fused(r, backend, consumers=3)


def test_rowwise_gathered_scale_explain_and_trace(pool):
    results = pool.run(_rowwise_worker, 2, False, 1, False, "f32", False)
    for r in results:
        _check_fused(r, "ring")
    assert_expected_inline(results[0]["explain"], """\
all_gather #0 u8[16, 32] -> u8[32, 32] on group '2' (2 ranks): fused with _scaled_mm -> $2 [ring]
all_gather #1 f32[16, 1] -> f32[32, 1] on group '2' (2 ranks): fused as scale_a of _scaled_mm -> $2 [ring]""")
    assert_expected_inline(results[0]["trace"], """\
$0: u8[32, 32] = all_gather(u8[16, 32], group '2' (2 ranks))
$1: f32[32, 1] = all_gather(f32[16, 1], group '2' (2 ranks))
$2: f32[32, 16] = _scaled_mm($0, f8e4m3[32, 16])
flush: block exited
all_gather_matmul($0 -> $2) [ring]
all_gather($1, scale_a of $2) [ring]""")


def _pieces_worker(rank, group, scale_first):
    from helpers import with_small_pieces

    return with_small_pieces(rank, group, _rowwise_worker, scale_first, 2, False, "f32", False)


@pytest.mark.parametrize("world", WORLDS)
def test_rowwise_gathered_scale_with_the_data_in_pieces(pool, world):
    """The ring moving each data shard in pieces: each piece's rows take the
    same rows of the scale, which has landed whole for that rank first."""
    for r in pool.run(_pieces_worker, world, False):
        _check_fused(r, "ring", consumers=2)


def _dim1_worker(rank, group, verify=False, batch=2):
    """3-D activations gathered along the sequence dim (funcol's cat of chunks),
    their scales [B, S/W, 1] too."""
    world = group.size()
    data = integer_tensor((batch, 8, 32), torch.float32, seed=rank).to(FP8)
    g = torch.Generator().manual_seed(100 + rank)
    scale = 2.0 ** torch.randint(-1, 2, (batch, 8, 1), generator=g).float()
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)

    def program():
        x = all_gather(data.view(torch.uint8), group, gather_dim=1).view(FP8)
        s = all_gather(scale, group, gather_dim=1)
        return torch._scaled_mm(x.reshape(-1, 32), w, s.reshape(-1, 1), one, out_dtype=torch.float32)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=0, verify=verify) as pipe:
        got = program()
    assert got.shape == (batch * 8 * world, 16)
    return {"ok": torch.equal(got, expected), "explain": pipe.explain(), **fusion_report(pipe, counter)}


def _batch_of_one_pieces_worker(rank, group):
    from helpers import with_small_pieces

    return with_small_pieces(rank, group, _dim1_worker, False, 1)


@pytest.mark.parametrize("world", WORLDS)
def test_rowwise_gathered_scale_of_a_batch_of_one_in_pieces(pool, world):
    """[1, S/W, K] data and [1, S/W, 1] scales: the data travels in pieces of
    its sequence rows (``piece_dim``), each piece's matmul reading the same
    rows of the scale."""
    for r in pool.run(_batch_of_one_pieces_worker, world):
        _check_fused(r, "ring")
        assert r["p2p_ops"] > 4 * (world - 1), "the data travelled in pieces"


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_rowwise_gathered_scale_along_the_sequence_dim(pool, backend):
    for r in run_on(backend, pool, _dim1_worker, 2):
        _check_fused(r, backend)


def test_rowwise_gathered_scale_under_verify(pool):
    """verify=True recomputes plain eager once the scale's gather is whole too."""
    for r in pool.run(_dim1_worker, 2, True):
        assert r["ok"], r
        assert r["stats"]["all_gather_matmul"] == 1 and r["stats"]["fused_scale_gathers"] == 1, r


def _scale_read_first_worker(rank, group):
    """Something reads the gathered scale before the matmul (an amax log): the
    scale's gather completes then, as any read completes it; the matmul still
    fuses with the data's gather, its scale now a whole tensor."""
    data, scale = _quantized_shard(rank, 16)
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)

    def program():
        x, s = _gather_both(data, scale, group, False)
        peak = s.max()
        return torch._scaled_mm(x, w, s, one, out_dtype=torch.float32), peak

    expected = program()
    with EagerMicroPipeline(min_fuse_bytes=0) as pipe:
        got = program()
    ok = all(torch.equal(x, y) for x, y in zip(got, expected))
    return {"ok": ok, "stats": dict(pipe.stats), "explain": pipe.explain()}


def test_scale_read_before_the_matmul_completes_alone(pool):
    results = pool.run(_scale_read_first_worker, 2)
    for r in results:
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "unfused_all_gather": 1}, r
    assert_expected_inline(results[0]["explain"], """\
all_gather #0 u8[16, 32] -> u8[32, 32] on group '2' (2 ranks): fused with _scaled_mm -> $2 [ring]
all_gather #1 f32[16, 1] -> f32[32, 1] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten.max.default read $1, and none ran while it was in flight""")


def _scale_read_after_worker(rank, group):
    """The gathered scale read after the matmul bound it, before anything reads
    the product: the scale completes then, still the fused call's scale."""
    data, scale = _quantized_shard(rank, 16)
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)

    def program():
        x, s = _gather_both(data, scale, group, False)
        y = torch._scaled_mm(x, w, s, one, out_dtype=torch.float32)
        return s.max(), y

    expected = program()
    with EagerMicroPipeline(min_fuse_bytes=0) as pipe:
        got = program()
    ok = all(torch.equal(x, y) for x, y in zip(got, expected))
    return {"ok": ok, "stats": dict(pipe.stats), "explain": pipe.explain()}


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_scale_read_after_binding(pool, backend):
    for r in run_on(backend, pool, _scale_read_after_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "fused_scale_gathers": 1}, r
        assert r["explain"].splitlines()[1].endswith("fused as scale_a of _scaled_mm -> $2 [" + backend + "]"), r


def _mismatched_rows_worker(rank, group):
    """scale_a's rows per rank do not follow A's: A is gathered along dim 0,
    the scale along dim 1 and viewed as a column, so rank i's scales land on
    interleaved rows. Not fused, and explain() says why."""
    data, scale = _quantized_shard(rank, 16)
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)

    def program():
        x = all_gather(data.view(torch.uint8), group).view(FP8)
        s = all_gather(scale, group, gather_dim=1).view(-1, 1)
        return torch._scaled_mm(x, w, s, one, out_dtype=torch.float32)

    expected = program()
    with EagerMicroPipeline(min_fuse_bytes=0) as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats), "explain": pipe.explain()}


def test_mismatched_scale_rows_are_unfused_with_reason(pool):
    results = pool.run(_mismatched_rows_worker, 2)
    for r in results:
        assert r["ok"], r
        assert r["stats"] == {"unfused_all_gather": 2}, r
    assert_expected_inline(results[0]["explain"], """\
all_gather #0 u8[16, 32] -> u8[32, 32] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten._scaled_mm.default reads its row-wise scale_a f32[32, 1] from all_gather #1 (gathered along dim 1, f32[16, 2]), whose rows per rank do not follow A's (gathered along dim 0, u8[32, 32]), and none ran while it was in flight
all_gather #1 f32[16, 1] -> f32[32, 1] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten._scaled_mm.default reads its row-wise scale_a f32[32, 1] from all_gather #1 (gathered along dim 1, f32[16, 2]), whose rows per rank do not follow A's (gathered along dim 0, u8[32, 32]), and none ran while it was in flight""")


def _size_rule_worker(rank, group):
    """Under the default size rule the scale's tiny gather is issued as written
    (a plain all-gather); the data's gather still fuses, its scale whole."""
    data, scale = _quantized_shard(rank, 16)
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)

    def program():
        x, s = _gather_both(data, scale, group, False)
        return torch._scaled_mm(x, w, s, one, out_dtype=torch.float32)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes={"all_gather": 65}) as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter)}


def test_scale_under_the_size_rule_is_issued_as_written(pool):
    for r in pool.run(_size_rule_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "unfused_all_gather": 1}, r
        assert r["plain_all_gathers"] == 1, r


def _order_worker(rank, group, scale_first):
    """What the ring's handles see: each data piece's matmul waits for that
    rank's scale chunk only, and the scale's gather is consumed after the
    data's, so the own chunk's matmul overlaps both transfers."""
    from eagertp.backends.ring import RingBackend

    log = []

    class LoggingRing(RingBackend):
        def start_all_gather(self, shard, ag_out, group):
            handle = super().start_all_gather(shard, ag_out, group)
            name = "data" if shard.dtype == torch.uint8 else "scale"
            consume, wait_chunk = handle.consume, handle.wait_chunk

            def logged_consume(consumer, **kwargs):
                log.append(f"{name}.consume")
                if consumer is None:
                    return consume(None, **kwargs)

                def logged(piece, src, rows):
                    log.append(f"{name}[{src}]")
                    consumer(piece, src, rows)

                return consume(logged, **kwargs)

            def logged_wait_chunk(src):
                log.append(f"{name}.wait_chunk({src})")
                wait_chunk(src)

            handle.consume, handle.wait_chunk = logged_consume, logged_wait_chunk
            return handle

    data, scale = _quantized_shard(rank, 16)
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)

    def program():
        x, s = _gather_both(data, scale, group, scale_first)
        return torch._scaled_mm(x, w, s, one, out_dtype=torch.float32)

    expected = program()
    pipe = EagerMicroPipeline(min_fuse_bytes=0)
    pipe._engine.backend._instances["ring"] = LoggingRing()  # what "auto" picks for CPU tensors
    with pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "log": log}


@pytest.mark.parametrize("scale_first", [False, True], ids=["data_first", "scale_first"])
def test_each_chunk_waits_for_its_own_scale_rows(pool, scale_first):
    for rank, r in enumerate(pool.run(_order_worker, 2, scale_first)):
        assert r["ok"], r
        peer = 1 - rank
        assert r["log"] == [
            "data.consume",
            f"data[{rank}]",
            f"scale.wait_chunk({rank})",
            f"data[{peer}]",
            f"scale.wait_chunk({peer})",
            "scale.consume",
        ], r


def _landed_worker(rank, group):
    """A prefetch: independent matmul work overlapped both gathers, which are
    watched from then on (the 2-rank ring on gloo, Note [Landed gathers]);
    once both have landed the matmul runs whole, after completing the
    scale's gather whole."""
    import time

    from eagertp import patterns

    data, scale = _quantized_shard(rank, 16)
    w = col_major(integer_tensor((32, 16), torch.float32, seed=50).to(FP8))
    one = torch.ones(1, 16)
    a2, b2 = integer_tensor((32, 32), torch.float32, seed=7), integer_tensor((32, 32), torch.float32, seed=8)

    def program(pipe=None):
        x, s = _gather_both(data, scale, group, False)
        z = (a2 @ b2).clone()  # a read: a2 @ b2 runs while both gathers are in flight
        if pipe is not None:
            deadline = time.monotonic() + 10
            while not all(item.handle.landed() for item in pipe._engine.store.items):
                assert time.monotonic() < deadline, "the watched gathers never said they landed"
                time.sleep(0.001)
        return torch._scaled_mm(x, w, s, one, out_dtype=torch.float32), z

    expected = program()
    saved, patterns.WHOLE_WHEN_LANDED = patterns.WHOLE_WHEN_LANDED, True
    try:
        with EagerMicroPipeline(min_fuse_bytes=0, trace=True) as pipe:
            got = program(pipe)
    finally:
        patterns.WHOLE_WHEN_LANDED = saved
    ok = all(torch.equal(x, y) for x, y in zip(got, expected))
    return {"ok": ok, "stats": dict(pipe.stats), "trace": pipe.debug_string().splitlines()[-2:]}


def test_landed_gathers_run_the_scaled_matmul_whole(pool):
    for r in pool.run(_landed_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "fused_scale_gathers": 1}, r
        assert r["trace"] == [
            "all_gather($1, scale_a of $3) [ring]",
            "all_gather_matmul($0 -> $3, landed: whole) [ring]",
        ], r
