"""The size rule (Note [Size rule] in eagertp/backends/__init__.py): collectives
whose per-rank buffer is under ``min_fuse_bytes`` are not deferred but issued as
the program wrote them, with the reason in ``explain()``; the rule depends on
the collective's shape only, so ranks that fuse and ranks that do not agree.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
from helpers import OpCounter, all_gather, fusion_report, integer_tensor, reduce_scatter

from eagertp import EagerMicroPipeline

SHARD = (4, 16)  # float32: 256 bytes per rank
SHARD_BYTES = 4 * 16 * 4


def _gather_mm_worker(rank, group, min_fuse_bytes):
    x = integer_tensor(SHARD, torch.float32, seed=rank)
    w = integer_tensor((SHARD[1], 8), torch.float32, seed=100)
    expected = all_gather(x, group) @ w
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes, trace=True) as pipe:
        got = all_gather(x, group) @ w
    return {
        "got": got,
        "expected": expected,
        "explain": pipe.explain(),
        "debug": pipe.debug_string(),
        **fusion_report(pipe, counter),
    }


def _mm_scatter_worker(rank, group, min_fuse_bytes, verify=False):
    a = integer_tensor((2 * group.size(), 16), torch.float32, seed=rank)
    w = integer_tensor((16, 32), torch.float32, seed=100)  # output chunk: 2 x 32 f32 = 256 bytes
    expected = reduce_scatter(a @ w, group)
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes, verify=verify) as pipe:
        got = reduce_scatter(a @ w, group)
    return {"got": got, "expected": expected, "explain": pipe.explain(), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", [2, 4])
def test_size_rule_issues_a_small_all_gather_plain(pool, world):
    for rank, r in enumerate(pool.run(_gather_mm_worker, world, SHARD_BYTES + 1)):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        assert r["stats"].get("all_gather_matmul", 0) == 0 and r["stats"]["unfused_all_gather"] == 1, r
        assert r["plain_all_gathers"] == 1 and r["p2p_ops"] == 0, r
        assert "not fused: size rule: 256 B per rank < min_fuse_bytes 257 B" in r["explain"]
        world_rows = 4 * world
        assert f"f32[{world_rows}, 16] = all_gather(f32[4, 16], group" in r["debug"], r["debug"]
        assert r["debug"].count("[as written]") == 1, r["debug"]


@pytest.mark.parametrize("world", [2, 4])
def test_size_rule_fuses_at_the_threshold(pool, world):
    for rank, r in enumerate(pool.run(_gather_mm_worker, world, SHARD_BYTES)):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        assert r["stats"]["all_gather_matmul"] == 1 and r["plain_all_gathers"] == 0 and r["p2p_ops"] > 0, r


@pytest.mark.parametrize("world", [2, 4])
def test_size_rule_issues_a_small_reduce_scatter_plain(pool, world):
    for rank, r in enumerate(pool.run(_mm_scatter_worker, world, 257)):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        assert r["stats"].get("matmul_reduce_scatter", 0) == 0 and r["stats"]["unfused_reduce_scatter"] == 1, r
        assert r["plain_reduce_scatters"] == 1 and r["p2p_ops"] == 0, r
        assert "size rule: 256 B per rank < min_fuse_bytes 257 B" in r["explain"]
    for rank, r in enumerate(pool.run(_mm_scatter_worker, world, 256)):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        assert r["stats"]["matmul_reduce_scatter"] == 1 and r["plain_reduce_scatters"] == 0, r


@pytest.mark.parametrize("min_fuse_bytes", [257, 256], ids=["plain", "fused"])
def test_size_rule_under_verify(pool, min_fuse_bytes):
    """verify=True checks the ranks agree on collectives the size rule issues as
    written too (no false alarm when they do)."""
    for rank, r in enumerate(pool.run(_mm_scatter_worker, 2, min_fuse_bytes, True)):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"


def _default_worker(rank, group, default):
    """min_fuse_bytes=None reads the per-device default when the collective is issued."""
    from eagertp.backends import MIN_FUSE_BYTES

    key = ("cpu", "all_gather")
    saved = MIN_FUSE_BYTES[key]
    MIN_FUSE_BYTES[key] = default
    try:
        return _gather_mm_worker(rank, group, None)
    finally:
        MIN_FUSE_BYTES[key] = saved


def test_size_rule_default_is_per_device(pool):
    for r in pool.run(_default_worker, 2, SHARD_BYTES + 1):
        assert r["stats"]["unfused_all_gather"] == 1 and r["plain_all_gathers"] == 1, r
    for r in pool.run(_default_worker, 2, 0):
        assert r["stats"]["all_gather_matmul"] == 1 and r["plain_all_gathers"] == 0, r


def _mixed_worker(rank, group):
    """Rank 0 reads the gathered tensor before any matmul (so it has nothing to
    fuse); the others fuse. Both sides of the size rule must pick one transport."""
    x = integer_tensor(SHARD, torch.float32, seed=rank)
    w = integer_tensor((SHARD[1], 8), torch.float32, seed=100)
    expected = all_gather(x, group) @ w
    results = []
    for threshold in (SHARD_BYTES + 1, SHARD_BYTES):
        with EagerMicroPipeline(min_fuse_bytes=threshold) as pipe:
            g = all_gather(x, group)
            if rank == 0:
                g = g.flip(0).flip(0)  # flip mixes rows: it reads the gather, issued alone
            got = g @ w
        results.append((torch.equal(got, expected), dict(pipe.stats)))
    return results


def test_size_rule_agrees_across_ranks_that_fuse_and_ranks_that_do_not(pool):
    reports = pool.run(_mixed_worker, 4)
    for rank, results in enumerate(reports):
        assert all(ok for ok, _ in results), rank
    small, large = reports[1]
    assert small[1].get("all_gather_matmul", 0) == 0 and large[1]["all_gather_matmul"] == 1, reports[1]
    assert reports[0][1][1].get("all_gather_matmul", 0) == 0, "rank 0 read the gather: nothing to fuse"


def _per_kind_worker(rank, group, min_fuse_bytes):
    """A column-parallel then a row-parallel linear, 256 B per rank each."""
    x = integer_tensor(SHARD, torch.float32, seed=rank)
    w1 = integer_tensor((SHARD[1], 16), torch.float32, seed=100)
    w2 = integer_tensor((16, 16), torch.float32, seed=101)

    def program():
        return reduce_scatter(all_gather(x, group) @ w1 @ w2, group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes) as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter)}


@pytest.mark.parametrize(
    "min_fuse_bytes,fused",
    [
        ({"all_gather": SHARD_BYTES + 1, "reduce_scatter": SHARD_BYTES}, {"matmul_reduce_scatter"}),
        ({"all_gather": SHARD_BYTES, "reduce_scatter": SHARD_BYTES + 1}, {"all_gather_matmul"}),
        # A kind left out keeps its default: 0 in the test pool (fuse_every_size).
        ({"all_gather": SHARD_BYTES + 1}, {"matmul_reduce_scatter"}),
        ({}, {"all_gather_matmul", "matmul_reduce_scatter"}),
    ],
    ids=["rs-only", "ag-only", "ag-given", "empty"],
)
def test_min_fuse_bytes_per_kind(pool, min_fuse_bytes, fused):
    """A dict, as calibrate_min_fuse_bytes returns it, sets each kind's
    threshold; a kind it leaves out keeps MIN_FUSE_BYTES's."""
    for r in pool.run(_per_kind_worker, 2, min_fuse_bytes):
        assert r["ok"], r
        assert {k for k in ("all_gather_matmul", "matmul_reduce_scatter") if r["stats"].get(k)} == fused, r
        assert r["plain_all_gathers"] == ("all_gather_matmul" not in fused), r
        assert r["plain_reduce_scatters"] == ("matmul_reduce_scatter" not in fused), r


