"""Matmul + reduce-scatter fusion on 2 and 4 gloo ranks.

Each fusion test asserts: the result equals plain eager (bitwise on
integer-valued inputs), the fused path ran (stats and the point-to-point ring
seen by an outer OpCounter), and no plain reduce-scatter was issued.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from helpers import DTYPES, OpCounter, fusion_report, integer_tensor, random_tensor, reduce_scatter
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on

from eagertp import EagerMicroPipeline

WORLDS = [2, 4]


def _assert_fused(report: dict, calls: int = 1, backend: str = "ring") -> None:
    assert report["stats"].get("matmul_reduce_scatter") == calls, report
    assert report["stats"].get("unfused_reduce_scatter", 0) == 0, report
    assert report["plain_reduce_scatters"] == 0, report
    assert_moved_by(backend, report)


def _rs_worker(rank, group, in_shape, n, dtype_name, reduce_op, bias, integer=True, scatter_dim=0):
    """Row-parallel linear: y = F.linear(h, w_shard[, b]); reduce_scatter(y)."""
    dtype = DTYPES[dtype_name]
    make = integer_tensor if integer else random_tensor
    h = make(in_shape, dtype, seed=rank)
    w = make((n, in_shape[-1]), dtype, seed=100 + rank)  # each rank's weight shard differs
    b = make((n,), dtype, seed=200 + rank) if bias else None
    expected = reduce_scatter(F.linear(h, w, b), group, reduce_op, scatter_dim)
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = reduce_scatter(F.linear(h, w, b), group, reduce_op, scatter_dim)
    return {"got": got, "expected": expected, "explain": pipe.explain(), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("in_shape", [(4, 8), (8, 16), (2, 4, 8), (2, 2, 4, 8)], ids=["1row", "2d", "3d", "4d"])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_matmul_reduce_scatter_bitwise(pool, world, in_shape, reduce_op, bias, dtype):
    if in_shape[0] % world:
        in_shape = (world * in_shape[0], *in_shape[1:])
    for rank, r in enumerate(pool.run(_rs_worker, world, in_shape, 6, dtype, reduce_op, bias)):
        assert r["got"].shape == r["expected"].shape
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        _assert_fused(r)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "in_shape,scatter_dim", [((2, 8, 8), 1), ((2, 2, 4, 8), 2), ((2, 4, 4, 8), 1)], ids=["3d-dim1", "4d-dim2", "4d-dim1"]
)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_scatter_dims_above_zero_fuse(pool, world, in_shape, scatter_dim, bias, backend):
    """funcol scatters along dim d > 0 as cat(y.chunk(W, d), 0): the producer
    computes the rows of each block along d directly."""
    args = (in_shape, 6, "f32", "sum", bias, True, scatter_dim)
    for rank, r in enumerate(run_on(backend, pool, _rs_worker, world, *args)):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        _assert_fused(r, backend=backend)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("in_shape", [(4, 8), (2, 4, 8)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_scatter_along_the_output_columns_fuses(pool, world, in_shape, bias, backend):
    """Scattering the last dim: chunk c is out[..., block c], produced from B's
    (and the bias's) columns."""
    args = (in_shape, 8, "f32", "sum", bias, True, len(in_shape) - 1)
    for rank, r in enumerate(run_on(backend, pool, _rs_worker, world, *args)):
        assert torch.equal(r["got"], r["expected"]), f"rank {rank}"
        _assert_fused(r, backend=backend)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_matmul_reduce_scatter_random_inputs_close(pool, dtype):
    for r in pool.run(_rs_worker, 2, (16, 64), 32, dtype, "sum", True, False):
        # The ring adds partial sums in its own order: equal to chunked-sum tolerance.
        torch.testing.assert_close(r["got"], r["expected"])
        _assert_fused(r)


@pytest.mark.parametrize("reduce_op", ["max", "min", "product"])
def test_other_reduce_ops_fuse_through_the_ring(pool, reduce_op):
    for r in pool.run(_rs_worker, 4, (8, 4), 3, "f32", reduce_op, False):
        assert torch.equal(r["got"], r["expected"])
        _assert_fused(r)


def test_fused_reduce_scatter_explained(pool):
    r0 = pool.run(_rs_worker, 2, (4, 8), 6, "f32", "sum", True)[0]
    assert_expected_inline(r0["explain"], """reduce_scatter(sum) #0 f32[4, 6] -> f32[2, 6] on group '2' (2 ranks): fused with addmm -> $0 [ring]""")


def _unfused_worker(rank, group, read_first):
    h = integer_tensor((4, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 6), torch.float32, seed=100 + rank)
    expected = reduce_scatter(h @ w, group)
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        y = h @ w
        if read_first:
            total = y.sum()  # noqa: F841 - a read that issues the matmul alone
            got = reduce_scatter(y, group)
        else:
            # Made by another op (a multiply by a number would stay with the
            # product: Note [Epilogues] in eagertp.deferred).
            got = reduce_scatter(y.clone(), group)
    return {"ok": torch.equal(got, expected), "explain": pipe.explain(), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("read_first", [True, False], ids=["read-first", "not-a-matmul"])
def test_unfused_reduce_scatter_uses_the_ring_with_reason(pool, read_first):
    results = pool.run(_unfused_worker, 2, read_first)
    for r in results:
        assert r["ok"]
        assert r["stats"] == {"unfused_reduce_scatter": 1}
        assert r["plain_reduce_scatters"] == 0, "issued by the same ring protocol (Invariant 2)"
        assert r["p2p_ops"] > 0
    assert_expected_inline(results[0]["explain"], """reduce_scatter(sum) #0 f32[4, 6] -> f32[2, 6] on group '2' (2 ranks): not fused [ring]: its input is not the pending output of a matmul""")


def _short_reshuffle_worker(rank, group, in_shape, chunks, dim):
    """``cat(y.chunk(chunks, dim), 0)`` of a matmul output, then a
    reduce-scatter over the group: funcol's reshuffle for a scatter along
    ``dim`` when ``chunks`` is the group's size, but here ``chunk`` made
    another number of pieces (a batch of one cut in 2: one piece; or cut for
    2 ranks, scattered over 4)."""
    h = integer_tensor(in_shape, torch.float32, seed=rank)
    w = integer_tensor((in_shape[-1], 8), torch.float32, seed=100 + rank)

    def program():
        y = F.linear(h, w.t())
        return reduce_scatter(torch.cat(y.chunk(chunks, dim), 0).reshape(-1, 8), group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "explain": pipe.explain(), **fusion_report(pipe, counter)}


@pytest.mark.parametrize(
    "world, in_shape, chunks, dim, reason",
    [
        (2, (1, 8, 8), 2, 0, "its input is a copy of the matmul output f32[8, 8], not cut into 2 chunks"),
        (4, (2, 8, 8), 2, 1, "its input is the matmul output f32[16, 8] cut into 2 chunks along dim 1 and "
         "concatenated, not into the group's 4"),
    ],
    ids=["batch-of-one", "cut-for-2-on-4"],
)
def test_a_reshuffle_for_another_number_of_ranks_is_scattered_unfused(pool, world, in_shape, chunks, dim, reason):
    """It fused as if the chunks were the group's, and the ring read past the
    product's rows (a crash) or posted other messages than its peers
    (tests/test_fuzz.py found it)."""
    for r in pool.run(_short_reshuffle_worker, world, in_shape, chunks, dim):
        assert r["ok"], r
        assert r["stats"] == {"unfused_reduce_scatter": 1}, r
        assert r["plain_reduce_scatters"] == 0 and r["p2p_ops"] > 0, r  # the ring's protocol (Invariant 2)
        assert r["explain"].endswith(f"not fused [ring]: {reason}"), r["explain"]


def _mixed_worker(rank, group):
    """Rank 0 reads the matmul output before its reduce-scatter; rank 1 fuses."""
    h = integer_tensor((4, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 6), torch.float32, seed=100 + rank)
    expected = reduce_scatter(h @ w, group)
    with EagerMicroPipeline() as pipe:
        y = h @ w
        if rank == 0:
            y.sum()
        got = reduce_scatter(y, group)
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats)}


