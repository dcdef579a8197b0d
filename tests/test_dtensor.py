"""DTensor tensor parallelism: DTensor desugars first, its funcol ops fuse."""

from __future__ import annotations

import contextlib

import torch
import pytest
import torch.nn as nn
from helpers import OpCounter, PlainCollectives, collectives_seen, integer_tensor
from symm_mem_emulation import BOTH_BACKENDS, run_on

from eagertp import EagerMicroPipeline


def _colwise_rowwise_worker(rank, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group, "cpu")

    def make():
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                p.copy_(integer_tensor(p.shape, torch.float32, seed=i))
        # Sequence-parallel input (Shard(0)) -> all-gather before the first linear.
        plan = {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
        }
        return parallelize_module(m, mesh, plan)

    x = integer_tensor((8, 16), torch.float32, seed=100).chunk(group.size())[rank].clone()

    def step(model, ctx):
        with ctx:
            out = model(x)
            out.pow(2).sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        return out, grads

    plain = PlainCollectives()
    expected = step(make(), plain)
    counter, pipe = OpCounter(), EagerMicroPipeline(trace=True)
    got = step(make(), _both(counter, pipe))
    return {
        "collectives_seen": (collectives_seen(plain), collectives_seen(pipe)),
        "out_ok": torch.equal(got[0], expected[0]),
        "grads_ok": [torch.equal(g, e) for g, e in zip(got[1], expected[1])],
        "stats": dict(pipe.stats),
        "trace": pipe.debug_string(),
        "plain_gathers": counter.unfused_all_gathers,
    }


def test_dtensor_colwise_rowwise_forward_backward(pool):
    results = pool.run(_colwise_rowwise_worker, 2)
    for r in results:
        assert r["out_ok"] and all(r["grads_ok"]), r
        _explains_every_collective(r["collectives_seen"])
        assert r["stats"]["all_gather_matmul"] >= 1, r
        assert r["plain_gathers"] == 0, r
    print(results[0]["trace"])


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield


# -- a transformer block: attention + MLP, tensor + sequence parallel ---------------
# The demo's model: eagertp.demo.TransformerBlock and tensor_parallel_plan.


def _explains_every_collective(plain, fused=None) -> None:
    """No invisible collective (Invariant 4): explain() accounts for as many
    all-gathers, reduce-scatters and all-reduces as plain eager issued, in
    each block. ``plain``: (plain, fused) counts, or the plain ones."""
    if fused is None:
        plain, fused = plain
    assert plain == fused, (plain, fused)
    assert all(n > 0 for n in (plain if isinstance(plain, list) else [plain])), plain


def _transformer_worker(rank, group, steps, min_fuse_bytes=None, batch=2):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    mesh = DeviceMesh.from_group(group, "cpu")

    def train(pipe):
        torch.manual_seed(0)
        model = parallelize_module(TransformerBlock(16, 4), mesh, tensor_parallel_plan())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads, stats, seen = [], [], [], []
        for step in range(steps):
            x = torch.randn(batch, 8, 16, generator=torch.Generator().manual_seed(step))
            x = x.chunk(group.size(), dim=1)[rank].contiguous()  # sequence-parallel input
            block = pipe if pipe is not None else PlainCollectives()
            with counter, block:
                out = model(x)
                loss = out.pow(2).mean()  # RowwiseParallel hands back local tensors
                loss.backward()
            seen.append(collectives_seen(block))
            losses.append(loss.item())
            grads = [p.grad.full_tensor() for p in model.parameters()]
            stats.append(dict(pipe.stats) if pipe is not None else None)
            opt.step()
            opt.zero_grad()
        return losses, grads, stats, seen

    counter = contextlib.nullcontext()
    expected_losses, expected_grads, _, plain_seen = train(None)
    counter, pipe = OpCounter(), EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes)
    losses, grads, stats, seen = train(pipe)
    return {
        "collectives_seen": (plain_seen, seen),
        "losses": (expected_losses, losses),
        "grads_close": [torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(grads, expected_grads)],
        "stats": stats,
        "explain": pipe.explain(),
        "matmuls": counter.matmuls,
    }