def test_min_fuse_bytes_per_kind_thresholds(monkeypatch):
    from eagertp.backends import MIN_FUSE_BYTES, BackendChoice

    monkeypatch.setitem(MIN_FUSE_BYTES, ("cpu", "reduce_scatter"), 512 << 10)  # conftest zeroed it
    choice = BackendChoice("auto", {"all_gather": 1})
    assert choice.min_bytes("cpu", "all_gather") == 1
    assert choice.min_bytes("cpu", "reduce_scatter") == 512 << 10
    assert BackendChoice("auto", 7).min_bytes("cuda", "reduce_scatter") == 7


@pytest.mark.parametrize("bad", [-1, 1.5, "1k", True])
def test_min_fuse_bytes_rejects_bad_values(bad):
    with pytest.raises(ValueError) as e:
        EagerMicroPipeline(min_fuse_bytes=bad)
    assert "takes a byte count >= 0" in str(e.value) and repr(bad) in str(e.value)


def test_min_fuse_bytes_error_text():
    with pytest.raises(ValueError) as e:
        EagerMicroPipeline(min_fuse_bytes=-1)
    expecttest.assert_expected_inline(
        str(e.value),
        """EagerMicroPipeline(min_fuse_bytes=...) takes a byte count >= 0, a dict of them per kind ('all_gather', 'reduce_scatter', 'all_reduce'; e.g. calibrate_min_fuse_bytes(...).min_fuse_bytes) or None (the per-device default, eagertp.backends.MIN_FUSE_BYTES), got -1""",
    )
    with pytest.raises(ValueError) as e:
        EagerMicroPipeline(min_fuse_bytes={"allgather": 1 << 20})
    expecttest.assert_expected_inline(str(e.value), """EagerMicroPipeline(min_fuse_bytes={...}) takes a byte count >= 0 per kind, kinds ['all_gather', 'reduce_scatter', 'all_reduce']; got {'allgather': 1048576} (unknown kinds ['allgather'])""")
    with pytest.raises(ValueError) as e:
        EagerMicroPipeline(min_fuse_bytes={"all_gather": 1 << 20, "reduce_scatter": -1})
    expecttest.assert_expected_inline(str(e.value), """EagerMicroPipeline(min_fuse_bytes={...}) takes a byte count >= 0 per kind, kinds ['all_gather', 'reduce_scatter', 'all_reduce']; got {'all_gather': 1048576, 'reduce_scatter': -1} (not a byte count >= 0: {'reduce_scatter': -1})""")


