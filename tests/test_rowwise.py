"""Row-wise ops on gathered rows (Note [Row-wise ops on gathered rows] in
eagertp.rowwise): every entry of the table, alone and in chains.

Two levels:
- the promise the table makes, with no communication: each op on any split
  of its rows gives the bits of the op on the whole tensor (random shapes and
  dtypes);
- the mechanism, on 2 and 4 gloo ranks: the op reads the all-gather half of a
  fused all-reduce (``all_reduce(h @ w)``, integer-valued so the reduced rows
  are exact), a matmul reads its result; the op's results equal plain eager
  bitwise, the step ran (``rowwise_ops``), the matmul was fused with the
  gather half (``all_gather_matmul``, explain()), and no plain all-reduce ran.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import OpCounter, all_gather, all_reduce, integer_tensor, random_tensor
from symm_mem_emulation import BOTH_BACKENDS, run_on

from eagertp import EagerMicroPipeline
from eagertp.rowwise import ROW_TABLE, WHOLE_TABLE

aten = torch.ops.aten

B, S, D = 2, 8, 16  # the all-reduced activation [B, S, D]; every world splits B*S rows


def _abs1(t: torch.Tensor) -> torch.Tensor:
    return t.abs() + 1


# name -> (program on the pending g [B, S, D] (and full x [B, S, D], weight w [D],
# per-row r [B, S, 1]), the ops in the table it runs). Each returns a tensor or
# a tuple of tensors; the mechanism tests read them after a matmul on the first.
CASES = {
    "add": (lambda g, x, w, r: g + x, ["add.Tensor"]),
    "add_reversed_alpha": (lambda g, x, w, r: aten.add.Tensor(x, g, alpha=2), ["add.Tensor"]),
    "sub": (lambda g, x, w, r: g - x, ["sub.Tensor"]),
    "mul_weight": (lambda g, x, w, r: g * w, ["mul.Tensor"]),
    "mul_per_row": (lambda g, x, w, r: g * r, ["mul.Tensor"]),
    "div": (lambda g, x, w, r: g / _abs1(x), ["div.Tensor"]),
    "add_scalar": (lambda g, x, w, r: aten.add.Scalar(g, 1.5), ["add.Scalar"]),
    "sub_scalar": (lambda g, x, w, r: aten.sub.Scalar(g, 0.5), ["sub.Scalar"]),
    "mul_scalar": (lambda g, x, w, r: aten.mul.Scalar(g, 3), ["mul.Scalar"]),
    "div_scalar": (lambda g, x, w, r: aten.div.Scalar(g, 4), ["div.Scalar"]),
    "rsqrt": (
        lambda g, x, w, r: aten.rsqrt.default((g * g + 1).float()),
        ["mul.Tensor", "add.Tensor", "rsqrt.default"],
    ),
    "sqrt": (lambda g, x, w, r: aten.sqrt.default(g * g), ["mul.Tensor", "sqrt.default"]),
    "reciprocal": (lambda g, x, w, r: aten.reciprocal.default(g), ["reciprocal.default"]),
    "neg": (lambda g, x, w, r: -g, ["neg.default"]),
    "abs": (lambda g, x, w, r: g.abs(), ["abs.default"]),
    "clamp": (lambda g, x, w, r: g.clamp(-3, 5), ["clamp.default"]),
    "clamp_tensor": (lambda g, x, w, r: aten.clamp.Tensor(g, -r.abs(), x.abs()), ["clamp.Tensor"]),
    "clamp_min": (lambda g, x, w, r: aten.clamp_min.default(g, 0.5), ["clamp_min.default"]),
    "clamp_max": (lambda g, x, w, r: aten.clamp_max.default(g, 0.5), ["clamp_max.default"]),
    "where": (lambda g, x, w, r: torch.where(x > 0, g, x), ["where.self"]),
    "clone": (lambda g, x, w, r: g.clone(), ["clone.default"]),
    "pow_2": (lambda g, x, w, r: g.pow(2), ["pow.Tensor_Scalar"]),
    "pow_minus_half": (
        lambda g, x, w, r: _abs1(g).float().pow(-0.5), ["abs.default", "add.Tensor", "pow.Tensor_Scalar"]
    ),
    "to_bf16": (lambda g, x, w, r: g.to(torch.bfloat16), ["_to_copy.default"]),
    "mean": (lambda g, x, w, r: g.mean(-1, keepdim=True), ["mean.dim"]),
    "sum": (lambda g, x, w, r: g.sum(2, keepdim=True), ["sum.dim_IntList"]),
    "amax": (lambda g, x, w, r: g.amax(-1, keepdim=True), ["amax.default"]),
    "amin": (lambda g, x, w, r: g.amin(-1, keepdim=True), ["amin.default"]),
    "layer_norm": (lambda g, x, w, r: aten.native_layer_norm(g, [D], w, w + 1, 1e-5), ["native_layer_norm.default"]),
    "fused_rms_norm": (  # composite: decomposed before it reaches the table
        lambda g, x, w, r: aten._fused_rms_norm(g, [D], w, 1e-6),
        ["pow.Tensor_Scalar", "mean.dim", "add_.Scalar", "rsqrt.default", "mul.Tensor", "mul.Tensor"],
    ),
    "layer_norm_backward": (
        lambda g, x, w, r: aten.native_layer_norm_backward(
            g, x, [D], x.mean(-1, keepdim=True), _abs1(r), w, w + 1, [True, True, True]
        ),
        ["native_layer_norm_backward.default", "native_layer_norm_backward.default"],
    ),
    "sum_over_rows": (lambda g, x, w, r: (lambda p: (p, p.sum((0, 1))))(g * x), ["mul.Tensor", "sum.dim_IntList"]),
    "in_place": (
        lambda g, x, w, r: (g * 1).add_(x).mul_(2).sub_(r).div_(2).clamp_(-4, 4).clamp_min_(-3).clamp_max_(3),
        ["mul.Tensor", "add_.Tensor", "mul_.Tensor", "sub_.Tensor", "div_.Tensor", "clamp_.default",
         "clamp_min_.default", "clamp_max_.default"],
    ),
    "in_place_scalar": (
        lambda g, x, w, r: aten.div_.Scalar(aten.sub_.Scalar(aten.mul_.Scalar(aten.add_.Scalar(g * 1, 1), 2), 1), 2),
        ["mul.Tensor", "add_.Scalar", "mul_.Scalar", "sub_.Scalar", "div_.Scalar"],
    ),
    "rms_norm": (
        lambda g, x, w, r: F.rms_norm(g, [D], w, 1e-6),
        ["pow.Tensor_Scalar", "mean.dim", "add_.Scalar", "rsqrt.default", "mul.Tensor", "mul.Tensor"],
    ),
    "hf_rms_norm": (  # LlamaRMSNorm.forward, from bf16
        lambda g, x, w, r: _hf_rms_norm(g.to(torch.bfloat16), w.to(torch.bfloat16)),
        ["_to_copy.default", "_to_copy.default", "pow.Tensor_Scalar", "mean.dim", "add.Tensor", "rsqrt.default",
         "mul.Tensor", "_to_copy.default", "mul.Tensor"],
    ),
    "layer_norm_composite": (
        lambda g, x, w, r: F.layer_norm(x + g, [D], w, w), ["add.Tensor", "native_layer_norm.default"]
    ),
}


def _hf_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    dtype = h.dtype
    h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _plain_then_fused(run):
    """``run()`` in plain eager, then inside the block: (got, expected, pipe)."""
    expected = run()
    with EagerMicroPipeline() as pipe:
        got = run()
    return got, expected, pipe


def test_every_rule_is_exercised():
    """Every op of the table appears in some case: a new rule comes with its test."""
    seen = {name for _, ops in CASES.values() for name in ops}
    table = {op.__name__ for op in (*ROW_TABLE, *WHOLE_TABLE)}
    assert table <= seen, sorted(table - seen)


def _operands(dtype: torch.dtype, shape: tuple[int, ...], seed: int):
    *lead, d = shape
    return (
        random_tensor(shape, dtype, seed),
        random_tensor(shape, dtype, seed + 1),
        random_tensor((d,), dtype, seed + 2),
        random_tensor((*lead, 1), dtype, seed + 3),
    )


def _as_list(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if t is not None]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_table_promise_rows_anywhere_give_the_same_bits(case):
    """Each case on any split of its rows equals the case on the whole tensor,
    bitwise, on random shapes and dtypes (float32, bfloat16, float16). The
    rows are the leading dims, flattened. The cases with rsqrt run it in
    float32 (half precision is not in the table: its kernels' vector and
    scalar loops round differently)."""
    program, _ = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    for dtype, trial in itertools.product((torch.float32, torch.bfloat16, torch.float16), range(4)):
        rows = int(torch.randint(2, 40, (1,), generator=gen))
        d = int(torch.randint(1, 70, (1,), generator=gen))
        global D
        saved, D = D, d
        try:
            g, x, w, r = _operands(dtype, (1, rows, d), seed=trial)
            whole = _as_list(program(g, x, w, r))
            cut = int(torch.randint(1, rows, (1,), generator=gen))
            parts = [
                _as_list(program(g[:, s], x[:, s], w, r[:, s])) for s in (slice(0, cut), slice(cut, rows))
            ]
        finally:
            D = saved
        for i, want in enumerate(whole):
            if want.dim() == 3:  # rows: the parts, concatenated
                got = torch.cat([p[i] for p in parts], 1)
                assert torch.equal(got, want), (case, dtype, rows, d, cut, i)


def _chain_worker(rank, group, case, verify):
    """``g = all_reduce(h @ w1)``, then the case on g, then a matmul on its first
    result; every result read after."""
    program, ops = CASES[case]
    h = integer_tensor((B * S, D), torch.float32, seed=rank)
    w1 = integer_tensor((D, D), torch.float32, seed=100 + rank)
    x, r = integer_tensor((B, S, D), torch.float32, seed=7), integer_tensor((B, S, 1), torch.float32, seed=8)
    w = integer_tensor((D,), torch.float32, seed=9)

    def run():
        g = all_reduce(h @ w1, group).view(B, S, D)
        outs = _as_list(program(g, x, w, r))
        first = outs[0]
        y = first.reshape(-1, first.shape[-1]) @ torch.ones(first.shape[-1], 4, dtype=first.dtype)
        return [y, *outs]

    expected = run()
    with OpCounter() as counter, EagerMicroPipeline(verify=verify) as pipe:
        got = run()
    return {
        "derived_equal": [torch.equal(a, b) for a, b in zip(got[1:], expected[1:])],
        "matmul_close": torch.allclose(got[0], expected[0]),
        "stats": dict(pipe.stats),
        "ops": len(ops),
        "plain_all_reduces": counter.counts["_c10d_functional.all_reduce.default"],
        "explain": pipe.explain(),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_runs_row_by_row_on_the_gather_half(pool, case):
    """Every case on 2 ranks: bitwise plain eager's results, every op a step,
    the matmul on its result fused with the all-reduce's gather half."""
    for r in pool.run(_chain_worker, 2, case, False, timeout=60):
        assert all(r["derived_equal"]) and r["matmul_close"], r
        assert r["stats"].get("rowwise_ops") == r["ops"], r
        assert r["stats"]["matmul_all_reduce"] == 1 and r["stats"]["all_gather_matmul"] == 1, r
        assert r["plain_all_reduces"] == 0, r
        assert "(row by row)" in r["explain"] and ") -> mm" in r["explain"], r["explain"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("case", ["hf_rms_norm", "layer_norm_backward", "in_place"])
def test_chains_on_every_world_and_backend_with_verify(pool, world, backend, case):
    """A chain per kind on 4 ranks and on symm_mem (emulated), under verify=True,
    which checks every derived tensor against plain eager."""
    for r in run_on(backend, pool, _chain_worker, world, case, True):
        assert all(r["derived_equal"]) and r["matmul_close"], r
        assert r["stats"].get("rowwise_ops") == r["ops"] and r["stats"]["all_gather_matmul"] == 1, r


def _two_gathers_worker(rank, group):
    """DTensor's backward: two all-reduced gradients added, then normed; the
    add waits for chunk i of the second gather."""
    hq, hk = (integer_tensor((B * S, D), torch.float32, seed=s + rank) for s in (0, 10))
    wq, wk = (integer_tensor((D, D), torch.float32, seed=s + rank) for s in (100, 110))
    w = integer_tensor((D,), torch.float32, seed=9)

    def run():
        gq, gk = all_reduce(hq @ wq, group), all_reduce(hk @ wk, group)
        n = F.layer_norm(gq + gk, [D], w, w)
        return n @ torch.ones(D, 4), n, gk

    got, expected, pipe = _plain_then_fused(run)
    return {
        "equal": [torch.equal(got[1], expected[1]), torch.equal(got[2], expected[2])],
        "close": torch.allclose(got[0], expected[0]),
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_a_sum_of_two_gather_halves_waits_chunk_by_chunk(pool, world):
    for r in pool.run(_two_gathers_worker, world, timeout=60):
        assert all(r["equal"]) and r["close"], r
        assert r["stats"]["rowwise_ops"] == 2 and r["stats"]["all_gather_matmul"] == 1, r
        assert r["stats"]["matmul_all_reduce"] == 2, r
        assert "add, native_layer_norm (row by row) -> mm" in r["explain"], r["explain"]


# name -> (program on the pending g, the words of its reason)
NOT_ROWWISE = {
    "reduce_rows": (lambda g, x: g.mean(0, keepdim=True), "not row by row: it reduces dims [0], not the last dim alone"),
    "no_keepdim": (lambda g, x: g.sum(-1), "without keepdim"),
    "broadcast_some_rows": (lambda g, x: g + x[:1], "broadcast along some rows only"),
    "transcendental": (lambda g, x: g.exp(), "read $"),
    "in_place_on_gathered": (lambda g, x: g.add_(1), "writes the gathered tensor itself in place"),
    "pow_3_5": (lambda g, x: g.abs().pow(3.5), "not exact per element"),
}


def _not_rowwise_worker(rank, group, case):
    program, _ = NOT_ROWWISE[case]
    h = integer_tensor((B * S, D), torch.float32, seed=rank)
    w1 = integer_tensor((D, D), torch.float32, seed=100 + rank)
    x = integer_tensor((B, S, D), torch.float32, seed=7)

    def run():
        g = all_reduce(h @ w1, group).view(B, S, D)
        out = program(g, x)
        return out.reshape(-1, out.shape[-1]) @ torch.ones(out.shape[-1], 4)

    got, expected, pipe = _plain_then_fused(run)
    return {"ok": torch.allclose(got, expected), "stats": dict(pipe.stats), "trace": pipe.debug_string()}


@pytest.mark.parametrize("case", sorted(NOT_ROWWISE))
def test_what_is_not_row_wise_completes_the_gather_first_and_says_why(pool, case):
    for r in pool.run(_not_rowwise_worker, 2, case, timeout=60):
        assert r["ok"], r
        assert r["stats"].get("all_gather_matmul", 0) == 0, r
        assert NOT_ROWWISE[case][1] in r["trace"], r["trace"]


def _dropped_gather_worker(rank, group):
    """A plain all-gather (not an all-reduce half), normed and multiplied,
    the program keeping nothing else: this rank's chunk is read from the
    shard (Note [This rank's chunk, unread] in eagertp.engine)."""
    x = integer_tensor((S, D), torch.float32, seed=rank)
    w = integer_tensor((D,), torch.float32, seed=9)

    def run():
        return F.layer_norm(all_gather(x, group), [D], w, None) @ torch.ones(D, 4)

    got, expected, pipe = _plain_then_fused(run)
    return {"ok": torch.allclose(got, expected), "stats": dict(pipe.stats), "explain": pipe.explain()}


def test_a_plain_gather_normed_then_multiplied_fuses(pool):
    for r in pool.run(_dropped_gather_worker, 2, timeout=60):
        assert r["ok"], r
        assert r["stats"]["all_gather_matmul"] == 1 and r["stats"]["rowwise_ops"] == 1, r
        assert "native_layer_norm (row by row) -> mm" in r["explain"], r["explain"]


def _unbound_worker(rank, group):
    """A matmul bound through a norm to the all-reduce's gather half, whose
    output is all-reduced in turn: the second all-reduce takes the product
    whole, so the matmul is unbound and made by it, chunk by chunk (and the
    first gather half completes first, its reason in the trace)."""
    h = integer_tensor((B * S, D), torch.float32, seed=rank)
    w1, w2 = (integer_tensor((D, D), torch.float32, seed=s + rank) for s in (100, 200))

    def run():
        g = all_reduce(h @ w1, group)
        y = F.layer_norm(g, [D]) @ w2
        return all_reduce(y, group)

    got, expected, pipe = _plain_then_fused(run)
    return {"ok": torch.allclose(got, expected), "stats": dict(pipe.stats), "trace": pipe.debug_string()}


def test_a_bound_matmul_whose_output_a_collective_takes_is_unbound(pool):
    for r in pool.run(_unbound_worker, 2, timeout=60):
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_reduce": 2, "rowwise_ops": 1}, r
        assert "_c10d_functional.all_reduce.default takes $" in r["trace"], r["trace"]
        assert "unbound: _c10d_functional.all_reduce.default takes it whole" in r["trace"], r["trace"]


def _profiler_worker(rank, group):
    x = integer_tensor((S, D), torch.float32, seed=rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with EagerMicroPipeline():
            F.layer_norm(all_gather(x, group), [D]) @ torch.ones(D, 4)
    return sorted({e.name for e in prof.events() if e.name.startswith("eagertp::")})


def test_a_chain_is_a_profiler_range(pool):
    for names in pool.run(_profiler_worker, 2, timeout=60):
        assert names == ["eagertp::all_gather_matmul+rowwise"], names