def _batch_of_one_worker(rank, group):
    """The block on a batch of one, its shards ``[1, 8 / W, 16]``: trained with
    gathers in one piece each, then in up to 4 pieces along the sequence
    (``piece_dim``); the reduce-scatters' pieces stay as they are."""
    from eagertp.backends import ring

    whole = _transformer_worker(rank, group, 1, batch=1)
    saved = dict(ring.PIECES)
    ring.PIECES["all_gather"] = (4, 1)
    try:
        return whole, _transformer_worker(rank, group, 1, batch=1)
    finally:
        ring.PIECES.update(saved)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_dtensor_transformer_block_trains_with_every_tp_collective_fused(pool, world, backend):
    """ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModuleInput on
    attention (separate q, k, v) and an MLP with bias, several SGD steps."""
    results = run_on(backend, pool, _transformer_worker, world, 3)
    for r in results:
        assert r["explain"].count(f"[{backend}]") == 8, r["explain"]  # the last step's 8 collectives
        _explains_every_collective(*r["collectives_seen"])
        expected, got = r["losses"]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert all(r["grads_close"]), r["grads_close"]
        for stats in r["stats"]:
            # forward: 2 gathers (attn, mlp) + 2 reduce-scatters; backward: the same again.
            assert stats["all_gather_matmul"] == 4, stats
            assert stats["matmul_reduce_scatter"] == 4, stats
            assert stats.get("unfused_all_gather", 0) == 0 and stats.get("unfused_reduce_scatter", 0) == 0, stats
    from expecttest import assert_expected_inline

    if world == 2 and backend == "ring":
        assert_expected_inline(results[0]["explain"], """\
all_gather #0 f32[2, 4, 16] -> f32[4, 4, 16] on group '2' (2 ranks): fused with mm -> $2, mm -> $3, mm -> $4 [ring]
reduce_scatter(sum) #0 f32[4, 4, 16] -> f32[2, 4, 16] on group '2' (2 ranks): fused with mm -> $5 [ring]
all_gather #1 f32[2, 4, 16] -> f32[4, 4, 16] on group '2' (2 ranks): fused with addmm -> $8 [ring]
reduce_scatter(sum) #1 f32[4, 4, 16] -> f32[2, 4, 16] on group '2' (2 ranks): fused with addmm -> $9 [ring]
all_gather #2 f32[2, 4, 16] -> f32[4, 4, 16] on group '2' (2 ranks): fused with sum (over the rows, once landed) -> mm -> $12, mm (gathered A.t()) -> $13 [ring]
reduce_scatter(sum) #2 f32[4, 4, 16] -> f32[2, 4, 16] on group '2' (2 ranks): fused with mm -> $15 [ring]
all_gather #3 f32[2, 4, 16] -> f32[4, 4, 16] on group '2' (2 ranks): fused with mm (gathered A.t()) -> $19, mm -> $20 [ring]
reduce_scatter(sum) #3 f32[4, 4, 16] -> f32[2, 4, 16] on group '2' (2 ranks): fused with mm + mm + mm -> $26 [ring]""")


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_transformer_on_a_batch_of_one_gathers_in_pieces(pool, world):
    """A batch of one is what long-sequence training runs: its gathers still
    travel in pieces, each consumed as it lands (more matmuls, one a piece),
    every collective fused and every gradient as plain eager's."""
    for whole, pieces in pool.run(_batch_of_one_worker, world):
        for r in (whole, pieces):
            torch.testing.assert_close(r["losses"][1], r["losses"][0], rtol=1e-5, atol=1e-6)
            assert all(r["grads_close"]), r["grads_close"]
            (stats,) = r["stats"]
            assert stats["all_gather_matmul"] == 4 and stats["matmul_reduce_scatter"] == 4, stats
            assert stats.get("unfused_all_gather", 0) == 0 and stats.get("unfused_reduce_scatter", 0) == 0, stats
        assert pieces["matmuls"] > whole["matmuls"], (pieces["matmuls"], whole["matmuls"])


