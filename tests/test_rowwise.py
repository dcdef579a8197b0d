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
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import OpCounter, all_gather, all_reduce, integer_tensor, random_tensor, reduce_scatter
from symm_mem_emulation import BOTH_BACKENDS, run_on

from eagertp import EagerMicroPipeline
from eagertp.rowwise import GRAIN_SIZE, OUT_VARIANTS, ROW_TABLE, WHOLE_TABLE, in_window

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
    "layer_norm": (lambda g, x, w, r: aten.native_layer_norm(g, [g.shape[-1]], w, w + 1, 1e-5), ["native_layer_norm.default"]),
    "fused_rms_norm": (  # composite: decomposed before it reaches the table
        lambda g, x, w, r: aten._fused_rms_norm(g, [g.shape[-1]], w, 1e-6),
        ["pow.Tensor_Scalar", "mean.dim", "add_.Scalar", "rsqrt.default", "mul.Tensor", "mul.Tensor"],
    ),
    "layer_norm_backward": (
        lambda g, x, w, r: aten.native_layer_norm_backward(
            g, x, [g.shape[-1]], x.mean(-1, keepdim=True), _abs1(r), w, w + 1, [True, True, True]
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
        lambda g, x, w, r: F.rms_norm(g, [g.shape[-1]], w, 1e-6),
        ["pow.Tensor_Scalar", "mean.dim", "add_.Scalar", "rsqrt.default", "mul.Tensor", "mul.Tensor"],
    ),
    "hf_rms_norm": (  # LlamaRMSNorm.forward, from bf16
        lambda g, x, w, r: _hf_rms_norm(g.to(torch.bfloat16), w.to(torch.bfloat16)),
        ["_to_copy.default", "_to_copy.default", "pow.Tensor_Scalar", "mean.dim", "add.Tensor", "rsqrt.default",
         "mul.Tensor", "_to_copy.default", "mul.Tensor"],
    ),
    "layer_norm_composite": (
        lambda g, x, w, r: F.layer_norm(x + g, [g.shape[-1]], w, w), ["add.Tensor", "native_layer_norm.default"]
    ),
    "roundings": (
        lambda g, x, w, r: (lambda h: (h.floor(), h.ceil(), h.trunc(), h.round(), h.sign()))(g / 3),
        ["div.Tensor", "floor.default", "ceil.default", "trunc.default", "round.default", "sign.default"],
    ),
    # Not exact per element: run on aligned windows (Note [Aligned windows]).
    "power_of_2_scales": (  # torchao's float8 scales, rounded down to powers of 2
        lambda g, x, w, r: torch.exp2(torch.floor(torch.log2(_abs1(g).float()))),
        ["abs.default", "add.Tensor", "log2.default", "floor.default", "exp2.default"],
    ),
    "transcendentals": (
        lambda g, x, w, r: (lambda h: (h.exp(), h.tanh(), h.sigmoid(), F.silu(h), h.erf(), _abs1(h).log()))(g / 64),
        ["div.Tensor", "exp.default", "tanh.default", "sigmoid.default", "silu.default", "erf.default",
         "abs.default", "add.Tensor", "log.default"],
    ),
    "pow_3_5": (lambda g, x, w, r: g.abs().pow(3.5), ["abs.default", "pow.Tensor_Scalar"]),
    "rsqrt_bf16": (
        lambda g, x, w, r: aten.rsqrt.default(_abs1(g).to(torch.bfloat16)),
        ["abs.default", "add.Tensor", "_to_copy.default", "rsqrt.default"],
    ),
}

# Cases whose ops are not exact per element: each element is exact in the
# same aligned window of the whole tensor, not on any split of the rows
# (their promise: ``test_aligned_windows_give_the_whole_ops_bits``).
WINDOWED = {"power_of_2_scales", "transcendentals", "pow_3_5", "rsqrt_bf16"}


def _hf_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    dtype = h.dtype
    h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _plain_then_fused(run):
    """``run()`` in plain eager, then inside the block: (got, expected, pipe)."""
    expected = run()
    with EagerMicroPipeline(trace=True) as pipe:
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


