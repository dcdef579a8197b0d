"""Fuzzing: hypothesis-generated tensor-parallel programs, run on 2-4 gloo ranks
with and without the mode, must produce the same values.

A program is a list of steps over one activation that is either sharded along
its rows (sequence parallel) or whole on every rank. Gathers (of the
activation, or of a linear's output), reduce-scatters,
all-reduces (of a linear's output or a sum of two, out of place through funcol
or in place through raw c10d, three of linears' outputs then added, or a max
of whatever the activation is), linears
(with and without bias, or over two rows at a time), weight gradients
contracting the rows, views, elementwise ops, row-wise ops (a residual add, a
bias along the rows, a reduction over the last dim kept and used, a row's
scale from its own values: chunk by chunk on a gathered tensor), several
consumers of one tensor, reads and flushes mix freely; reads and flushes may happen on one
rank only, which is exactly what schedule invariance must survive. Weights are
signed permutations, so values stay integers below 3**10 (weight gradients,
summing at most 24 rows of them against +-1, below 2**24) and plain eager and
eagertp must agree bitwise; half the programs run under bf16 autocast, where
both round the same values the same way. A summing all-reduce takes a linear of
the activation clamped to [-8, 8], so that its sums over at most 4 ranks stay
integers bf16 holds exactly, in whatever order a backend adds them; a max
all-reduce is exact in any order. The size rule's threshold is drawn too,
so fused, deferred-then-plain and never-deferred collectives mix, and so is
whether the ring splits every chunk into pieces.

The second fuzz draws the client's code instead: stacks of DTensor-parallel
blocks (norms, gated MLPs, activations, residuals, checkpointing, with and
without sequence parallel, training and inference), against plain eager to
float32 tolerance, every TP collective fused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from symm_mem_emulation import BOTH_BACKENDS, run_on

WIDTH = 8
SHARD_ROWS = 3
WORLDS = [2, 3, 4]

# Steps valid on a sharded activation, on a whole one, and on either.
ON_SHARDED = ["gather", "gather_dim1", "linear_gather"]
ON_WHOLE = ["scatter", "scatter_dim1"]
ANYWHERE = [
    "linear", "linear_bias", "linear_wide", "qkv_sum", "wgrad", "relu", "view", "add_self", "cat_batch", "cat_hidden",
    "read0", "read1", "flush0", "flush_both",
    "linear_all_reduce", "linear_all_reduce_c10d", "sum_all_reduce", "all_reduces_summed", "all_reduce_max",
    # row-wise (Note [Row-wise ops on gathered rows]): on a gathered tensor they run chunk by chunk
    "residual", "bias_row", "minus_row_max", "row_sign_scale",
]


@st.composite
def programs(draw) -> list[str]:
    steps, sharded = [], True
    for _ in range(draw(st.integers(1, 10))):
        step = draw(st.sampled_from(ANYWHERE + (ON_SHARDED if sharded else ON_WHOLE)))
        steps.append(step)
        if step in ON_SHARDED or step in ON_WHOLE:
            sharded = not sharded
    return steps


def _run_program(rank, group, steps, autocast=False, min_fuse_bytes=0, small_pieces=False, batch=2, order=(0, 0)):
    """``steps`` (a program, or a tuple of programs) in plain eager, then in one
    pipeline in ``order`` (indices into the programs), as a training loop
    enters its pipeline once a step. Each run's equality, stats and explain()."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from helpers import all_gather, all_reduce, integer_tensor, reduce_scatter

    from eagertp import EagerMicroPipeline

    def weight(i, width=WIDTH):
        # A signed permutation: a linear keeps magnitudes, so values stay exact.
        g = torch.Generator().manual_seed(1000 + i)
        signs = torch.randint(0, 2, (width,), generator=g).float() * 2 - 1
        return torch.eye(width)[torch.randperm(width, generator=g)] * signs[:, None]

    def signs(shape, i):
        g = torch.Generator().manual_seed(2000 + i)
        return torch.randint(0, 2, shape, generator=g).float() * 2 - 1

    def execute(pipe, steps):
        # [B, S/W, H]: the same bytes whatever the batch (the size rule's cases below)
        x = integer_tensor((batch, SHARD_ROWS * 2 // batch, WIDTH), torch.float32, seed=rank)
        side = []  # results kept aside: weight gradients
        for i, step in enumerate(steps):
            if step == "gather":  # Megatron-style: rows of a 2-D [B*S/W, H] view
                x = all_gather(x.reshape(-1, WIDTH), group).view(x.shape[0], -1, WIDTH)
            elif step == "gather_dim1":  # DTensor-style: the sequence dim of [B, S/W, H]
                x = all_gather(x, group, 1)
            elif step == "linear_gather":  # a linear whose output is gathered (Note [Matmul + all-gather])
                x = all_gather(F.linear(x, weight(i)), group, 1)
            elif step == "scatter":
                x = reduce_scatter(x.reshape(-1, WIDTH), group).view(x.shape[0], -1, WIDTH)
            elif step == "scatter_dim1":
                x = reduce_scatter(x, group, "sum", 1)
            elif step == "linear":
                x = F.linear(x, weight(i))
            elif step == "linear_wide":  # two rows at a time: a row spans rows of a shard
                x = F.linear(x.reshape(-1, 2 * WIDTH), weight(i, 2 * WIDTH)).view(x.shape)
            elif step == "wgrad":  # contracts the rows (a gathered tensor's, when pending): kept aside
                rows = x.reshape(-1, WIDTH)
                side.append(rows.t() @ signs((rows.shape[0], WIDTH), i))
            elif step == "linear_bias":
                x = F.linear(x, weight(i), torch.ones(WIDTH))
            elif step == "qkv_sum":
                x = F.linear(x, weight(i)) + F.linear(x, weight(i + 100)) + F.linear(x, weight(i + 200))
            elif step == "linear_all_reduce":  # a row-parallel linear's output (no SP)
                x = all_reduce(F.linear(x.clamp(-8, 8), weight(i)), group)
            elif step == "linear_all_reduce_c10d":  # Megatron-style: raw c10d, in place
                y = F.linear(x.clamp(-8, 8), weight(i))
                dist.all_reduce(y, group=group)
                x = y
            elif step == "sum_all_reduce":  # a sum of products, as the q/k/v input gradient
                c = x.clamp(-4, 4)
                x = all_reduce(F.linear(c, weight(i)) + F.linear(c, weight(i + 100)), group)
            elif step == "all_reduces_summed":  # each all-reduced, then added: plain TP's q/k/v input gradient
                c = x.clamp(-4, 4)
                q, k, v = (all_reduce(F.linear(c, weight(i + 100 * j)), group) for j in range(3))
                x = q + k + v
            elif step == "all_reduce_max":  # whatever x is: pending gather, product or plain
                x = all_reduce(x, group, "max")
            elif step == "relu":
                x = torch.relu(x).clamp(max=64)
            elif step == "view":
                x = x.reshape(-1, WIDTH).view(x.shape)
            elif step == "add_self":
                x = x + x
            elif step == "residual":  # an operand of the same rows, not pending (the residual stream)
                x = x + signs(x.shape, i)
            elif step == "bias_row":  # an operand broadcast along the rows
                x = x + torch.arange(WIDTH, dtype=x.dtype)
            elif step == "minus_row_max":  # a reduction over the last dim, kept, then elementwise
                x = x - x.amax(-1, keepdim=True)
            elif step == "row_sign_scale":  # a row's scale from its own values (row-wise quantization's shape)
                x = x * torch.sign(x.sum(-1, keepdim=True))
            elif step in ("cat_batch", "cat_hidden"):  # funcol-like chunk + cat that changes nothing
                dim = 0 if step == "cat_batch" else 2
                x = torch.cat(x.chunk(2, dim), dim)
            elif step in ("read0", "read1"):
                if rank == int(step[-1]):
                    x.sum().item()  # a read on one rank only
            elif step in ("flush0", "flush_both") and pipe is not None:
                if step == "flush_both" or rank == 0:
                    pipe.flush()
        return [x, *side]

    import contextlib

    precision = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    programs = steps if isinstance(steps, tuple) else (steps,)
    with precision:
        expected = [execute(None, program) for program in programs]
    pipe = EagerMicroPipeline(poison=True, min_fuse_bytes=min_fuse_bytes)

    def in_order(*_):
        from helpers import left_in_cycles

        runs = []
        for i in order:

            def run(i=i):
                with precision, pipe:
                    return execute(pipe, programs[i])

            got, left = left_in_cycles(run)  # Note [Freed without the garbage collector]
            equal = all(torch.equal(g, e) for g, e in zip(got, expected[i], strict=True))
            runs.append((equal, dict(pipe.stats), pipe.explain(), left))
        return runs

    if small_pieces:
        from helpers import with_small_pieces

        runs = with_small_pieces(rank, group, in_order)
    else:
        runs = in_order()
    return {"equal": [r[0] for r in runs], "stats": [r[1] for r in runs], "explain": [r[2] for r in runs],
            "left_in_cycles": [r[3] for r in runs]}


# Per-rank buffers are 192 bytes (float32) or 96 (bf16): the size rule fuses
# everything (0), only float32 (100), nothing (200), and with 200 it also runs
# the small matmuls at once instead of deferring them.
MIN_FUSE_BYTES = [0, 100, 200]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=programs(), autocast=st.booleans(), min_fuse_bytes=st.sampled_from(MIN_FUSE_BYTES),
    world=st.sampled_from(WORLDS), small_pieces=st.booleans(), batch=st.sampled_from([1, 2]),
)
# Found here: a batch of one cut in 2 is one piece, and cat() of it was taken for
# a reshuffle over one rank (tests/test_matmul_reduce_scatter.py, "reshuffle").
@example(steps=["linear", "cat_batch", "scatter"], autocast=False, min_fuse_bytes=0, world=2, small_pieces=False, batch=1)
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_random_programs_match_plain_eager(pool, backend, steps, autocast, min_fuse_bytes, world, small_pieces, batch):
    """On the ring, and through torch's own symmetric-memory primitives
    (tests/symm_mem_emulation.py): its schedule, eagertp's callbacks. Half the
    programs split every chunk into pieces (helpers.with_small_pieces): the
    ring's piecewise pipelines, and the gathers of products made as sent;
    half run on a batch of one, whose shards split past it (``piece_dim``).
    Each program runs twice in one pipeline, as a training loop's step: the
    second run, which runs at once what the first read whole (Note [Deferrals
    that gained nothing]), must fuse as the first did. Neither may leave
    anything of eagertp's or any tensor in a reference cycle (Note [Freed
    without the garbage collector])."""
    args = (steps, autocast, min_fuse_bytes, small_pieces, batch)
    for rank, r in enumerate(run_on(backend, pool, _run_program, world, *args, timeout=30)):
        assert all(r["equal"]), (
            f"rank {rank} of {world} differs from plain eager ({r['equal']}) for {steps} on {backend} "
            f"(autocast={autocast}, min_fuse_bytes={min_fuse_bytes}, small_pieces={small_pieces}, batch={batch}):\n"
            + "\n".join(r["explain"])
        )
        first, second = r["stats"]
        second.pop("matmuls_run_at_once", None)
        assert first == second, f"the second run fused otherwise for {steps} on {backend}: {r['stats']}\n{r['explain']}"
        assert not any(r["left_in_cycles"]), f"left in reference cycles by {steps} on {backend}: {r['left_in_cycles']}"
        if backend == "symm_mem":
            assert not any("[ring" in text for text in r["explain"]), "symm_mem served every fused collective"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=programs(), second=programs(), world=st.sampled_from(WORLDS), small_pieces=st.booleans())
