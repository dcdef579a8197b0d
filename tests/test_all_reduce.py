"""Matmul + all-reduce fusion (TP without sequence parallel) on 2 and 4 gloo ranks.

Each fusion test asserts: the result equals plain eager (bitwise on
integer-valued inputs), the fused path ran (stats, and an outer OpCounter sees
the ring's point-to-point ops and no plain all-reduce).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from helpers import ROWWISE_SCALES, OpCounter, PlainCollectives, all_reduce, collectives_seen, async_wrapper_ops, device_mesh, fusion_report, integer_tensor
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on

from eagertp import EagerMicroPipeline

WORLDS = [2, 4]

_PLAIN_ALL_REDUCES = (
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_reduce_.default",
    "c10d.allreduce_.default",
)


def _report(pipe, counter: OpCounter) -> dict:
    return {
        **fusion_report(pipe, counter),
        "plain_all_reduces": sum(counter.counts[op] for op in _PLAIN_ALL_REDUCES),
        "explain": pipe.explain(),
    }


def _assert_fused(r: dict, stats: dict, backend: str = "ring") -> None:
    assert r["stats"] == stats, r
    assert r["plain_all_reduces"] == 0, r
    assert_moved_by(backend, r)


def _funcol_worker(rank, group, reduce_op, in_place, shape, bias, sum_of_two):
    """Row-parallel linear without SP: y = all_reduce(F.linear(h, w[, b]))."""
    h = integer_tensor(shape, torch.float32, seed=rank)
    w = integer_tensor((6, shape[-1]), torch.float32, seed=100 + rank)
    w2 = integer_tensor((6, shape[-1]), torch.float32, seed=300 + rank)
    b = integer_tensor((6,), torch.float32, seed=200 + rank) if bias else None
    if reduce_op == "product":  # keep products of 4 ranks small and exact
        h, w, w2 = h.clamp(-1, 1), w.clamp(-1, 1), w2.clamp(-1, 1)

    def program():
        y = F.linear(h, w, b)
        if sum_of_two:
            y = y + F.linear(h, w2)
        if in_place:
            torch.ops._c10d_functional.all_reduce_(y, reduce_op, group.group_name)
            return torch.ops._c10d_functional.wait_tensor(y)
        return all_reduce(y, group, reduce_op)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("reduce_op", ["sum", "max", "min", "product"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_funcol_all_reduce_of_a_matmul_fuses(pool, world, reduce_op, backend):
    for r in run_on(backend, pool, _funcol_worker, world, reduce_op, False, (8, 8), True, False):
        assert r["ok"], r
        _assert_fused(r, {"matmul_all_reduce": 1}, backend)


def _unwaited_worker(rank, group):
    """The all-reduced result used without ``.wait()``: funcol's wrapper of a
    pending placeholder, unwrapped by the mode (Note [Pending async tensors]
    in eagertp.mode)."""
    import torch.distributed._functional_collectives as funcol

    h = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((6, 8), torch.float32, seed=100 + rank)
    residual = integer_tensor((8, 6), torch.float32, seed=200)
    expected = all_reduce(F.linear(h, w), group) + residual
    with async_wrapper_ops() as seen, OpCounter() as counter, EagerMicroPipeline() as pipe:
        reduced = funcol.all_reduce(F.linear(h, w), "sum", group)
        wrapped = type(reduced) is funcol.AsyncCollectiveTensor
        got = reduced + residual  # the residual add reads the reduced rows
    return {"ok": torch.equal(got, expected), "wrapped": wrapped, "seen": list(seen), **_report(pipe, counter)}


def test_all_reduced_result_read_without_wait_skips_the_wrappers_python(pool):
    for r in pool.run(_unwaited_worker, 2):
        assert r["ok"] and r["wrapped"], r
        assert r["seen"] == [], r["seen"]  # the add reached the mode once, unwrapped
        _assert_fused(r, {"matmul_all_reduce": 1, "rowwise_ops": 1})  # the add: row by row


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shape", [(8, 8), (2, 4, 8)], ids=["2d", "3d"])
def test_in_place_all_reduce_fuses(pool, world, shape):
    for r in pool.run(_funcol_worker, world, "sum", True, shape, False, False):
        assert r["ok"], r
        _assert_fused(r, {"matmul_all_reduce": 1})


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_of_a_sum_of_matmuls_fuses(pool, world):
    results = pool.run(_funcol_worker, world, "sum", False, (8, 8), False, True)
    for r in results:
        assert r["ok"], r
        _assert_fused(r, {"matmul_all_reduce": 1})
    if world == 2:
        assert_expected_inline(results[0]["explain"], """all_reduce(sum) #0 f32[8, 6] -> f32[8, 6] on group '2' (2 ranks): fused with mm + mm -> $2 [ring]""")