def _inference_worker(rank, group, sequence_parallel):
    """The block's forward as TP inference runs it: under no_grad, and under
    inference_mode, where composite ops (linear) reach the mode whole."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = parallelize_module(TransformerBlock(16, 4), mesh, tensor_parallel_plan(sequence_parallel))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    if sequence_parallel:
        x = x.chunk(group.size(), dim=1)[rank].contiguous()
    with torch.inference_mode(), PlainCollectives() as plain:
        expected = model(x)
    report = {"plain_collectives": collectives_seen(plain)}
    for grad_mode in (torch.no_grad, torch.inference_mode):
        counter, pipe = OpCounter(), EagerMicroPipeline()
        with grad_mode(), counter, pipe:
            got = model(x)
        report[grad_mode.__name__] = {
            "close": torch.allclose(got, expected, rtol=1e-5, atol=1e-6),
            "stats": dict(pipe.stats),
            "issued": [op for op in counter.collectives if op not in ("send", "recv_")],
            "collectives_seen": collectives_seen(pipe),
        }
    return report


@pytest.mark.parametrize(
    "sequence_parallel, stats",
    [
        (True, {"all_gather_matmul": 2, "fused_matmuls": 4, "matmul_reduce_scatter": 2}),
        # No SP: the residual add and ln2 run row by row on the attention
        # all-reduce's gather half, and w1 binds through them (Note [Row-wise
        # ops on gathered rows]); the block's output add, row by row too, is read after.
        (False, {"matmul_all_reduce": 2, "rowwise_ops": 3, "all_gather_matmul": 1, "fused_matmuls": 1}),
    ],
    ids=["tp_sp", "tp"],
)
def test_dtensor_inference_fuses_every_tp_collective(pool, sequence_parallel, stats):
    """TP inference: the forward under no_grad and under inference_mode fuses
    the same collectives (attention's and the MLP's), with plain eager's output."""
    for r in pool.run(_inference_worker, 2, sequence_parallel):
        for grad_mode in ("no_grad", "inference_mode"):
            seen = r[grad_mode].pop("collectives_seen")
            _explains_every_collective(r["plain_collectives"], seen)
            assert r[grad_mode] == {"close": True, "stats": stats, "issued": []}, (grad_mode, r)


def _autocast_transformer_worker(rank, group, min_fuse_bytes=None):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    mesh = DeviceMesh.from_group(group, "cpu")
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).chunk(group.size(), 1)[rank].contiguous()

    def step(ctx):
        torch.manual_seed(0)
        model = parallelize_module(TransformerBlock(16, 4), mesh, tensor_parallel_plan())
        with torch.autocast("cpu", dtype=torch.bfloat16), ctx:
            loss = model(x).float().pow(2).sum()
            loss.backward()
        return loss.detach(), [p.grad.full_tensor() for p in model.parameters()]

    plain = PlainCollectives()
    expected = step(plain)
    pipe = EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes)
    got = step(pipe)
    return {
        "collectives_seen": (collectives_seen(plain), collectives_seen(pipe)),
        "loss": (expected[0], got[0]),
        "grads_close": [torch.allclose(g, e, rtol=2e-2, atol=1e-2) for g, e in zip(got[1], expected[1])],
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
    }


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_dtensor_transformer_under_bf16_autocast_fuses_every_tp_collective(pool, backend):
    for r in run_on(backend, pool, _autocast_transformer_worker, 2):
        assert r["explain"].count(f"[{backend}]") == 8, r["explain"]
        _explains_every_collective(r["collectives_seen"])
        torch.testing.assert_close(r["loss"][1], r["loss"][0], rtol=1e-3, atol=1e-3)
        assert all(r["grads_close"]), r["grads_close"]
        # NB: the bias gradient (a sum over the gathered rows) is computed once the gather lands.
        assert r["stats"] == {"all_gather_matmul": 4, "fused_matmuls": 8, "matmul_reduce_scatter": 4, "rowwise_ops": 1}, r