def test_two_programs_alternating_in_one_pipeline_match_plain_eager(pool, first, second, world, small_pieces):
    """Two programs entered in turn in one pipeline (a training step and an
    evaluation, say): what one block ran at once, the next may need deferred
    (Note [Deferrals that gained nothing]). Every run equals plain eager."""
    args = ((first, second), False, 0, small_pieces, 2, (0, 1, 0, 1, 1, 0))
    for rank, r in enumerate(pool.run(_run_program, world, *args, timeout=30)):
        assert all(r["equal"]), f"rank {rank} of {world}: {r['equal']} for {first} / {second}:\n" + "\n".join(r["explain"])
        assert not any(r["left_in_cycles"]), f"left in reference cycles by {first} / {second}: {r['left_in_cycles']}"


# -- DTensor stacks --------------------------------------------------------------
#
# The client's own code, drawn: blocks of a norm (LayerNorm, RMSNorm or none), a
# column-parallel linear (and a gate beside it, SwiGLU-style), an activation
# (or none: two linears with nothing between them), a row-parallel linear and a
# residual add (or not), parallelized by DTensor's plans with or without
# sequence parallel, run for training (the MLP checkpointed or not), under
# no_grad or under inference_mode. Every TP collective must fuse, and the
# outputs and gradients equal plain eager's to float32 tolerance.


