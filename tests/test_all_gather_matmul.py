"""All-gather + matmul fusion on 2 and 4 gloo ranks.

Every fusion test asserts three things: the result equals plain eager (bitwise
on integer-valued inputs), the fused path ran (stats, and the point-to-point
ring seen by an outer OpCounter), and the unfused collective did not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DTYPES, OpCounter, PlainCollectives, all_gather, async_wrapper_ops, corrupt_rank0_gathers, fusion_report,
    integer_tensor, random_tensor,
)
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on

from eagertp import EagerMicroPipeline

WORLDS = [2, 4]


def _inputs(rank, shard_shape, n, dtype, integer, n_weights=1):
    make = integer_tensor if integer else random_tensor
    x = make(shard_shape, dtype, seed=rank)
    ws = [make((shard_shape[-1], n), dtype, seed=100 + i) for i in range(n_weights)]
    return x, ws


def _assert_fused(report: dict, *, calls: int, matmuls: int, backend: str = "ring") -> None:
    assert report["stats"].get("all_gather_matmul") == calls, report
    assert report["stats"].get("fused_matmuls") == matmuls, report
    assert report["stats"].get("unfused_all_gather", 0) == 0, report
    assert report["plain_all_gathers"] == 0, report
    if "collectives_seen" in report:  # no invisible collective
        plain, explained = report["collectives_seen"]
        assert plain == explained == calls, report
    assert_moved_by(backend, report)


# -- 2-D mm, shapes and dtypes ---------------------------------------------------


def _mm_worker(rank, group, shard_shape, n, dtype_name, integer, backend):
    dtype = DTYPES[dtype_name]
    x, (w,) = _inputs(rank, shard_shape, n, dtype, integer)
    with PlainCollectives() as plain:
        expected = all_gather(x, group) @ w
    with OpCounter() as counter, EagerMicroPipeline(backend=backend) as pipe:
        got = all_gather(x, group) @ w
    return {"got": got, "expected": expected, **fusion_report(pipe, counter, plain)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize(
    "shard_shape,n",
    [((1, 8), 4), ((4, 16), 8), ((16, 32), 24)],
    ids=["1row", "4rows", "16rows"],
)
def test_mm_integer_inputs_bitwise(pool, world, dtype, shard_shape, n):
    for rank, r in enumerate(pool.run(_mm_worker, world, shard_shape, n, dtype, True, "ring")):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        _assert_fused(r, calls=1, matmuls=1)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mm_random_inputs_close(pool, dtype):
    for r in pool.run(_mm_worker, 2, (8, 64), 32, dtype, False, "ring"):
        torch.testing.assert_close(r["got"], r["expected"])
        _assert_fused(r, calls=1, matmuls=1)


def test_reference_backend_fuses_same_pattern(pool):
    for r in pool.run(_mm_worker, 2, (4, 16), 8, "f32", True, "reference"):
        assert torch.equal(r["got"], r["expected"])
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}
        # The reference backend is the plain collective by definition.
        assert r["plain_all_gathers"] == 1 and r["p2p_ops"] == 0


# -- several consumers, bias, ND linear ------------------------------------------


def _qkv_worker(rank, group):
    x, (wq, wk, wv) = _inputs(rank, (4, 16), 8, torch.float32, True, n_weights=3)
    with PlainCollectives() as plain:
        a = all_gather(x, group)
    expected = [a @ wq, a @ wk, a @ wv]
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        a = all_gather(x, group)
        q, k, v = a @ wq, a @ wk, a @ wv
        scores = q @ k.t()  # reads q and k: the one flush that issues the fused call
    return {
        "got": [q, k, v],
        "expected": expected,
        "scores_ok": torch.equal(scores, expected[0] @ expected[1].t()),
        "trace": pipe.debug_string(),
        "explain": pipe.explain(),
        **fusion_report(pipe, counter, plain),
    }


def test_qkv_projections_fuse_into_one_call(pool):
    results = pool.run(_qkv_worker, 2)
    for r in results:
        assert all(torch.equal(g, e) for g, e in zip(r["got"], r["expected"]))
        assert r["scores_ok"]
        _assert_fused(r, calls=1, matmuls=3)
    from expecttest import assert_expected_inline

    assert_expected_inline(
        results[0]["trace"],
        """\