def _whole_step_worker(rank, group, sequence_parallel, one_all_reduce_per_region=False):
    """Forward, backward, ``clip_grad_norm_`` and AdamW's step (both foreach,
    on DTensors), all inside the block, for three steps."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    mesh = DeviceMesh.from_group(group, "cpu")

    def train(ctx):
        torch.manual_seed(0)
        plan = tensor_parallel_plan(sequence_parallel, one_all_reduce_per_region=one_all_reduce_per_region)
        model = parallelize_module(TransformerBlock(16, 4), mesh, plan)
        # NB: without SP the norms stay plain tensors, which clip_grad_norm_ cannot mix with DTensors.
        clipped = [p for p in model.parameters() if isinstance(p, DTensor)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        norms, stats = [], []
        for step in range(3):
            x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step))
            if sequence_parallel:
                x = x.chunk(group.size(), dim=1)[rank].contiguous()
            with ctx:
                model(x).pow(2).mean().backward()
                norms.append(torch.nn.utils.clip_grad_norm_(clipped, 0.5).full_tensor())
                opt.step()
                opt.zero_grad()
            stats.append(dict(ctx.stats) if isinstance(ctx, EagerMicroPipeline) else ctx.collectives.count("all_reduce"))
            seen.append(collectives_seen(ctx))
        return torch.stack(norms), [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()], stats

    seen: list[int] = []
    expected_norms, expected_params, plain_all_reduces = train(PlainCollectives())
    plain_seen, seen = seen, []
    pipe = EagerMicroPipeline()
    norms, params, stats = train(pipe)
    return {
        "collectives_seen": (plain_seen, seen),
        "plain_all_reduces": plain_all_reduces,
        "norms": (expected_norms, norms),
        "params_close": [torch.allclose(p, e, rtol=1e-4, atol=1e-6) for p, e in zip(params, expected_params)],
        "stats": stats,
        "unfused": [line for line in pipe.explain().splitlines() if "not fused" in line],
        "sums_of_three": sum("fused with mm + mm + mm" in line for line in pipe.explain().splitlines()),
        "hints": [line for line in pipe.explain().splitlines() if line.startswith("hint: ")],
    }


@pytest.mark.parametrize(
    "plan, fused, one_rows",
    [
        # SP: the norms' 4 gradients stay Partial, so DTensor all-reduces them where the clip
        # reads them (4, then its stack of 12 norms) and again in AdamW's step, as in plain
        # eager: none of them a matmul's. (17 all-reduces a step on torch 2.13, 21 on 2.11.)
        ((True,), {"all_gather_matmul": 4, "fused_matmuls": 8, "matmul_reduce_scatter": 4, "rowwise_ops": 1},
         {"f32[12]": 1, "f32[16]": None}),
        # No SP: forward's 2 and backward's 4 (q, k, v and w1's input gradients), then the clip's.
        # Two gather halves feed a matmul through the norm between (row by row):
        # ln2 -> w1 forward, ln2's backward -> wo's gradients. autograd takes the norms'
        # gradients as .grad without copying them (Note [Results over the rows, taken by
        # autograd] in eagertp.rowwise): no copy_ among the row-wise ops.
        ((False,), {"matmul_all_reduce": 6, "rowwise_ops": 10, "all_gather_matmul": 2, "fused_matmuls": 3},
         {"f32[8]": 1}),
        # No SP, each region's input taken once: backward's q, k and v input gradients
        # summed while partial, then one all-reduce (of a sum of three matmuls), not three
        # whose results the chain adds (two row-wise adds fewer).
        ((False, True), {"matmul_all_reduce": 4, "rowwise_ops": 8, "all_gather_matmul": 2, "fused_matmuls": 3},
         {"f32[8]": 1}),
    ],
    ids=["tp_sp", "tp", "tp_one_all_reduce_per_region"],
)
def test_dtensor_whole_step_with_clipping_and_adamw_inside_the_block(pool, plan, fused, one_rows):
    """The training step as loops write it, optimizer and clipping inside the
    block: every TP matmul collective fuses every step; DTensor's all-reduces
    of small replicated tensors (norm gradients, the clip's norms; as many as
    plain eager issues, which depends on DTensor's release) are issued as
    written with their reason; norms and trained weights are plain eager's.
    q's, k's and v's input gradients reach one collective as a sum of three
    matmuls where the plan sums them first (TP + SP's reduce-scatter, or plain
    TP's all-reduce with each region's input taken once), else three."""
    for r in pool.run(_whole_step_worker, 2, *plan):
        assert r["sums_of_three"] == (0 if plan == (False,) else 1), r
        # Three all-reduces added row by row: explain() says how to make them one
        # (Note [Sums of all-reduced tensors] in eagertp.trace).
        if plan == (False,):
            assert len(r["hints"]) == 1 and r["hints"][0].startswith(
                "hint: 3 all-reduces were added to each other, in 1 sum (the first: all_reduce(sum) #3, #4, #5 on "
            ), r["hints"]
        else:
            assert r["hints"] == [], r["hints"]
        torch.testing.assert_close(r["norms"][1], r["norms"][0], rtol=1e-5, atol=1e-6)
        _explains_every_collective(r["collectives_seen"])
        assert all(r["params_close"]), r["params_close"]
        unfused = [n - fused.get("matmul_all_reduce", 0) for n in r["plain_all_reduces"]]
        # From the second step on, the matmuls the step before read whole run
        # at once (Note [Deferrals that gained nothing]), and the rest is the same.
        at_once = [stats.pop("matmuls_run_at_once", 0) for stats in r["stats"]]
        assert at_once[0] == 0 and at_once[1] == at_once[2] > 0, at_once
        assert r["stats"] == [{**fused, "unfused_all_reduce": n} for n in unfused], (r["stats"], r["plain_all_reduces"])
        assert len(r["unfused"]) == unfused[-1], r["unfused"]
        for meta, count in one_rows.items():  # count None: every other line
            reason = f"not fused: {meta} is one row (all dims but the last), which does not split over 2 ranks"
            want = unfused[-1] - sum(n for n in one_rows.values() if n is not None) if count is None else count
            assert sum(reason in line for line in r["unfused"]) == want, r["unfused"]


def _per_linear_sp_worker(rank, group):
    """TP + SP with each column-parallel linear gathering its own input
    (``ColwiseParallel(input_layouts=Shard(1))`` on q, k, v and w1, no
    ``PrepareModuleInput``): forward and backward against plain eager."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from eagertp.demo import TransformerBlock

    mesh = DeviceMesh.from_group(group, "cpu")

    def grads_of(ctx):
        torch.manual_seed(0)
        plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel()}
        plan.update({name: ColwiseParallel(input_layouts=Shard(1)) for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1")})
        plan.update({name: RowwiseParallel(output_layouts=Shard(1)) for name in ("attn.wo", "mlp.w2")})
        model = parallelize_module(TransformerBlock(16, 4), mesh, plan)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).chunk(group.size(), dim=1)[rank]
        with ctx:
            model(x.contiguous()).pow(2).mean().backward()
        return _full_grads(model)

    return _against_plain_eager(grads_of)


def test_dtensor_sp_plan_gathering_one_shard_per_linear_fuses_and_says_so(pool):
    """q, k and v each gather the attention's input shard: three all-gathers
    of one tensor, and three reduce-scatters of its gradient. Every one fuses,
    the gradients are plain eager's, and explain() ends with the hint (Note
    [One shard gathered twice] in eagertp.trace): k's and v's gathers sent
    what q's had."""
    for r in pool.run(_per_linear_sp_worker, 2):
        assert all(r["grads_close"]), r["grads_close"]
        _explains_every_collective(r["collectives_seen"])
        assert r["stats"]["all_gather_matmul"] == 6 and r["stats"]["matmul_reduce_scatter"] == 6, r["stats"]
        hints = [line for line in r["explain"].splitlines() if line.startswith("hint: ")]
        assert hints == [
            "hint: 2 all-gathers sent a shard an earlier all-gather had sent, unchanged (the first: all_gather #1, "
            "what #0 sent, on group '2' (2 ranks)); gathering each shard once would issue 2 fewer: with DTensor, "
            "PrepareModuleInput on the module whose input their linears share (docs: tuning, 'One collective per "
            "region')"
        ], r["explain"]


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]