def _consumer_worker(rank, group, backend_name, verify=False):
    """The all-reduced tensor feeds the next matmul: it binds to the gather half."""
    h = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((6, 8), torch.float32, seed=100 + rank)
    v = integer_tensor((4, 6), torch.float32, seed=200 + rank)

    def program():
        y = all_reduce(F.linear(h, w), group)
        return y, torch.relu(F.linear(y, v))

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(backend=backend_name, verify=verify) as pipe:
        got = program()
    return {"ok": all(torch.equal(g, e) for g, e in zip(got, expected)), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_matmul_on_the_all_reduced_tensor_binds_to_its_gather_half(pool, world, backend):
    results = run_on(backend, pool, _consumer_worker, world, "auto")
    for r in results:
        assert r["ok"], r
        _assert_fused(r, {"matmul_all_reduce": 1, "all_gather_matmul": 1, "fused_matmuls": 1}, backend)
    if world == 2 and backend == "ring":
        assert_expected_inline(results[0]["explain"], """all_reduce(sum) #0 f32[8, 6] -> f32[8, 6] on group '2' (2 ranks): fused with mm -> $0; its all-gather half fused with mm -> $2 [ring]""")


def test_verify_checks_both_halves(pool):
    """verify=True: ranks agree on the reduce-scatter half and the gather half,
    and each is compared with plain eager's."""
    for r in pool.run(_consumer_worker, 2, "ring", True):
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_reduce": 1, "all_gather_matmul": 1, "fused_matmuls": 1}, r


def _unfused_worker(rank, group, case):
    if case == "embedding":  # a non-matmul input
        table = integer_tensor((16, 8), torch.float32, seed=rank)
        idx = torch.tensor([1, 3, 5, 7])

        def program():
            return all_reduce(F.embedding(idx, table), group)

    else:  # rows not divisible by the world size
        h = integer_tensor((3, 8), torch.float32, seed=rank)
        w = integer_tensor((8, 6), torch.float32, seed=100 + rank)

        def program():
            return all_reduce(h @ w, group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


@pytest.mark.parametrize("case", ["embedding", "rows"])
def test_unfused_all_reduce_explains_its_reason(pool, case):
    """An input that is not a pending product still takes the ring's messages
    (a peer may fuse its own: Invariant 2); rows that do not split over the
    ranks are issued as written (every rank sees the same shapes)."""
    results = pool.run(_unfused_worker, 2, case)
    for r in results:
        assert r["ok"], r
        assert r["stats"] == {"unfused_all_reduce": 1}, r
        if case == "embedding":
            assert r["plain_all_reduces"] == 0 and r["p2p_ops"] > 0, r
        else:
            assert r["plain_all_reduces"] == 1 and r["p2p_ops"] == 0, r
    if case == "embedding":
        assert_expected_inline(results[0]["explain"], """all_reduce(sum) #0 f32[4, 8] -> f32[4, 8] on group '2' (2 ranks): not fused [ring]: its input is not the pending output of a matmul""")
    else:
        assert_expected_inline(results[0]["explain"], """all_reduce(sum) #0 f32[3, 6] -> f32[3, 6] on group '2' (2 ranks): not fused: the rows of f32[3, 6] (all dims but the last) do not split over 2 ranks""")


def _empty_worker(rank, group):
    """An empty all-reduce (min_fuse_bytes=0, as on CUDA): issued as written."""
    x = torch.empty(0, 8)
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=0) as pipe:
        got = all_reduce(x, group)
    return {"shape": tuple(got.shape), **_report(pipe, counter)}


def test_empty_all_reduce_is_issued_as_written(pool):
    for r in pool.run(_empty_worker, 2):
        assert r["shape"] == (0, 8) and r["stats"] == {"unfused_all_reduce": 1}, r
        assert r["explain"].endswith("not fused: it is empty"), r["explain"]


def _read_first_worker(rank, group, backend_name):
    """Rank 0 reads the product before all-reducing it (so it has nothing
    pending to fuse), rank 1 fuses: both exchange the ring's messages."""
    h = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 6), torch.float32, seed=100 + rank)
    expected = all_reduce(h @ w, group)
    with OpCounter() as counter, EagerMicroPipeline(backend=backend_name) as pipe:
        y = h @ w
        if rank == 0:
            y.sum()
        got = all_reduce(y, group)
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_ranks_that_fuse_differently_interoperate(pool, world, backend):
    results = run_on(backend, pool, _read_first_worker, world, "auto")
    for rank, r in enumerate(results):
        assert r["ok"], r
        assert r["stats"] == ({"unfused_all_reduce": 1} if rank == 0 else {"matmul_all_reduce": 1}), r
        assert r["plain_all_reduces"] == 0, r