def test_ranks_that_fuse_differently_interoperate(pool):
    r0, r1 = pool.run(_mixed_worker, 2, timeout=30)
    assert r0["ok"] and r1["ok"]
    assert r0["stats"] == {"unfused_reduce_scatter": 1}
    assert r1["stats"] == {"matmul_reduce_scatter": 1}


def _unmanaged_worker(rank, group):
    from multirank import OTHER_GROUPS

    h = integer_tensor((4, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 6), torch.float32, seed=100 + rank)
    with OpCounter() as counter, EagerMicroPipeline(group=group) as pipe:
        managed = reduce_scatter(h @ w, group)
        unmanaged = reduce_scatter(h @ w, OTHER_GROUPS[2])
    return {"ok": torch.equal(managed, unmanaged), **fusion_report(pipe, counter)}


def test_reduce_scatter_on_unmanaged_group_passes_through(pool):
    for r in pool.run(_unmanaged_worker, 2):
        assert r["ok"]
        assert r["stats"] == {"matmul_reduce_scatter": 1}
        assert r["plain_reduce_scatters"] == 1


def _sp_mlp_worker(rank, group, backend, seq_dim):
    """Sequence-parallel MLP, forward and backward: every TP collective fuses.
    ``seq_dim`` 0 is Megatron's [S, B, H] layout, 1 is batch-first [B, S, H]."""
    x0 = integer_tensor((2, 3, 8) if seq_dim else (2, 8), torch.float32, seed=rank)
    w1 = integer_tensor((4 * 2, 8), torch.float32, seed=10 + rank)  # column shard [F/W, H]
    b1 = integer_tensor((4 * 2,), torch.float32, seed=20 + rank)
    w2 = integer_tensor((8, 4 * 2), torch.float32, seed=30 + rank)  # row shard [H, F/W]
    from helpers import all_gather

    def step(ctx):
        x, p1, q1, p2 = (t.clone().requires_grad_() for t in (x0, w1, b1, w2))
        with ctx:
            h = F.linear(all_gather(x, group, seq_dim), p1, q1)
            y = reduce_scatter(F.linear(h, p2), group, "sum", seq_dim)
            (y * y).sum().backward()
        return [y.detach(), x.grad, p1.grad, q1.grad, p2.grad]

    import contextlib

    expected = step(contextlib.nullcontext())
    pipe = EagerMicroPipeline(backend=backend)
    got = step(pipe)
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], "stats": dict(pipe.stats), "explain": pipe.explain()}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", ["ring", "reference", "symm_mem"])
@pytest.mark.parametrize("seq_dim", [0, 1], ids=["seq-first", "batch-first"])
def test_sequence_parallel_mlp_forward_backward_all_fused(pool, world, backend, seq_dim):
    results = run_on(backend, pool, _sp_mlp_worker, world, backend, seq_dim)
    for r in results:
        assert all(r["ok"]), r
        # forward: AG+addmm, mm+RS; backward: AG(grad) + dgrad & wgrad, mm+RS(dx)
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 3, "matmul_reduce_scatter": 2}, r