@dataclasses.dataclass(frozen=True)
class _Stack:
    norm: str
    act: str
    bias: bool
    gate: bool
    residual: bool
    layers: int
    sequence_parallel: bool
    mode: str  # "train", "no_grad", "inference"
    checkpoint: bool
    batch: int


class _Block(torch.nn.Module):
    def __init__(self, cfg: _Stack, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        nn = torch.nn
        self.cfg = cfg
        self.norm = {"layer": nn.LayerNorm(dim), "rms": nn.RMSNorm(dim), "none": nn.Identity()}[cfg.norm]
        self.w1 = nn.Linear(dim, hidden, bias=cfg.bias)
        self.w3 = nn.Linear(dim, hidden, bias=cfg.bias) if cfg.gate else None
        self.w2 = nn.Linear(hidden, dim, bias=cfg.bias)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "silu": nn.SiLU(), "tanh": nn.Tanh(), "none": nn.Identity()}[cfg.act]

    def mlp(self, x):
        y = self.act(self.w1(x))
        return self.w2(y if self.w3 is None else y * self.w3(x))

    def forward(self, x):
        n = self.norm(x)
        if self.cfg.checkpoint and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            h = checkpoint(self.mlp, n, use_reentrant=False)
        else:
            h = self.mlp(n)
        return x + h if self.cfg.residual else h