def _megatron_functions(reduce):
    """Megatron's f (identity forward, ``reduce`` of the input gradient in
    backward) and g (``reduce`` forward, identity backward)."""

    class CopyToTP(torch.autograd.Function):  # f
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return reduce(grad)

    class ReduceFromTP(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx, x):
            return reduce(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    return CopyToTP, ReduceFromTP


def _megatron_worker(rank, group, async_op, backend_name, min_fuse_bytes=None):
    """Megatron-style TP MLP without SP on raw c10d: f (identity forward,
    all-reduce of the input gradient in backward) before the column-parallel
    linear, g (all-reduce forward, identity backward) after the row-parallel one."""

    def all_reduce_in_place(t):
        work = dist.all_reduce(t, group=group, async_op=async_op)
        if async_op:
            assert work.wait() is True and work.is_completed()
        else:
            assert work is None
        return t

    CopyToTP, ReduceFromTP = _megatron_functions(lambda t: all_reduce_in_place(t.contiguous()))

    x0 = integer_tensor((8, 8), torch.float32, seed=0)  # replicated input
    w1 = integer_tensor((6, 8), torch.float32, seed=10 + rank)  # column shard
    w2 = integer_tensor((8, 6), torch.float32, seed=20 + rank)  # row shard

    def step(ctx):
        x, p1, p2 = (t.clone().requires_grad_() for t in (x0, w1, w2))
        with ctx:
            h = torch.relu(F.linear(CopyToTP.apply(x), p1))
            y = ReduceFromTP.apply(F.linear(h, p2))
            (y * y).sum().backward()
        return [y.detach(), x.grad, p1.grad, p2.grad]

    expected = step(contextlib.nullcontext())
    counter, pipe = OpCounter(), EagerMicroPipeline(backend=backend_name, min_fuse_bytes=min_fuse_bytes)
    with counter:
        got = step(pipe)
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_megatron_style_c10d_mlp_fuses_forward_and_backward(pool, world, async_op, backend):
    for r in run_on(backend, pool, _megatron_worker, world, async_op, "auto"):
        assert all(r["ok"]), r
        assert r["stats"].get("matmul_all_reduce") == 2, r  # g forward, f backward
        assert "unfused_all_reduce" not in r["stats"], r
        assert r["plain_all_reduces"] == 0, r
        assert_moved_by(backend, r)


def _ddp_megatron_worker(rank, group, manage_every_group):
    """DDP over dp of a Megatron-style TP MLP (raw c10d over tp) on a 2 x 2
    mesh: DDP's gradient bucket all-reduce, issued from autograd's hooks on
    the dp group, next to the TP all-reduces."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = device_mesh((2, 2), ("dp", "tp"))
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()

    def all_reduce_in_place(t):
        t = t.contiguous()
        dist.all_reduce(t, group=tp)
        return t

    CopyToTP, ReduceFromTP = _megatron_functions(all_reduce_in_place)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(integer_tensor((64, 32), torch.float32, seed=10 + mesh["tp"].get_local_rank()))
            self.w2 = nn.Parameter(integer_tensor((32, 64), torch.float32, seed=20 + mesh["tp"].get_local_rank()))

        def forward(self, x):
            return ReduceFromTP.apply(F.linear(torch.relu(F.linear(CopyToTP.apply(x), self.w1)), self.w2))

    def step(ctx):
        model = DDP(MLP(), process_group=dp)
        x = integer_tensor((16, 32), torch.float32, seed=mesh["dp"].get_local_rank()).requires_grad_()
        with ctx:
            (model(x) ** 2).sum().backward()
        return [x.grad, *(p.grad for p in model.parameters())]

    plain = PlainCollectives()
    expected = step(plain)
    pipe = EagerMicroPipeline() if manage_every_group else EagerMicroPipeline(group=tp)
    got = step(pipe)
    return {
        "equal": [torch.equal(g, e) for g, e in zip(got, expected)],
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
        "collectives_seen": (collectives_seen(plain), collectives_seen(pipe)),
    }


@pytest.mark.parametrize("manage_every_group", [True, False], ids=["every_group", "tp_group"])
def test_ddp_over_a_megatron_style_tp_mlp(pool, manage_every_group):
    """Both TP all-reduces fuse (g forward, f backward) and the gradients are
    plain eager's, bitwise. Managing every group, DDP's flat gradient bucket
    reaches the mode too and is issued as written, with its reason; with
    ``group=tp`` it never does."""
    for r in pool.run(_ddp_megatron_worker, 4, manage_every_group):
        assert all(r["equal"]), r
        plain, explained = r["collectives_seen"]  # no invisible collective
        assert plain == explained > 0, r
        if manage_every_group:
            assert r["stats"] == {"matmul_all_reduce": 2, "unfused_all_reduce": 1, "rowwise_ops": 1}, r
            assert "f32[4096] is one row (all dims but the last), which does not split over 2 ranks" in r["explain"], r
        else:
            # NB: the loss's ``** 2`` of the forward all-reduce runs row by row on its gather half.
            assert r["stats"] == {"matmul_all_reduce": 2, "rowwise_ops": 1}, r


def _dtensor_worker(rank, group, bias, min_fuse_bytes=None):
    """Plain ColwiseParallel + RowwiseParallel (no SP): the row-parallel output
    all-reduces in forward (Partial -> Replicate), the column-parallel input
    gradient in backward."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=bias), torch.nn.ReLU(), torch.nn.Linear(16, 8, bias=bias))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x0 = integer_tensor((8, 8), torch.float32, seed=0)

    def step(ctx):
        model.zero_grad()
        x = x0.clone().requires_grad_()
        with ctx:
            y = model(x)
            (y * y).sum().backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        return [y.detach(), x.grad, *grads]

    expected = step(contextlib.nullcontext())
    counter, pipe = OpCounter(), EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes)
    with counter:
        got = step(pipe)
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_dtensor_tp_without_sequence_parallel(pool, world, bias):
    for r in pool.run(_dtensor_worker, world, bias):
        assert all(r["ok"]), r
        assert r["stats"].get("matmul_all_reduce") == 2, r  # forward output, backward input gradient
        assert "unfused_all_reduce" not in r["stats"], r
        assert r["plain_all_reduces"] == 0 and r["p2p_ops"] > 0, r