def _against_plain_eager(grads_of) -> dict:
    """``grads_of(ctx)`` run plainly, then with ``ctx`` an ``EagerMicroPipeline``:
    whether each gradient matches, and the block's stats."""
    plain = PlainCollectives()
    expected = grads_of(plain)
    pipe = EagerMicroPipeline()
    got = grads_of(pipe)
    return {
        "collectives_seen": (collectives_seen(plain), collectives_seen(pipe)),
        "grads_close": [torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(got, expected)],
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
    }


def _accumulation_worker(rank, group, sequence_parallel, micro_batches=4):
    """Gradient accumulation: ``micro_batches`` forward + backward passes in
    one block, each backward adding into the same ``.grad``s."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    mesh = DeviceMesh.from_group(group, "cpu")

    def accumulate(ctx):
        torch.manual_seed(0)
        model = parallelize_module(TransformerBlock(16, 4), mesh, tensor_parallel_plan(sequence_parallel))
        with ctx:
            for micro in range(micro_batches):
                x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(micro))
                if sequence_parallel:
                    x = x.chunk(group.size(), dim=1)[rank].contiguous()
                model(x).pow(2).mean().backward()
        return _full_grads(model)

    return _against_plain_eager(accumulate)


@pytest.mark.parametrize(
    "sequence_parallel, stats",
    [
        (True, {"all_gather_matmul": 16, "fused_matmuls": 32, "matmul_reduce_scatter": 16, "rowwise_ops": 4}),
        # No SP: the first micro-step's norm gradients become .grad without a copy_ (Note
        # [Results over the rows, taken by autograd] in eagertp.rowwise); later ones add into it.
        (False, {"matmul_all_reduce": 24, "rowwise_ops": 40, "all_gather_matmul": 5, "fused_matmuls": 6}),
    ],
    ids=["tp_sp", "tp"],
)
def test_dtensor_gradient_accumulation_in_one_block(pool, sequence_parallel, stats):
    """Four micro-batches in one block: the weight gradients eagertp defers
    (Note [Products past their collective]) add into the ``.grad``s the
    earlier backwards left, as in plain eager; every TP collective fuses."""
    for r in pool.run(_accumulation_worker, 2, sequence_parallel):
        assert all(r["grads_close"]), r["grads_close"]
        _explains_every_collective(r["collectives_seen"])
        assert r["stats"] == stats, r["stats"]


def _double_backward_worker(rank, group, sequence_parallel):
    """A gradient penalty: ``autograd.grad(..., create_graph=True)`` through
    the fused collectives, then backward through those gradients."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group, "cpu")
    if sequence_parallel:
        plan = {"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}

    def run(ctx):
        torch.manual_seed(0)
        model = parallelize_module(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)), mesh, plan)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
        if sequence_parallel:
            x = x.chunk(group.size(), dim=1)[rank].contiguous()
        with ctx:
            loss = model(x).pow(2).mean()
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            penalty = sum(g.to_local().pow(2).sum() for g in grads)  # NB: a local penalty, as plain eager's
            (loss + penalty).backward()
        return _full_grads(model)

    return _against_plain_eager(run)