def _qkv_backward_worker(rank, group, use_checkpoint):
    """Column-parallel q, k, v on one gathered input: in backward, the input
    gradient dQ @ Wq + dK @ Wk + dV @ Wv is reduce-scattered as ONE fused
    producer of summed matmul rows."""
    import contextlib

    from helpers import all_gather
    from torch.utils.checkpoint import checkpoint

    x0 = integer_tensor((4, 8), torch.float32, seed=rank)
    ws0 = [integer_tensor((4, 8), torch.float32, seed=10 * i + rank) for i in range(3)]

    def block(x, wq, wk, wv):
        g = all_gather(x, group)
        q, k, v = F.linear(g, wq), F.linear(g, wk), F.linear(g, wv)
        return q * k + v

    def step(ctx):
        x, *ws = (t.clone().requires_grad_() for t in (x0, *ws0))
        with ctx:
            out = checkpoint(block, x, *ws, use_reentrant=False) if use_checkpoint else block(x, *ws)
            out.sum().backward()
        return [out.detach(), x.grad, *(w.grad for w in ws)]

    expected = step(contextlib.nullcontext())
    pipe = EagerMicroPipeline()
    got = step(pipe)
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], "stats": dict(pipe.stats), "explain": pipe.explain()}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_input_gradient_of_fused_qkv_is_one_fused_reduce_scatter(pool, world, use_checkpoint):
    """Also under non-reentrant activation checkpointing, whose recomputation
    in backward issues the forward gather again (fused again)."""
    results = pool.run(_qkv_backward_worker, world, use_checkpoint)
    for r in results:
        assert all(r["ok"]), r
        gathers = 2 if use_checkpoint else 1  # + the recomputed forward
        assert r["stats"]["all_gather_matmul"] == gathers, r
        assert r["stats"]["matmul_reduce_scatter"] == 1, r
        assert "unfused_reduce_scatter" not in r["stats"] and "unfused_all_gather" not in r["stats"], r
    if world == 2 and not use_checkpoint:
        assert_expected_inline(results[0]["explain"], """\
all_gather #0 f32[4, 8] -> f32[8, 8] on group '2' (2 ranks): fused with mm -> $1, mm -> $2, mm -> $3 [ring]
reduce_scatter(sum) #0 f32[8, 8] -> f32[4, 8] on group '2' (2 ranks): fused with mm + mm + mm -> $11 [ring]""")


def _read_after_fused_worker(rank, group):
    """The matmul output stays readable after its reduce-scatter fused: the
    producer computed only chunks, so reading the whole output computes it."""
    h = integer_tensor((4, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 6), torch.float32, seed=100 + rank)
    expected_y = h @ w
    expected = reduce_scatter(expected_y, group)
    with EagerMicroPipeline(poison=True) as pipe:
        y = h @ w
        got = reduce_scatter(y, group)
        total = y.sum()  # read after the fused reduce-scatter
    with EagerMicroPipeline(trace=True) as dropped:
        reduce_scatter(h @ w, group)  # nobody keeps the matmul output
    return {
        "ok": torch.equal(got, expected) and torch.equal(y, expected_y) and torch.equal(total, expected_y.sum()),
        "stats": dict(pipe.stats),
        "dropped": dict(dropped.stats),
        "dropped_trace": dropped.debug_string(),
    }