@pytest.mark.parametrize("case", sorted(set(CASES) - WINDOWED))
def test_the_table_promise_rows_anywhere_give_the_same_bits(case):
    """Each case on any split of its rows equals the case on the whole tensor,
    bitwise, on random shapes and dtypes (float32, bfloat16, float16). The
    rows are the leading dims, flattened. The cases with rsqrt run it in
    float32 (in half precision its kernels' vector and scalar loops round
    differently: it runs on aligned windows, as ``WINDOWED`` cases do)."""
    program, _ = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    for dtype, trial in itertools.product((torch.float32, torch.bfloat16, torch.float16), range(4)):
        rows = int(torch.randint(2, 40, (1,), generator=gen))
        d = int(torch.randint(1, 70, (1,), generator=gen))
        g, x, w, r = _operands(dtype, (1, rows, d), seed=trial)
        whole = _as_list(program(g, x, w, r))
        cut = int(torch.randint(1, rows, (1,), generator=gen))
        parts = [_as_list(program(g[:, s], x[:, s], w, r[:, s])) for s in (slice(0, cut), slice(cut, rows))]
        for i, want in enumerate(whole):
            if want.dim() == 3:  # rows: the parts, concatenated
                got = torch.cat([p[i] for p in parts], 1)
                assert torch.equal(got, want), (case, dtype, rows, d, cut, i)