$0: f32[8, 16] = all_gather(f32[4, 16], group '2' (2 ranks))
$1: f32[8, 8] = mm($0, f32[16, 8])
$2: f32[8, 8] = mm($0, f32[16, 8])
$3: f32[8, 8] = mm($0, f32[16, 8])
wait: aten.mm.default read $1
all_gather_matmul($0 -> $1, $2, $3) [ring]
$4: f32[8, 8] = mm(f32[8, 8], f32[8, 8])
flush: block exited""",
    )
    assert_expected_inline(
        results[0]["explain"],
        """all_gather #0 f32[4, 16] -> f32[8, 16] on group '2' (2 ranks): fused with mm -> $1, mm -> $2, mm -> $3 [ring]""",
    )


def _linear_worker(rank, group, shard_shape, bias, dtype_name):
    dtype = DTYPES[dtype_name]
    x, (w,) = _inputs(rank, shard_shape, 12, dtype, True)
    w = w.t().contiguous()  # F.linear weight layout [out, in]
    b = integer_tensor((12,), dtype, seed=7) if bias else None
    expected = F.linear(all_gather(x, group), w, b)
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = F.linear(all_gather(x, group), w, b)
    return {"got": got, "expected": expected, **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shard_shape", [(3, 16), (2, 3, 16), (2, 2, 3, 16)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_linear_gather_dim0(pool, world, bias, shard_shape, dtype):
    """F.linear reaches the mode as [view ->] mm/addmm [-> _unsafe_view]."""
    for r in pool.run(_linear_worker, world, shard_shape, bias, dtype):
        assert r["got"].shape == r["expected"].shape
        assert torch.equal(r["got"], r["expected"])
        _assert_fused(r, calls=1, matmuls=1)


def _mixed_consumers_worker(rank, group):
    """A linear with bias (addmm), one without (mm) and a plain matmul on one
    gathered tensor: one fused call, three consumers."""
    x = integer_tensor((2, 3, 8), torch.float32, seed=rank)
    w1, w2 = integer_tensor((6, 8), torch.float32, seed=1), integer_tensor((4, 8), torch.float32, seed=2)
    b1, w3 = integer_tensor((6,), torch.float32, seed=3), integer_tensor((8, 5), torch.float32, seed=4)

    def consumers(g):
        return [F.linear(g, w1, b1), F.linear(g, w2), torch.matmul(g, w3)]

    expected = consumers(all_gather(x, group))
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = consumers(all_gather(x, group))
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], "explain": pipe.explain(), **fusion_report(pipe, counter)}


def test_mm_and_addmm_consumers_share_one_fused_call(pool):
    results = pool.run(_mixed_consumers_worker, 2)
    for r in results:
        assert all(r["ok"]), r
        _assert_fused(r, calls=1, matmuls=3)
    from expecttest import assert_expected_inline

    assert_expected_inline(results[0]["explain"], """all_gather #0 f32[2, 3, 8] -> f32[4, 3, 8] on group '2' (2 ranks): fused with addmm -> $1, mm -> $2, mm -> $3 [ring]""")


# -- gather dims > 0 (funcol's split + cat) ------------------------------------------