def _avg_worker(rank, group, dtype_name):
    from helpers import DTYPES

    dtype = DTYPES[dtype_name]
    # |values| <= 32 per rank, <= 128 summed: exact in bf16 in any order
    h = integer_tensor((8, 8), dtype, seed=rank).clamp(-2, 2)
    w = integer_tensor((6, 8), dtype, seed=100 + rank).clamp(-2, 2)

    def program():
        return all_reduce(F.linear(h, w), group, "avg")

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_avg_all_reduce_of_a_matmul_fuses(pool, world, dtype, backend):
    """funcol's "avg" (plain eager on gloo runs it too): the fused ring sums and
    divides by the world size at the end, a power of two: exact on integers."""
    for r in run_on(backend, pool, _avg_worker, world, dtype):
        assert r["ok"], r
        _assert_fused(r, {"matmul_all_reduce": 1}, backend)


def _scaled_mm_worker(rank, group, scales, out_dtype_name):
    """FP8 row-parallel linear without SP: all_reduce(_scaled_mm(a, w, ...)).
    Integers in [-1, 1], exact in float8_e4m3fn; shapes multiples of 16 (see
    tests/test_scaled.py). |values| <= 16 * 4 (scales) per rank, <= 256
    summed over 4 ranks: exact in bf16 too."""
    from helpers import FP8, col_major, fp8_scales

    out_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[out_dtype_name]
    a = integer_tensor((32, 16), torch.float32, seed=rank).clamp(-1, 1).to(FP8)
    w = col_major(integer_tensor((16, 16), torch.float32, seed=80 + rank).clamp(-1, 1).to(FP8))
    scale_a, scale_b = fp8_scales(scales, 32, 16, seed=90 + rank)

    def program():
        return all_reduce(torch._scaled_mm(a, w, scale_a, scale_b, out_dtype=out_dtype), group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "dtype": str(got.dtype), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scales", ["tensorwise", ROWWISE_SCALES])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_scaled_mm_all_reduce_fuses(pool, world, scales, out_dtype, backend):
    for r in run_on(backend, pool, _scaled_mm_worker, world, scales, out_dtype):
        assert r["ok"], r
        _assert_fused(r, {"matmul_all_reduce": 1}, backend)


def _cast_worker(rank, group, dtype_name):
    """A half-precision cast of a float32 matmul output, all-reduced: the cast
    is produced chunk by chunk (computed in float32, then cast, as plain eager
    rounds it). |values| <= 32 per rank and <= 128 summed: exact in bf16/fp16."""
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype_name]
    h = integer_tensor((8, 8), torch.float32, seed=rank).clamp(-2, 2)
    w = integer_tensor((6, 8), torch.float32, seed=100 + rank).clamp(-2, 2)

    def program():
        return all_reduce(F.linear(h, w).to(dtype), group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected) and got.dtype == dtype, **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_all_reduce_of_a_cast_matmul_output_fuses(pool, world, dtype, backend):
    for r in run_on(backend, pool, _cast_worker, world, dtype):
        assert r["ok"], r
        _assert_fused(r, {"matmul_all_reduce": 1}, backend)