class _IntoStridedRows(TorchDispatchMode):
    """Runs each op of the table that has an out= overload through it too,
    into the rows of buffers with a gap after every row, as a step writes a
    piece's rows of its placeholders (Note [Row results written in place]),
    and records each result whose bits differ from the op's own."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.differ = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        results = func(*args, **kwargs)
        out = OUT_VARIANTS.get(func._op)
        if out is not None:
            want = _as_list(results)
            buffers = [  # [..., X] rows of [..., X + 3]
                torch.full((*r.shape[:-1], r.shape[-1] + 3), float("nan"), dtype=r.dtype)[..., : r.shape[-1]]
                for r in want
            ]
            out.func(*args, **kwargs, **dict(zip(out.names, buffers)))
            self.written += 1
            self.differ += [str(func) for got, r in zip(buffers, want) if not torch.equal(got, r)]
        return results


@pytest.mark.parametrize("case", sorted(set(CASES) - WINDOWED))
def test_out_overloads_into_strided_rows_give_the_same_bits(case):
    """Each op of each case, run through its out= overload into rows that are
    not contiguous, gives the op's own result bitwise, on random shapes and
    dtypes: what lets a step write its rows in place."""
    program, _ = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    for dtype, trial in itertools.product((torch.float32, torch.bfloat16, torch.float16), range(2)):
        rows, d = int(torch.randint(2, 40, (1,), generator=gen)), int(torch.randint(1, 70, (1,), generator=gen))
        g, x, w, r = _operands(dtype, (2, rows, d), seed=trial)
        with _IntoStridedRows() as mode:
            program(g, x, w, r)
        assert mode.differ == [], (case, dtype, rows, d, mode.differ)
        assert mode.written > 0 or not _written_in_place(case), case


# Every op the table runs on aligned windows (Note [Aligned windows]).
_WINDOWED_OPS = {
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "silu": F.silu, "erf": torch.erf, "rsqrt": torch.rsqrt,
    "pow_3_5": lambda t: t.pow(3.5), "pow_minus_half": lambda t: t.pow(-0.5),
}


def test_every_windowed_op_is_exercised():
    windowed = {op.__name__.split(".")[0] for op, rule in ROW_TABLE.items() if rule.window is not None}
    assert windowed == {name.split("_")[0] for name in _WINDOWED_OPS}


@pytest.mark.parametrize("name", sorted(_WINDOWED_OPS))
def test_aligned_windows_give_the_whole_ops_bits(name):
    """The promise of the ops not exact per element: any elements of a
    contiguous tensor, computed on their aligned window, are the whole op's
    bits (random lengths up to ``GRAIN_SIZE``, random runs, float32, bfloat16
    and float16). On this machine's vector CPUs the bare runs (no window)
    differ in their last bits somewhere: the windows are what makes it exact."""
    op = _WINDOWED_OPS[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    bare_differs = False
    for dtype, trial in itertools.product((torch.float32, torch.bfloat16, torch.float16), range(20)):
        n = int(torch.randint(1, GRAIN_SIZE, (1,), generator=gen))
        flat = (torch.rand(n, generator=gen) * 6 + 0.05).to(dtype)
        whole = op(flat)
        start = int(torch.randint(0, n, (1,), generator=gen))
        length = int(torch.randint(1, n - start + 1, (1,), generator=gen))
        got = in_window(op, flat, start, length)
        assert torch.equal(got, whole[start : start + length]), (name, dtype, n, start, length)
        bare_differs |= not torch.equal(op(flat[start : start + length]), whole[start : start + length])
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and name in ("exp2", "rsqrt"):
        assert bare_differs, name  # else this test would not tell windows from bare runs


def test_a_windowed_op_on_a_tensor_split_over_threads_is_refused():
    """Past GRAIN_SIZE elements ATen may split a call over threads, at
    boundaries the windows do not follow: the op completes the gather."""
    from eagertp.deferred import GatheredView
    from eagertp.rowwise import Kind, RowOperand, why_not_windowed

    big = torch.zeros(GRAIN_SIZE // 8, 8)
    operands = [RowOperand(Kind.ROWS, big, GatheredView(big, 0, 2, 0, derived=True))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert "split over threads" in why_not_windowed(operands)
        torch.set_num_threads(1)
        assert why_not_windowed(operands) is None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "lead, dim, world",
    [((8,), 0, 2), ((2, 8), 0, 2), ((4, 1, 3), 0, 4), ((2, 8), 1, 2), ((3, 4, 2), 1, 2),
     ((2, 2, 6), 1, 2), ((2, 3, 4), 2, 4), ((1, 2, 6), 1, 2), ((1, 2, 8), 1, 2)],
)
def test_runs_of_rows_are_the_four_views_as_one(lead, dim, world):
    """Note [Runs as one view]: on contiguous tensors of any last dim, the one
    ``as_strided`` view of every piece holds the elements of the reshape,
    narrow, narrow, reshape it replaces, and writes through to the tensor."""
    from eagertp.deferred import GatheredView

    view = GatheredView(torch.zeros(*lead, 5), dim, world, 0)
    for x in (5, 3):
        t = torch.arange(math.prod(lead) * x, dtype=torch.float32).view(*lead, x)
        shard_rows = view.shard_rows
        pieces = [None] + [slice(a, b) for a in range(shard_rows) for b in range(a + 1, shard_rows + 1)]
        for src, rows in itertools.product(range(world), pieces):
            block = view.block_of(t.reshape(*lead, x), src, rows)
            want = block.reshape(math.prod(block.shape[:dim]), -1, x)
            got = view.runs_of(t, src, rows)
            assert got.shape == want.shape and torch.equal(got, want), (lead, dim, src, rows)
            assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert view._runs.rows == math.prod(lead)  # the one view ran
        # Not contiguous: the four views still (equal elements; a copy where they must).
        strided = torch.arange(math.prod(lead) * x * 2, dtype=torch.float32).view(*lead, 2 * x)[..., ::2]
        block = view.block_of(strided.reshape(*lead, x), world - 1)
        assert torch.equal(view.runs_of(strided, world - 1), block.reshape(math.prod(block.shape[:dim]), -1, x))


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
    with EagerMicroPipeline():  # NB: caches the steps' result shapes, so that the
        run()  # counted run calls no op on meta tensors (eagertp.rowwise._meta_results)
    with OpCounter() as counter, EagerMicroPipeline(verify=verify) as pipe:
        got = run()
    return {
        "derived_equal": [torch.equal(a, b) for a, b in zip(got[1:], expected[1:])],
        "matmul_close": torch.allclose(got[0], expected[0]),
        "stats": dict(pipe.stats),
        "ops": len(ops),
        "plain_all_reduces": counter.counts["_c10d_functional.all_reduce.default"],
        "explain": pipe.explain(),
        "op_counts": dict(counter.counts),
    }


# The ops of each case that no step runs writing its own rows: those run on
# aligned windows (Note [Aligned windows]: a window's middle is copied out),
# reductions over the rows (computed whole), and a call split between the two
# (native_layer_norm_backward leaves its weight and bias gradients to the
# whole step).
_NOT_ROW_RESULTS = {
    "layer_norm_backward": {"native_layer_norm_backward.default"},
    "power_of_2_scales": {"log2.default", "exp2.default"},
    "transcendentals": {"exp.default", "tanh.default", "sigmoid.default", "silu.default", "erf.default", "log.default"},
    "pow_3_5": {"pow.Tensor_Scalar"},
    "rsqrt_bf16": {"rsqrt.default"},
    "sum_over_rows": {"sum.dim_IntList"},
}


def _written_in_place(case: str) -> dict[str, str]:
    """The case's ops whose steps write their rows through their out=
    overload (Note [Row results written in place] in eagertp/rowwise.py):
    op name -> its out overload's name."""
    found = {}
    for name in CASES[case][1]:
        packet, overload = name.split(".")
        out = OUT_VARIANTS.get(getattr(getattr(aten, packet), overload)._op)
        if out is not None and name not in _NOT_ROW_RESULTS.get(case, ()):
            found[name] = str(out.func)
    return found


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
        # Each row result was written in place, on every piece: the op ran
        # through its out= overload only (once per chunk at least).
        for name, out in _written_in_place(case).items():
            assert r["op_counts"].get(f"aten.{name}", 0) == 0 and r["op_counts"].get(out, 0) >= 2, f"{name}: {r['op_counts']}"


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
    "transcendental_on_the_gathered": (lambda g, x: g.exp(), "runs on aligned windows of a row-wise result only"),
    "in_place_on_gathered": (lambda g, x: g.add_(1), "writes the gathered tensor itself in place"),
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