@pytest.mark.parametrize(
    "n,deferred",
    [(8, False), (256, False), (512, True)],  # outputs as float32: 256 B, 256 KiB, 1 MiB
)
def test_size_rule_runs_small_matmuls_at_once(n, deferred):
    """Note [Deferral boundary]: with nothing pending, a matmul whose output (as
    float32) is under the reduce-scatter threshold can never feed a fused
    reduce-scatter, so it is not deferred."""
    a = integer_tensor((n, n), torch.float32, seed=0)
    with EagerMicroPipeline(min_fuse_bytes=1 << 20, trace=True) as pipe:
        got = (a @ a).relu()
    assert torch.equal(got, (a @ a).relu())
    assert ("= mm(" in pipe.debug_string()) == deferred, pipe.debug_string()


def test_every_matmul_defers_with_min_fuse_bytes_zero():
    a = integer_tensor((8, 8), torch.float32, seed=0)
    with EagerMicroPipeline(min_fuse_bytes=0, trace=True) as pipe:
        (a @ a).relu()
    expecttest.assert_expected_inline(
        pipe.debug_string(),
        """\
$0: f32[8, 8] = mm(f32[8, 8], f32[8, 8])
wait: aten.relu.default read $0""",
    )


def test_size_rule_issues_a_whole_transformer_step_plain(pool):
    """Every TP collective of the DTensor block (q/k/v on one gather, bias, the
    weight-gradient contractions, a sum of three matmuls) under the size rule:
    plain collectives, matmuls whole, the same losses and gradients."""
    from test_dtensor import _transformer_worker

    for r in pool.run(_transformer_worker, 2, 2, 1 << 30):
        expected, got = r["losses"]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert all(r["grads_close"]), r["grads_close"]
        for stats in r["stats"]:
            assert stats == {"unfused_all_gather": 4, "unfused_reduce_scatter": 4}, stats
        assert r["explain"].count("not fused: size rule:") == 8, r["explain"]


def test_size_rule_issues_an_autocast_transformer_step_plain(pool):
    """The same under bf16 autocast: the gathered tensor's casts are filled by the
    plain gather too."""
    from test_dtensor import _autocast_transformer_worker

    for r in pool.run(_autocast_transformer_worker, 2, 1 << 30):
        torch.testing.assert_close(r["loss"][1], r["loss"][0], rtol=1e-3, atol=1e-3)
        assert all(r["grads_close"]), r["grads_close"]
        assert r["stats"] == {"unfused_all_gather": 4, "unfused_reduce_scatter": 4}, r
        assert r["explain"].count("size rule") >= 8, r["explain"]


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_size_rule_issues_raw_c10d_collectives_as_written(pool, async_op):
    """Megatron-style dist.all_gather_into_tensor / reduce_scatter_tensor under the
    size rule: the program's own collectives run (and return their own Work)."""
    from test_c10d import _megatron_worker

    for r in pool.run(_megatron_worker, 2, async_op, "all_gather_into_tensor", 1 << 30):
        assert r["ok"]
        assert r["stats"] == {"unfused_all_gather": 1, "unfused_reduce_scatter": 1}, r
        assert r["plain_all_gathers"] == 1 and r["plain_reduce_scatters"] == 1 and r["p2p_ops"] == 0, r
        assert r["explain"].count("not fused: size rule:") == 2, r["explain"]


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_size_rule_issues_raw_c10d_all_reduces_as_written(pool, async_op):
    """Megatron-style dist.all_reduce in autograd Functions (no SP), forward
    and backward, under the size rule: the program's own all-reduces run."""
    from test_all_reduce import _megatron_worker

    for r in pool.run(_megatron_worker, 2, async_op, "auto", 1 << 30):
        assert all(r["ok"]), r
        assert r["stats"] == {"unfused_all_reduce": 2}, r
        assert r["plain_all_reduces"] == 2 and r["p2p_ops"] == 0, r
        assert r["explain"].count("not fused: size rule:") == 2, r["explain"]


def test_size_rule_issues_dtensor_all_reduces_as_written(pool):
    """Plain ColwiseParallel + RowwiseParallel (no SP) under the size rule."""
    from test_all_reduce import _dtensor_worker

    for r in pool.run(_dtensor_worker, 2, True, 1 << 30):
        assert all(r["ok"]), r
        assert r["stats"] == {"unfused_all_reduce": 2}, r
        assert r["plain_all_reduces"] == 2 and r["p2p_ops"] == 0, r