def _autocast_worker(rank, group):
    """Megatron-style TP MLP without SP under autocast (mirrors the
    reduce-scatter file's autocast test): forward, the bf16 row-parallel output
    is all-reduced; backward, the bf16 input gradient is cast to float32 (the
    backward of autocast's cast of x) before its all-reduce: a cast producer."""
    CopyToTP, ReduceFromTP = _megatron_functions(lambda t: all_reduce(t, group))

    x0 = integer_tensor((8, 8), torch.float32, seed=0)  # replicated input
    w1 = integer_tensor((8, 8), torch.float32, seed=10 + rank)  # column shard
    w2 = integer_tensor((8, 8), torch.float32, seed=20 + rank)  # row shard

    def step(ctx):
        x, p1, p2 = (t.clone().requires_grad_() for t in (x0, w1, w2))
        with torch.autocast("cpu", dtype=torch.bfloat16), ctx:
            h = F.linear(CopyToTP.apply(x), p1)
            y = ReduceFromTP.apply(F.linear(h, p2))
            y.float().pow(2).sum().backward()
        return [y.detach(), x.grad, p1.grad, p2.grad]

    expected = step(contextlib.nullcontext())
    pipe, counter = EagerMicroPipeline(trace=True), OpCounter()
    with counter:
        got = step(pipe)
    return {
        "ok": [torch.equal(g, e) for g, e in zip(got, expected)],
        "dtypes": [str(g.dtype) for g in got],
        "trace": pipe.debug_string(),
        **_report(pipe, counter),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_autocast_cast_of_a_product_all_reduce_fuses(pool, world):
    for r in pool.run(_autocast_worker, world):
        assert all(r["ok"]), r
        assert r["dtypes"][:2] == ["torch.bfloat16", "torch.float32"], r
        # forward: the bf16 output's all-reduce; backward: the float32 cast of the input gradient's
        assert r["stats"].get("matmul_all_reduce") == 2, r
        assert "unfused_all_reduce" not in r["stats"], r
        assert r["plain_all_reduces"] == 0 and r["p2p_ops"] > 0, r


# -- matmuls that arrive as bmm ------------------------------------------------------


def _bmm_as_mm_worker(rank, group, form):
    """Products that reach the mode as ``bmm`` though each is one matmul:
    ``torch.einsum`` writes a linear as a batch-of-one ``bmm``; ``torch.matmul``
    of a 3-D input it cannot fold into rows (the last position, as HF's
    lm_head reads it) broadcasts a weight that does not require grad."""
    from helpers import all_gather

    x = integer_tensor((2, 4, 8), torch.float32, seed=rank)
    w = integer_tensor((6, 8), torch.float32, seed=5)

    def program():
        if form == "einsum + all_reduce":
            return all_reduce(torch.einsum("bsk,nk->bsn", x, w), group)
        if form == "all_gather + einsum":  # sequence parallel: the gather along S feeds it
            return torch.einsum("bsk,nk->bsn", all_gather(x, group, gather_dim=1), w)
        if form == "last position + all_reduce":
            return all_reduce(torch.matmul(x[:, -1:, :], w.t()), group)
        raise AssertionError(form)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "bmm": counter.counts["aten.bmm.default"], **_report(pipe, counter)}