def _stack_worker(rank, group, cfg: _Stack):
    import contextlib

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from helpers import PlainCollectives, collectives_seen, left_in_cycles

    from eagertp import EagerMicroPipeline

    mesh = DeviceMesh.from_group(group, "cpu")
    sp = cfg.sequence_parallel

    def build():
        torch.manual_seed(0)
        blocks = torch.nn.Sequential(*(_Block(cfg) for _ in range(cfg.layers)))
        for block in blocks:
            colwise = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
            plan = {"w1": colwise, "w2": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()}
            if cfg.gate:
                plan["w3"] = colwise
            if sp:
                plan["norm"] = SequenceParallel()
            parallelize_module(block, mesh, plan)
        return blocks

    x = torch.randn(cfg.batch, 4 * group.size(), 16, generator=torch.Generator().manual_seed(1))
    if sp:
        x = x.chunk(group.size(), dim=1)[rank].contiguous()

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def run(ctx):
        model = build()
        with ctx:
            if cfg.mode == "train":
                out = local(model(x))
                out.pow(2).mean().backward()
            else:
                with torch.inference_mode() if cfg.mode == "inference" else torch.no_grad():
                    out = local(model(x))
        return [out.detach().clone(), *(local(p.grad) for p in model.parameters() if p.grad is not None)]

    with PlainCollectives() as plain:
        expected = run(contextlib.nullcontext())
    pipe = EagerMicroPipeline(min_fuse_bytes=0)
    close, stats, left = [], [], []
    for _ in range(2):  # one pipeline for two steps (Note [Deferrals that gained nothing])
        # NB: eagertp's objects only: the window also builds the model (DTensor's own cycles)
        got, left_now = left_in_cycles(lambda: run(pipe), tensors=False)
        close.append(len(got) == len(expected) and all(torch.allclose(g, e, rtol=1e-4, atol=1e-5) for g, e in zip(got, expected)))
        stats.append(dict(pipe.stats))
        left.append(left_now)
    return {
        "close": close,
        "stats": stats,
        "explain": pipe.explain(),
        "collectives_seen": (collectives_seen(plain), collectives_seen(pipe)),
        "left_in_cycles": left,
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cfg=st.builds(
        _Stack, norm=st.sampled_from(["layer", "rms", "none"]), act=st.sampled_from(["gelu", "relu", "silu", "tanh", "none"]),
        bias=st.booleans(), gate=st.booleans(), residual=st.booleans(), layers=st.integers(1, 2),
        sequence_parallel=st.booleans(), mode=st.sampled_from(["train", "train", "no_grad", "inference"]),
        checkpoint=st.booleans(), batch=st.integers(1, 2),
    ),
    world=st.sampled_from([2, 4]),
)
# Two linears with nothing between them, checkpointed, with SP: the recompute gathers
# the input again while the output gradient's gather is pending, and the weight
# gradient reads both (OTHER_PENDING_OPERAND in eagertp.operands).
@example(cfg=_Stack("none", "none", False, False, False, 1, True, "train", True, 1), world=2)
def test_random_dtensor_stacks_fuse_every_tp_collective(pool, cfg, world):
    """DTensor's own plans on drawn stacks, two steps in one pipeline: the same
    outputs and gradients as plain eager, every collective accounted for, and
    every one fused, in the second step (which runs at once what the first
    read whole) as in the first; nothing of eagertp's left in a reference
    cycle."""
    for rank, r in enumerate(pool.run(_stack_worker, world, cfg, timeout=60)):
        assert all(r["close"]), f"rank {rank} of {world} differs from plain eager ({r['close']}) for {cfg}:\n{r['explain']}"
        plain, seen = r["collectives_seen"]
        assert plain == seen > 0, (cfg, r["collectives_seen"], r["explain"])
        assert "not fused" not in r["explain"], f"{cfg}:\n{r['explain']}"
        first, second = r["stats"]
        second.pop("matmuls_run_at_once", None)
        assert first == second, (cfg, r["stats"])  # the second step fused as the first
        assert any(first.get(k) for k in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")), r
        assert not any(r["left_in_cycles"]), f"left in reference cycles by {cfg}: {r['left_in_cycles']}"