def _gather_dim_worker(rank, group, shard_shape, gather_dim, bias, dtype_name):
    dtype = DTYPES[dtype_name]
    world = group.size()
    x = integer_tensor(shard_shape, dtype, seed=rank)
    k = shard_shape[-1] * (world if gather_dim in (-1, len(shard_shape) - 1) else 1)
    w = integer_tensor((5, k), dtype, seed=60)
    b = integer_tensor((5,), dtype, seed=61) if bias else None
    g = all_gather(x, group, gather_dim)
    expected = (g.clone(), F.linear(g, w, b))
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        g = all_gather(x, group, gather_dim)
        got = F.linear(g, w, b)
    return {
        "ok": [torch.equal(g, expected[0]), torch.equal(got, expected[1])],
        "trace": pipe.debug_string(),
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "shard_shape,gather_dim",
    [((2, 3, 8), 1), ((2, 3, 2, 8), 2), ((2, 3, 8), 2), ((3, 8), 1), ((1, 3, 8), 1)],
    ids=["3d-dim1", "4d-dim2", "3d-last", "2d-last", "3d-dim1-view"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_gather_dims_above_zero_fuse(pool, world, shard_shape, gather_dim, bias, backend):
    """Gathers along inner dims become cat(ag.chunk(W), dim) (or a view): the
    cat is filled chunk by chunk and the linear reads rows (or, along the last
    dim, columns) per rank."""
    for r in run_on(backend, pool, _gather_dim_worker, world, shard_shape, gather_dim, bias, "f32"):
        assert all(r["ok"]), r
        _assert_fused(r, calls=1, matmuls=1, backend=backend)


def _dropped_cat_worker(rank, group, gather_dim, hold):
    x = integer_tensor((2, 3, 8), torch.float32, seed=rank)
    k = 8 * (group.size() if gather_dim == 2 else 1)
    w = integer_tensor((5, k), torch.float32, seed=60).requires_grad_(hold == "autograd")
    expected = F.linear(all_gather(x, group, gather_dim), w)
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        g = all_gather(x, group, gather_dim)
        got = F.linear(g, w)
        if hold != "program":
            del g  # only the linear had it (and autograd, for w's gradient)
    ok = [torch.equal(got, expected)]
    if hold == "autograd":  # the weight gradient reads the saved cat
        (w_grad,) = torch.autograd.grad(expected.sum(), w)
        got.sum().backward()
        ok.append(torch.equal(w.grad, w_grad))
    return {"ok": all(ok), "copies": counter.counts["aten.copy_.default"], **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("gather_dim", [1, 2], ids=["rows", "cols"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_a_cat_nobody_holds_is_not_filled(pool, world, gather_dim, backend):
    """The cat funcol builds for a gather along an inner dim is filled piece by
    piece while the program or autograd can still see it; dropped (an operand
    only), its copies are skipped, one per rank's chunk, and the linear is
    unchanged."""
    runs = {hold: run_on(backend, pool, _dropped_cat_worker, world, gather_dim, hold) for hold in ("program", "autograd", "none")}
    for held, saved, dropped in zip(*runs.values()):
        assert held["ok"] and saved["ok"] and dropped["ok"], runs
        _assert_fused(dropped, calls=1, matmuls=1, backend=backend)
        assert held["copies"] - dropped["copies"] == world, (held["copies"], dropped["copies"])
        assert saved["copies"] == held["copies"], (saved["copies"], held["copies"])


def test_gather_dim_trace(pool):
    r0 = pool.run(_gather_dim_worker, 2, (2, 3, 8), 1, False, "f32")[0]
    from expecttest import assert_expected_inline

    assert_expected_inline(r0["trace"], """\
$0: f32[4, 3, 8] = all_gather(f32[2, 3, 8], group '2' (2 ranks))
$1: f32[2, 6, 8] = cat($0.chunk(2), 1)
$2: f32[12, 5] = mm($1, f32[8, 5])
flush: block exited
all_gather_matmul($0 -> $2) [ring]""")


# -- contraction over the gathered rows (weight gradients) -------------------------


def _contract_worker(rank, group, forms, dtype_name):
    """``forms`` picks the matmuls on G = all_gather(x): "rows" G @ W,
    "rows_t" G.t() @ H (wgrad), "b_rows" H2 @ G; all of them join one call."""
    dtype = DTYPES[dtype_name]
    world = group.size()
    x = integer_tensor((3, 8), dtype, seed=rank)
    w = integer_tensor((8, 5), dtype, seed=50)
    h = integer_tensor((3 * world, 6), dtype, seed=51)
    h2 = integer_tensor((4, 3 * world), dtype, seed=52)
    matmuls = {"rows": lambda g: g @ w, "rows_t": lambda g: g.t() @ h, "b_rows": lambda g: h2 @ g}
    g = all_gather(x, group)
    expected = [matmuls[f](g) for f in forms]
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        g = all_gather(x, group)
        got = [matmuls[f](g) for f in forms]
    return {
        "ok": [torch.equal(a, b) for a, b in zip(got, expected)],
        "explain": pipe.explain(),
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "forms", [("rows_t",), ("b_rows",), ("rows", "rows_t"), ("rows", "rows_t", "b_rows")], ids="+".join
)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_matmuls_contracting_over_gathered_rows_join_the_fused_call(pool, world, forms, dtype, backend):
    for r in run_on(backend, pool, _contract_worker, world, forms, dtype):
        assert all(r["ok"]), r
        _assert_fused(r, calls=1, matmuls=len(forms), backend=backend)


def test_contracting_matmuls_explained(pool):
    r0 = pool.run(_contract_worker, 2, ("rows", "rows_t", "b_rows"), "f32")[0]
    from expecttest import assert_expected_inline

    assert_expected_inline(r0["explain"], """all_gather #0 f32[3, 8] -> f32[6, 8] on group '2' (2 ranks): fused with mm -> $1, mm (gathered A.t()) -> $2, mm (gathered B) -> $3 [ring]""")


def _product_operand_worker(rank, group, form, order):
    """A contraction over the gathered rows whose other operand is a pending
    product (a weight gradient whose output gradient is a matmul's: two
    linears with nothing between them, as a checkpointed SP layer recomputes
    them): the product is computed, the gather stays in flight and the
    matmul joins it. ``order``: the product made before or after the gather
    started."""
    world = group.size()
    x = integer_tensor((3, 8), torch.float32, seed=rank)
    d = integer_tensor((3 * world, 4), torch.float32, seed=60)
    w = integer_tensor((4, 6), torch.float32, seed=61)

    def run():
        if order == "product_first":
            h = d @ w
            g = all_gather(x, group)
        else:
            g = all_gather(x, group)
            h = d @ w
        return g.t() @ h if form == "rows_t" else h.t() @ g

    expected = run()
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=0, trace=True) as pipe:
        got = run()
    return {"ok": torch.equal(got, expected), "trace": pipe.debug_string(), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("order", ["product_first", "gather_first"])
@pytest.mark.parametrize("form", ["rows_t", "b_rows"])
def test_a_pending_product_beside_the_gathered_rows_is_made_and_the_matmul_joins(pool, form, order):
    for r in pool.run(_product_operand_worker, 2, form, order):
        assert r["ok"], r
        _assert_fused(r, calls=1, matmuls=1)
        # Made first: as a product past its collective (the gather), or as the matmul's operand.
        made = "is past its collective" if order == "product_first" else "aten.mm.default reads $1 beside a gather in flight"
        assert made in r["trace"], r["trace"]


# -- autograd ------------------------------------------------------------------


def _column_parallel_step(x_shard, w, group):
    """Sequence-parallel input, column-parallel weight: all-gather then linear."""
    y = F.linear(all_gather(x_shard, group), w)
    return (y * y).sum()


def _backward_worker(rank, group):
    x0, (w0,) = _inputs(rank, (4, 16), 8, torch.float32, True)
    w0 = w0.t().contiguous()

    def grads(pipe):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if pipe is None:
            loss = _column_parallel_step(x, w, group)
            loss.backward()
        else:
            with pipe:
                loss = _column_parallel_step(x, w, group)
                loss.backward()
        return loss.detach(), x.grad, w.grad

    expected = grads(None)
    pipe = EagerMicroPipeline()
    got = grads(pipe)
    return {"got": got, "expected": expected, "stats": dict(pipe.stats)}


def test_backward_gradients_equal_plain_eager(pool):
    """Autograd saved the placeholder for the weight gradient: filling it in
    place (below autograd, no version bump) must give exact gradients."""
    for r in pool.run(_backward_worker, 2):
        for g, e in zip(r["got"], r["expected"]):
            assert torch.equal(g, e)
        assert r["stats"]["all_gather_matmul"] == 1
        assert r["stats"]["fused_matmuls"] == 1


# -- funcol's AsyncCollectiveTensor, used without .wait() -------------------------


def _async_wrapper_worker(rank, group):
    """Which ops on funcol's wrapper take the wrapper's own Python
    (Note [Pending async tensors] in eagertp.mode)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    x, (w,) = _inputs(rank, (4, 16), 8, torch.float32, True)
    expected = all_gather(x, group).wait() @ w
    results = {}
    with async_wrapper_ops() as seen:
        for case, min_fuse_bytes in [("pending", 0), ("issued as written", 1 << 30)]:
            seen.clear()
            with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes) as pipe:
                gathered = all_gather(x, group)
                transposed = gathered.t()  # a view: the wrapper rewraps it, as torch does
                got = gathered @ w
                got_t = (transposed.t() @ w).sum()
            results[case] = {
                "wrapped": type(gathered) is AsyncCollectiveTensor,
                "view_wrapped": type(transposed) is AsyncCollectiveTensor,
                "seen": list(seen),
                "ok": torch.equal(got, expected) and torch.equal(got_t, expected.sum()),
                **fusion_report(pipe, counter),
            }
    return results


def test_async_wrapper_of_a_pending_gather_is_unwrapped_by_the_mode(pool):
    for r in pool.run(_async_wrapper_worker, 2):
        pending, as_written = r["pending"], r["issued as written"]
        assert pending["ok"] and as_written["ok"]
        assert pending["wrapped"] and pending["view_wrapped"] and as_written["view_wrapped"]
        # The matmul on the wrapper reached the mode once, unwrapped: the
        # wrapper's Python saw only the view ops, and both matmuls fused.
        assert pending["seen"] == ["t.default", "t.default"], pending["seen"]
        assert pending["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 2}, pending["stats"]
        assert pending["plain_all_gathers"] == 0
        # A wrapper of a collective issued as written really waits: torch's path.
        assert "mm.default" in as_written["seen"], as_written["seen"]
        assert as_written["plain_all_gathers"] == 1
        assert "all_gather_matmul" not in as_written["stats"], as_written["stats"]


# -- flush triggers --------------------------------------------------------------


def _read_first_worker(rank, group):
    x, (w,) = _inputs(rank, (2, 8), 4, torch.float32, True)
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        a = all_gather(x, group)
        total = a.sum()  # a non-matmul reader: the gather is issued alone
        y = a @ w
    return {
        "total_ok": torch.equal(total, all_gather(x, group).sum()),
        "y_ok": torch.equal(y, all_gather(x, group) @ w),
        "explain": pipe.explain(),
        **fusion_report(pipe, counter),
    }


def test_gather_read_by_non_matmul_first_is_issued_unfused_with_reason(pool):
    results = pool.run(_read_first_worker, 2)
    for r in results:
        assert r["total_ok"] and r["y_ok"]
        assert r["stats"] == {"unfused_all_gather": 1}
        assert r["plain_all_gathers"] == 0, "materialised by the same ring protocol"
    from expecttest import assert_expected_inline

    assert_expected_inline(results[0]["explain"], """all_gather #0 f32[2, 8] -> f32[4, 8] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten.sum.default read $0, and none ran while it was in flight""")


def _used_after_block_worker(rank, group):
    x, ws = _inputs(rank, (4, 8), 6, torch.float32, True, n_weights=2)
    with EagerMicroPipeline() as pipe:
        a = all_gather(x, group)
        outs = [a @ w for w in ws]  # never read inside the block
    return {
        "ok": [torch.equal(o, all_gather(x, group) @ w) for o, w in zip(outs, ws)],
        "gathered_ok": torch.equal(a, all_gather(x, group)),
        "stats": dict(pipe.stats),
    }


def test_results_used_after_the_block(pool):
    for r in pool.run(_used_after_block_worker, 4):
        assert r["ok"] == [True, True] and r["gathered_ok"]
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 2}


def _flush_worker(rank, group):
    x, (w,) = _inputs(rank, (4, 8), 6, torch.float32, True)
    with EagerMicroPipeline() as pipe:
        y = all_gather(x, group) @ w
        pipe.flush()
        after_flush = dict(pipe.stats)
        z = all_gather(x, group) @ w
    return {
        "after_flush": after_flush,
        "stats": dict(pipe.stats),
        "ok": torch.equal(y, z) and torch.equal(y, all_gather(x, group) @ w),
    }


def test_explicit_flush_issues_fused_call(pool):
    for r in pool.run(_flush_worker, 2):
        assert r["ok"]
        assert r["after_flush"] == {"all_gather_matmul": 1, "fused_matmuls": 1}
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 2}


class _BoomError(Exception):
    pass


def _exception_worker(rank, group):
    import torch.distributed as dist

    x, (w,) = _inputs(rank, (4, 8), 6, torch.float32, True)
    raised = None
    boom = _BoomError("boom")
    try:
        with EagerMicroPipeline() as pipe:
            y = all_gather(x, group) @ w
            if rank == 0:
                raise boom  # while the gather and the matmul are pending
    except _BoomError as e:
        raised = e
    t = torch.ones(1)
    dist.all_reduce(t, group=group)  # the group still works
    return {
        "raised_same": raised is boom if rank == 0 else raised is None,
        "y_ok": torch.equal(y, all_gather(x, group) @ w),
        "stats": dict(pipe.stats),
        "all_reduce": t.item(),
    }


def test_exception_inside_block_propagates_and_peers_complete(pool):
    for rank, r in enumerate(pool.run(_exception_worker, 2)):
        assert r["raised_same"], f"rank {rank}"
        assert r["y_ok"], f"rank {rank}: pending work issued at exit"
        assert r["stats"]["all_gather_matmul"] == 1
        assert r["all_reduce"] == 2.0


def _mixed_flush_worker(rank, group):
    """Rank 0 reads the gathered tensor early; rank 1 fuses it (Invariant 2)."""
    x, (w,) = _inputs(rank, (4, 8), 6, torch.float32, True)
    with EagerMicroPipeline() as pipe:
        a = all_gather(x, group)
        if rank == 0:
            print_me = a.sum()  # noqa: F841 - a read that forces the gather alone
        y = a @ w
    return {"ok": torch.equal(y, all_gather(x, group) @ w), "stats": dict(pipe.stats)}


def test_ranks_that_flush_for_different_reasons_interoperate(pool):
    r0, r1 = pool.run(_mixed_flush_worker, 2, timeout=30)
    assert r0["ok"] and r1["ok"]
    assert r0["stats"] == {"unfused_all_gather": 1}
    assert r1["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}


# -- profiler, verify --------------------------------------------------------------


def _profiler_worker(rank, group):
    x, (w,) = _inputs(rank, (4, 8), 6, torch.float32, True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with EagerMicroPipeline():
            all_gather(x, group) @ w
    return sorted({e.name for e in prof.events() if e.name.startswith("eagertp::")})


def test_fused_call_visible_in_profiler(pool):
    for names in pool.run(_profiler_worker, 2):
        assert names == ["eagertp::all_gather_matmul"]


def _verify_worker(rank, group, corrupt):
    from eagertp import VerificationError

    x, (w,) = _inputs(rank, (4, 8), 6, torch.float32, True)
    expected = all_gather(x, group) @ w
    pipe = EagerMicroPipeline(verify=True)
    if corrupt:
        corrupt_rank0_gathers(pipe)
    try:
        with pipe:
            y = all_gather(x, group) @ w
    except VerificationError as e:
        return {"error": str(e)}
    return {"error": None, "ok": torch.equal(y, expected), "stats": dict(pipe.stats)}


def test_verify_passes_on_correct_results(pool):
    for r in pool.run(_verify_worker, 2, False):
        assert r["error"] is None and r["ok"]
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}


def test_verify_names_op_shapes_and_difference(pool):
    r0, r1 = pool.run(_verify_worker, 2, True)
    assert r1["error"] is None, "only rank 0 was corrupted"
    from expecttest import assert_expected_inline

    assert_expected_inline(r0["error"], """eagertp verify: all_gather f32[4, 8] -> f32[8, 8] on group '2' (2 ranks) differs from plain eager on rank 0: max abs diff 1, max rel diff 1. Run with backend='reference' to take eagertp's pipeline out of the picture, and report this with the shapes above.""")


def _cat_of_consumer_worker(rank, group):
    """cat(y.chunk(W), 1) of a matmul output that shares its geometry with the
    gather's own chunks must not be mistaken for a gathered view."""
    x = integer_tensor((2, 4), torch.float32, seed=rank)
    w = integer_tensor((4, 4), torch.float32, seed=3)  # y has the gathered tensor's shape

    def program():
        g = all_gather(x, group)
        y = g @ w
        return torch.cat(y.chunk(group.size()), 1)

    expected = program()
    with EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats)}


def test_cat_of_a_consumer_output_is_not_a_gathered_view(pool):
    for r in pool.run(_cat_of_consumer_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}