@pytest.mark.parametrize(
    "form, stats",
    [
        ("einsum + all_reduce", {"matmul_all_reduce": 1}),
        ("all_gather + einsum", {"all_gather_matmul": 1, "fused_matmuls": 1}),
        ("last position + all_reduce", {"matmul_all_reduce": 1}),
    ],
)
def test_a_bmm_that_is_one_matmul_fuses_as_mm(pool, form, stats):
    """Bitwise equal, fused, and no bmm left: it ran as mm pieces."""
    for r in pool.run(_bmm_as_mm_worker, 2, form):
        assert r["ok"], r
        _assert_fused(r, stats)
        assert r["bmm"] == 0, r


def _einsum_sp_worker(rank, group):
    """An MLP written with ``torch.einsum``, tensor + sequence parallel through
    funcol's autograd collectives, trained one step: forward and backward
    bmm's of a batch of one run as mm, and every collective fuses."""
    import torch.distributed._functional_collectives as funcol

    x0 = integer_tensor((2, 4, 16), torch.float32, seed=10 + rank)  # [B, S/W, D]
    w1, w2 = integer_tensor((12, 16), torch.float32, seed=20 + rank), integer_tensor((16, 12), torch.float32, seed=30 + rank)

    def step():
        x, a, b = (t.clone().requires_grad_(True) for t in (x0, w1, w2))
        h = funcol.all_gather_tensor_autograd(x, 1, group)
        u = torch.einsum("bsk,nk->bsn", h, a).relu()
        y = funcol.reduce_scatter_tensor_autograd(torch.einsum("bsn,kn->bsk", u, b), "sum", 1, group)
        y.pow(2).sum().backward()
        return [y.detach(), x.grad, a.grad, b.grad]

    expected = step()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = step()
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], **_report(pipe, counter)}


def test_an_einsum_mlp_trains_with_every_collective_fused(pool):
    for r in pool.run(_einsum_sp_worker, 2):
        assert all(r["ok"]), r
        # forward: the gather feeds the first einsum, the second's product is
        # reduce-scattered; backward: the same two, the other way round
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 3, "matmul_reduce_scatter": 2}, r
        assert r["plain_all_gathers"] == 0 and r["plain_reduce_scatters"] == 0, r