def test_matmul_output_read_after_its_fused_reduce_scatter(pool):
    for r in pool.run(_read_after_fused_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"matmul_reduce_scatter": 1}, r
        # not read: never computed in full
        assert r["dropped"] == {"matmul_reduce_scatter": 1}, r
        assert r["dropped_trace"].endswith("skip $0: nothing can read it"), r["dropped_trace"]


def _autocast_worker(rank, group):
    """Under autocast a linear first casts the gathered activation
    (aten._to_copy): the cast is filled chunk by chunk and the linear still
    fuses; in backward the bf16 input gradient is cast to float32 before its
    reduce-scatter, which still produces chunk by chunk."""
    import contextlib

    from helpers import all_gather

    x0 = integer_tensor((4, 8), torch.float32, seed=rank)
    w1 = integer_tensor((8, 8), torch.float32, seed=10 + rank)
    w2 = integer_tensor((8, 8), torch.float32, seed=20 + rank)

    def step(ctx):
        x, p1, p2 = (t.clone().requires_grad_() for t in (x0, w1, w2))
        with torch.autocast("cpu", dtype=torch.bfloat16), ctx:
            h = F.linear(all_gather(x, group), p1)
            y = reduce_scatter(F.linear(h, p2), group)
            y.float().pow(2).sum().backward()
        return [y.detach(), x.grad, p1.grad, p2.grad]

    expected = step(contextlib.nullcontext())
    pipe, counter = EagerMicroPipeline(trace=True), OpCounter()
    with counter:
        got = step(pipe)
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], "trace": pipe.debug_string(), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
def test_autocast_casts_of_gathered_activations_fuse(pool, world):
    for r in pool.run(_autocast_worker, world):
        assert all(r["ok"]), r
        # forward gather + reduce-scatter; backward: the output gradient's gather,
        # and the input gradient's reduce-scatter of its float32 cast
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 3, "matmul_reduce_scatter": 2}, r
        assert r["plain_all_gathers"] == 0 and r["plain_reduce_scatters"] == 0 and r["p2p_ops"] > 0, r


def _epilogue_worker(rank, group, collective, operand_kind, in_place):
    """float8 training's row-wise path: a matmul, its output multiplied by
    the product of its row and column scales and a bias added (in place, as
    torchao does, or out of place), then cast, then reduce-scattered or
    all-reduced. The ops stay with the product (Note [Epilogues] in
    eagertp.deferred), so the collective still produces from it chunk by chunk."""
    from helpers import all_reduce as funcol_all_reduce

    world = group.size()
    a = integer_tensor((4 * world, 8), torch.float32, seed=rank)
    b = integer_tensor((8, 6), torch.float32, seed=10)
    rows = 2.0 ** torch.randint(-1, 2, (4 * world, 1), generator=torch.Generator().manual_seed(20)).float()
    cols = 2.0 ** torch.randint(-1, 2, (1, 6), generator=torch.Generator().manual_seed(21)).float()
    operand = {"rows x cols": rows * cols, "rows": rows, "cols": cols, "number": 0.5}[operand_kind]
    bias = integer_tensor((6,), torch.float32, seed=22)

    def program():
        out = a.to(torch.bfloat16) @ b.to(torch.bfloat16)
        if in_place:
            out *= operand
            out += bias
        else:  # the result's dtype follows the operands' (bf16 * f32 tensor: f32)
            out = bias + operand * out
        out = out.to(torch.float32)
        if collective == "reduce_scatter":
            return reduce_scatter(out, group)
        return funcol_all_reduce(out, group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = program()
    return {"equal": torch.equal(got, expected), "trace": pipe.debug_string(), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "out of place"])
@pytest.mark.parametrize("operand_kind", ["rows x cols", "rows", "cols", "number"])
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_epilogues_stay_with_their_product(pool, collective, operand_kind, in_place):
    for r in pool.run(_epilogue_worker, 2, collective, operand_kind, in_place):
        assert r["equal"], r
        fused = "matmul_reduce_scatter" if collective == "reduce_scatter" else "matmul_all_reduce"
        assert r["stats"] == {fused: 1}, r
        assert r["plain_reduce_scatters"] == 0, r
        if in_place:
            assert "*= " in r["trace"] and "+= f32[6]" in r["trace"], r["trace"]
        else:
            assert " * " in r["trace"] and " + f32[6]" in r["trace"], r["trace"]