def _orphaned_weight_gradient_worker(rank, group):
    """Note [Memory of a chain]: a weight gradient still pending when a chain
    starts on an all-reduce's gather half, its input held by nothing else
    (as autograd drops a layer's activation once its backward has run)."""
    x, r = (integer_tensor((B * S, D), torch.float32, seed=s + rank) for s in (0, 10))
    w1, w2 = (integer_tensor((D, D), torch.float32, seed=s) for s in (100, 200))

    def run():
        y = x @ w1
        act = x * 2
        dw = act.t() @ r  # recorded after y: the all-reduce of y does not compute it
        del act
        h = F.layer_norm(all_reduce(y, group) + r, [D])
        return h @ w2, dw

    got, expected, pipe = _plain_then_fused(run)
    return {"ok": all(torch.equal(g, e) for g, e in zip(got, expected)), "stats": dict(pipe.stats),
            "trace": pipe.debug_string()}


def test_a_chain_computes_first_the_weight_gradients_only_pending_work_holds(pool):
    for r in pool.run(_orphaned_weight_gradient_worker, 2, timeout=60):
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_reduce": 1, "all_gather_matmul": 1, "fused_matmuls": 1, "rowwise_ops": 2}, r
        lines = r["trace"].splitlines()
        computed = [i for i, line in enumerate(lines) if "aten.add.Tensor: $" in line and "holds inputs nothing else" in line]
        first_step = next(i for i, line in enumerate(lines) if "[row-wise]" in line)
        assert computed and computed[0] < first_step, r["trace"]