# The second backward all-reduces an input gradient made of two products and
# a gradient already computed (``mm + f32[16, 16] + mm``): the added tensor
# stays with the products (Note [Epilogues] in eagertp.deferred), so that
# all-reduce fuses too. Torch 2.11's autograd orders the second backward
# otherwise: without SP its all-reduce takes one product, and tanh's backward
# reads the gather half whole before any matmul could take it row by row (one
# fewer fusion; the gradients are plain eager's either way); with SP one more
# sum runs over the rows.
_TORCH_2_11 = torch.__version__ < "2.12"


@pytest.mark.parametrize(
    "sequence_parallel, stats",
    [
        (True, {"all_gather_matmul": 3, "fused_matmuls": 5, "matmul_reduce_scatter": 1, "matmul_all_reduce": 1,
                "rowwise_ops": 3 if _TORCH_2_11 else 2}),
        (False, {"matmul_all_reduce": 2, "rowwise_ops": 2} if _TORCH_2_11 else
                {"matmul_all_reduce": 2, "rowwise_ops": 6, "all_gather_matmul": 1, "fused_matmuls": 2}),
    ],
    ids=["tp_sp", "tp"],
)
def test_dtensor_double_backward_through_fused_collectives(pool, sequence_parallel, stats):
    """Placeholders filled below autograd are recorded in a graph that is
    differentiated again: the second-order gradients are plain eager's."""
    for r in pool.run(_double_backward_worker, 2, sequence_parallel):
        assert all(r["grads_close"]), r["grads_close"]
        _explains_every_collective(r["collectives_seen"])
        assert r["stats"] == stats, r["stats"]


def test_one_all_reduce_per_region_is_a_plain_tp_option():
    from eagertp.demo import tensor_parallel_plan

    with pytest.raises(ValueError, match="one_all_reduce_per_region is for plain TP"):
        tensor_parallel_plan(True, one_all_reduce_per_region=True)