def _profiler_worker(rank, group):
    x = integer_tensor((S, D), torch.float32, seed=rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with EagerMicroPipeline():
            F.layer_norm(all_gather(x, group), [D]) @ torch.ones(D, 4)
    return sorted({e.name for e in prof.events() if e.name.startswith("eagertp::")})


def test_a_chain_is_a_profiler_range(pool):
    for names in pool.run(_profiler_worker, 2, timeout=60):
        assert names == ["eagertp::all_gather_matmul+rowwise"], names


def _windows_worker(rank, group, verify):
    """Ops not exact per element on rows gathered along dim 1 (sequence
    parallel's layout: each piece makes one run of rows per batch), with run
    lengths off the window's multiples: each run is computed in its aligned
    window (Note [Aligned windows] in eagertp.rowwise); random floats, so
    that a bare run would differ in its last bits."""
    x = random_tensor((2, 45, 7), torch.float32, seed=rank)
    w = random_tensor((7, 5), torch.float32, seed=50)

    def run():
        g = all_gather(x, group, gather_dim=1)
        scale = torch.exp2(torch.floor(torch.log2(g.abs() + 0.5)))
        h = F.silu(g * scale)
        return h.reshape(-1, 7) @ w, scale, h

    expected = run()
    with EagerMicroPipeline(verify=verify) as pipe:
        got = run()
    return {
        "equal": [torch.equal(a, b) for a, b in zip(got[1:], expected[1:])],
        "close": torch.allclose(got[0], expected[0]),
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_windowed_ops_on_runs_of_rows_give_plain_eagers_bits(pool, world, backend):
    for r in run_on(backend, pool, _windows_worker, world, True):
        assert all(r["equal"]) and r["close"], r
        assert r["stats"]["all_gather_matmul"] == 1 and r["stats"]["rowwise_ops"] == 7, r
        assert "log2, floor, exp2, mul, silu (row by row) -> mm" in r["explain"], r["explain"]


# -- in-place epilogues on a matmul bound to the gather (Note [Epilogues]) ----

# name -> in-place op on the bound matmul's output ``out`` [M, N], given the
# derived per-row scales ``s`` [M, 1] and a program tensor ``col`` [1, N];
# True if it stays with the matmul.
EPILOGUES = {
    "number": (lambda out, s, col: out.mul_(2), True),
    "program_tensor": (lambda out, s, col: out.add_(col), True),
    "derived_rows": (lambda out, s, col: out.mul_(s * col), True),  # torchao: out *= a_inv_scale * b_inv_scale
    "derived_per_row": (lambda out, s, col: out.mul_(s), True),
    # The write to the scales completes the gather first, the epilogue applied.
    "then_written_in_place": (lambda out, s, col: (lambda post: (out.mul_(post), post.add_(1)))(s * col), True),
    "by_its_own_input": (lambda out, s, col: out.mul_(out), False),
}


def _bound_epilogue_worker(rank, group, case):
    """torchao's row-wise float8 input gradient: a gathered tensor scaled per
    row, multiplied by a weight, its output then scaled in place."""
    epilogue, _ = EPILOGUES[case]
    x = integer_tensor((S, D), torch.float32, seed=rank)
    w = integer_tensor((D, 4), torch.float32, seed=20)
    col = integer_tensor((1, 4), torch.float32, seed=21)

    def run():
        g = all_gather(x, group)
        s = g.abs().amax(-1, keepdim=True)
        out = (g * s) @ w
        epilogue(out, s, col)
        return out

    got, expected, pipe = _plain_then_fused(run)
    return {"equal": torch.equal(got, expected), "stats": dict(pipe.stats), "trace": pipe.debug_string()}


@pytest.mark.parametrize("case", sorted(EPILOGUES))
def test_an_in_place_epilogue_stays_with_a_bound_matmul(pool, case):
    _, stays = EPILOGUES[case]
    for r in pool.run(_bound_epilogue_worker, 2, case, timeout=60):
        assert r["equal"], r
        assert r["stats"].get("all_gather_matmul", 0) == int(stays), r
        assert ("unbound: an in-place epilogue" in r["trace"]) != stays, r["trace"]
        if case == "then_written_in_place":
            assert "wait: aten.add_.Tensor writes what $" in r["trace"], r["trace"]


def _bound_sum_worker(rank, group):
    """Two gathered tensors, each multiplied by a weight, summed and
    reduce-scattered: the sum reads the matmuls bound to their gathers, which
    are unbound so that the reduce-scatter produces from the sum."""
    x1, x2 = (integer_tensor((S, D), torch.float32, seed=s + rank) for s in (0, 10))
    w1, w2 = (integer_tensor((D, D), torch.float32, seed=s + rank) for s in (100, 110))

    def run():
        y = all_gather(x1, group) @ w1 + all_gather(x2, group) @ w2
        return reduce_scatter(y, group)

    got, expected, pipe = _plain_then_fused(run)
    return {"equal": torch.equal(got, expected), "stats": dict(pipe.stats), "trace": pipe.debug_string()}


def test_a_sum_of_bound_matmuls_is_reduce_scattered_from_its_products(pool):
    for r in pool.run(_bound_sum_worker, 2, timeout=60):
        assert r["equal"], r
        assert r["stats"] == {"matmul_reduce_scatter": 1, "unfused_all_gather": 2}, r
        assert r["trace"].count("unbound: aten.add.Tensor takes it whole") == 2, r["trace"]


def _not_a_product_worker(rank, group):
    """An all-reduce of a tensor no matmul made (HF's vocab-parallel
    embedding: masked lookups) is issued as written, yet its gather half
    stays in flight: the norm after it runs row by row, the matmul binds."""
    x = integer_tensor((B * S, D), torch.float32, seed=rank)
    w = integer_tensor((D,), torch.float32, seed=9)

    def run():
        g = all_reduce(x * 2, group)
        return F.layer_norm(g, [D], w, None) @ torch.ones(D, 4)

    got, expected, pipe = _plain_then_fused(run)
    return {"ok": torch.allclose(got, expected), "stats": dict(pipe.stats), "explain": pipe.explain()}


def test_an_all_reduce_issued_as_written_says_what_its_gather_half_fused_with(pool):
    for r in pool.run(_not_a_product_worker, 2, timeout=60):
        assert r["ok"], r
        assert r["stats"] == {"unfused_all_reduce": 1, "rowwise_ops": 1, "all_gather_matmul": 1, "fused_matmuls": 1}, r
        (line,) = r["explain"].splitlines()
        assert "not fused [ring]: its input is not the pending output of a matmul; its all-gather half fused with " \
               "native_layer_norm (row by row) -> mm -> $" in line, line
