"""Matmul + all-gather of its output (Note [Matmul + all-gather] in
eagertp.collectives.all_gather) on 2 and 4 gloo ranks.

The ring makes the gathered shard message by message, each sent as soon as
it is made; helpers.with_small_pieces splits every shard into up to 4 pieces
(on 2 ranks each travels as up to 2 messages: Note [Wire pieces]) so that
small shapes exercise it. Each test asserts that the result equals plain eager
(bitwise on integer-valued inputs), that the fused path ran
(``stats["matmul_all_gather"]``, and the matmul issued once per message of
the shard, both seen by an outer OpCounter) and that no plain all-gather was
issued.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import (
    NEEDS_ROWWISE_SCALED_MM, OpCounter, all_gather, col_major, fp8_scales, fp8_tensor, fusion_report, integer_tensor,
    with_small_pieces,
)
from symm_mem_emulation import run_on

from eagertp import EagerMicroPipeline

WORLDS = [2, 4]


def _report(pipe, counter: OpCounter) -> dict:
    return {
        **fusion_report(pipe, counter),
        "matmuls": counter.matmuls,
        "sends": counter.counts["c10d.send.default"],
        "copies": counter.counts["aten.copy_.default"],
        "explain": pipe.explain(),
        "trace": pipe.debug_string(),
    }


def messages_of_the_shard(r: dict, world: int) -> int:
    """The messages this rank's shard travelled in: on 2 ranks every send the
    OpCounter saw; on more, the pieces of with_small_pieces (the ring's
    helper thread forwards shards, where the counter, a thread-local mode,
    does not see them, and a piece is one message: Note [Wire pieces])."""
    return r["sends"] if world == 2 else 4


def _assert_produced(r: dict, world: int, *, terms: int = 1, extra: int = 0) -> None:
    """Fused, and the product made one message at a time (``terms`` matmuls
    each, ``extra`` others): with_small_pieces' 4 pieces, on 2 ranks each in
    2 messages where it has the rows (Note [Wire pieces])."""
    assert r["stats"].get("matmul_all_gather") == 1, r
    assert r["stats"].get("unfused_all_gather", 0) == 0, r
    assert r["plain_all_gathers"] == 0, r
    messages = messages_of_the_shard(r, world)
    assert messages >= 4, r
    assert r["matmuls"] == terms * messages + extra, r  # one matmul per message: made as it was sent


def _product_worker(rank, group, x_shape, n, gather_dim, bias):
    """``all_gather(linear(x, w, b), gather_dim)``: a 2-D product, or a 3-D
    linear gathered along its last dim (HF's colwise_rep lm_head)."""
    x = integer_tensor(x_shape, torch.float32, seed=rank)
    w = integer_tensor((n, x_shape[-1]), torch.float32, seed=1)
    b = integer_tensor((n,), torch.float32, seed=2) if bias else None
    expected = all_gather(nn.functional.linear(x, w, b), group, gather_dim)
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = all_gather(nn.functional.linear(x, w, b), group, gather_dim)
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "x_shape,gather_dim",
    [((8, 16), 0), ((8, 16), 1), ((4, 3, 16), 2), ((4, 3, 16), 0), ((1, 8, 16), 2), ((1, 8, 16), 0)],
    ids=["2d", "2d-last", "3d-last", "3d", "batch-of-one-last", "batch-of-one"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_product_is_made_as_it_is_sent(pool, world, x_shape, gather_dim, bias):
    for r in pool.run(with_small_pieces, world, _product_worker, x_shape, 6, gather_dim, bias):
        assert r["ok"], r
        _assert_produced(r, world)
        # 8 rows a shard: 4 pieces of 2, each in 2 messages on 2 ranks; 4 rows: 4 of 1.
        assert messages_of_the_shard(r, world) == (8 if world == 2 and x_shape[-2] == 8 else 4), r
        assert "matmul_all_gather($0) [ring]" in r["trace"], r["trace"]
        if gather_dim == 0:  # made in this rank's chunk of the result: no copy of the shard
            assert r["copies"] == 0, r
        assert "fused with " + ("addmm" if bias else "mm") + " -> $0 [ring]" in r["explain"], r["explain"]


def _gathered_product_worker(rank, group, verify=False):
    """``all_gather(x @ w)``, the plainest form."""
    x = integer_tensor((8, 16), torch.float32, seed=rank)
    w = integer_tensor((16, 6), torch.float32, seed=1)
    expected = all_gather(x @ w, group)
    with OpCounter() as counter, EagerMicroPipeline(verify=verify, trace=True) as pipe:
        got = all_gather(x @ w, group)
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


def test_shard_in_one_piece_is_made_first(pool):
    """The default pieces (Note [Pieces]) send a small shard whole: nothing to
    overlap, so the product is made first, and the trace says why."""
    for r in pool.run(_gathered_product_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"unfused_all_gather": 1}, r
        assert r["matmuls"] == 1, r
        assert "wait: all_gather_into_tensor made $0 first: f32[8, 6] travels in one piece" in r["trace"], r["trace"]
        (line,) = r["explain"].splitlines()
        assert line.endswith(
            "none ran while it was in flight; mm -> $0 made its shard first: f32[8, 6] travels in one piece "
            "(Note [Pieces]): nothing to overlap its making with"
        ), line


def _consumed_worker(rank, group):
    """The gathered product feeds another matmul: both halves fuse."""
    x = integer_tensor((8, 16), torch.float32, seed=rank)
    w1 = integer_tensor((16, 6), torch.float32, seed=1)
    w2 = integer_tensor((6, 5), torch.float32, seed=2)
    expected = all_gather(x @ w1, group) @ w2
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = all_gather(x @ w1, group) @ w2
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
def test_gathered_product_feeding_a_matmul(pool, world):
    for r in pool.run(with_small_pieces, world, _consumed_worker):
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_gather": 1, "all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["plain_all_gathers"] == 0, r
        (line,) = [line for line in r["explain"].splitlines() if line.startswith("all_gather #0")]
        assert line.endswith("fused with mm -> $0; then the gathered tensor fused with mm -> $2 [ring]"), line


def _read_after_worker(rank, group):
    """The program reads the product itself after gathering it, and writes it:
    the product is complete, and the write waits for the sends from it."""
    x = integer_tensor((8, 16), torch.float32, seed=rank)
    w = integer_tensor((16, 6), torch.float32, seed=1)
    c = x @ w
    expected = (all_gather(c, group), c.sum())
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        c = x @ w
        g = funcol_gather_unwaited(c, group)
        total = c.sum()
        c.mul_(0)
        got = (g.wait() if hasattr(g, "wait") else g, total)
    return {"ok": all(torch.equal(a, b) for a, b in zip(got, expected)), **_report(pipe, counter)}


def funcol_gather_unwaited(t, group):
    from eagertp._compat import funcol_all_gather

    return funcol_all_gather(t, 0, group)


def test_product_read_and_overwritten_after_its_gather(pool):
    """The product was made into the gathered tensor; its own placeholder is
    computed when the program reads it (one more matmul), as after a fused
    reduce-scatter."""
    for r in pool.run(with_small_pieces, 2, _read_after_worker):
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_gather": 1} and r["plain_all_gathers"] == 0, r
        assert r["matmuls"] == messages_of_the_shard(r, 2) + 1, r


def _mixed_worker(rank, group):
    """Rank 0 reads its product before the gather (made whole, then sent),
    rank 1 makes it as it sends: the same messages (Invariant 2)."""
    x = integer_tensor((8, 16), torch.float32, seed=rank)
    w = integer_tensor((16, 6), torch.float32, seed=1)
    expected = all_gather(x @ w, group)
    with EagerMicroPipeline(trace=True) as pipe:
        c = x @ w
        if rank == 0:
            c.sum()
        got = all_gather(c, group)
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats)}


def test_ranks_making_the_shard_differently_interoperate(pool):
    r0, r1 = pool.run(with_small_pieces, 2, _mixed_worker, timeout=30)
    assert r0["ok"] and r1["ok"]
    assert r0["stats"] == {"unfused_all_gather": 1}
    assert r1["stats"] == {"matmul_all_gather": 1}


def _c10d_worker(rank, group):
    """Raw c10d (Megatron style): ``dist.all_gather_into_tensor(out, x @ w)``."""
    world = group.size()
    x = integer_tensor((8, 16), torch.float32, seed=rank)
    w = integer_tensor((16, 6), torch.float32, seed=1)
    expected = torch.empty(8 * world, 6)
    dist.all_gather_into_tensor(expected, x @ w, group=group)
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = torch.empty(8 * world, 6)
        dist.all_gather_into_tensor(got, x @ w, group=group)
    return {"ok": torch.equal(got, expected), **_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
def test_raw_c10d_gather_of_a_product(pool, world):
    for r in pool.run(with_small_pieces, world, _c10d_worker):
        assert r["ok"], r
        _assert_produced(r, world)


def test_verify_covers_it(pool):
    for r in pool.run(with_small_pieces, 2, _gathered_product_worker, True):
        assert r["ok"] and r["stats"] == {"matmul_all_gather": 1}, r
        assert r["plain_all_gathers"] == 1, r  # verify's own: plain eager's gather, to compare with
        assert r["matmuls"] == 8 + 1, r  # the product in 8 messages (4 pieces of 2), and verify's whole one


def test_symm_mem_makes_the_product_first(pool):
    """symm_mem sends a shard whole: the product is made first, with the reason."""
    for r in run_on("symm_mem", pool, _gathered_product_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"unfused_all_gather": 1}, r
        assert r["matmuls"] == 1, r
        assert "mm -> $0 made its shard first: symm_mem gathers a shard whole" in r["explain"], r["explain"]


def _dtensor_worker(rank, group, checkpointed=None):
    """DTensor's ``ColwiseParallel(output_layouts=Replicate())`` (HF's
    colwise_rep): the output's gather is fused forward; backward takes this
    rank's slice of the output's gradient (no collective) and all-reduces
    the input's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.distributed.tensor import Replicate

    world = group.size()
    mesh = DeviceMesh.from_group(group, "cpu")  # NB: no new group: Note [Groups made by jobs] in multirank.py
    model = nn.Linear(16, 8 * world, bias=True)
    with torch.no_grad():  # integer-valued: plain eager and the pieces agree bitwise
        model.weight.copy_(integer_tensor(model.weight.shape, torch.float32, seed=1))
        model.bias.copy_(integer_tensor(model.bias.shape, torch.float32, seed=2))
    ref = nn.Linear(16, 8 * world, bias=True)
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, ColwiseParallel(output_layouts=Replicate()))
    x = integer_tensor((2, 4, 16), torch.float32, seed=7).requires_grad_()  # NB: reentrant checkpointing needs one
    expected = ref(x)
    expected.square().sum().backward()
    if checkpointed:  # as activation checkpointing wraps a TP block
        from torch.utils.checkpoint import checkpoint

        def run(t):
            return checkpoint(model, t, use_reentrant=checkpointed == "reentrant")
    else:
        run = model
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        y = run(x)
        y.square().sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    want = {name: p.grad for name, p in ref.named_parameters()}
    ok = {"out": torch.equal(y, expected), **{k: torch.equal(grads[k], want[k]) for k in want}}
    return {"ok": all(ok.values()), "which": ok, **_report(pipe, counter)}


# checkpointing -> the gathers made as sent: reentrant checkpointing reruns
# the whole block in backward, gather included; the non-reentrant form stops
# once the linear's saved inputs are back (torch's early stop), before it.
_CHECKPOINTED = {None: 1, "reentrant": 2, "nonreentrant": 1}


@pytest.mark.parametrize("checkpointed", list(_CHECKPOINTED), ids=["plain", "reentrant", "nonreentrant"])
def test_dtensor_colwise_replicated_output(pool, checkpointed):
    for r in pool.run(with_small_pieces, 2, _dtensor_worker, checkpointed):
        assert r["ok"], r
        # Backward: the input gradient's all-reduce (Partial -> Replicate), fused too.
        assert r["stats"] == {"matmul_all_gather": _CHECKPOINTED[checkpointed], "matmul_all_reduce": 1}, r
        assert r["plain_all_gathers"] == 0, r


def _product_kinds_worker(rank, group, kind):
    """The products the other fused forms take, gathered: a sum of matmuls
    (autograd's accumulated input gradient), the cast of one (mixed
    precision), an FP8 ``_scaled_mm`` with row-wise scales."""
    x1, x2 = (integer_tensor((8, 16), torch.float32, seed=10 * rank + i) for i in range(2))
    w1, w2 = (integer_tensor((16, 6), torch.float32, seed=i) for i in range(2))
    # NB: FP8 shapes as _scaled_mm's meta kernel takes them (multiples of 16)
    a, w = fp8_tensor((8, 16), seed=rank), col_major(fp8_tensor((16, 16), seed=3))
    scale_a, scale_b = fp8_scales("rowwise", 8, 16, seed=4 + rank)
    programs = {
        "sum": lambda: all_gather(x1 @ w1 + x2 @ w2, group),
        "cast": lambda: all_gather((x1 @ w1).to(torch.bfloat16), group),
        "scaled": lambda: all_gather(torch._scaled_mm(a, w, scale_a, scale_b, out_dtype=torch.float32), group),
    }
    expected = programs[kind]()
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = programs[kind]()
    return {
        "ok": torch.equal(got, expected),
        "scaled_mms": sum(n for op, n in counter.counts.items() if op.startswith("aten._scaled_mm.")),
        **_report(pipe, counter),
    }


@pytest.mark.parametrize("kind", ["sum", "cast", pytest.param("scaled", marks=NEEDS_ROWWISE_SCALED_MM)])
def test_products_of_every_kind(pool, kind):
    for r in pool.run(with_small_pieces, 2, _product_kinds_worker, kind):
        assert r["ok"], r
        # A matmul per message and term; FP8: the meta kernel's check of the shapes too.
        terms, scaled_mms = {"sum": (2, 0), "cast": (1, 0), "scaled": (0, 8 + 1)}[kind]
        _assert_produced(r, 2, terms=terms)
        assert r["scaled_mms"] == scaled_mms, r


def _whole_shard_backends_worker(rank, group):
    """The backends that send a shard whole still implement the contract:
    the shard made, then gathered."""
    from eagertp.backends.reference import ReferenceBackend
    from eagertp.backends.ring import RingBackend

    shard = torch.empty(4, 8)
    want = torch.cat([integer_tensor((4, 8), torch.float32, seed=r) for r in range(group.size())])
    results = {}
    for backend in (ReferenceBackend(), RingBackend()):
        made = []

        def producer(piece, rows):
            made.append(rows)
            piece.copy_(integer_tensor((4, 8), torch.float32, seed=rank)[rows])

        out = torch.empty(4 * group.size(), 8)
        backend.produce_all_gather(producer, shard, out, group).consume(None)
        results[backend.name] = (torch.equal(out, want), len(made), backend.why_not_produce_all_gather(shard, group))
    return results


def test_backends_that_send_a_shard_whole_make_it_first(pool):
    for r in pool.run(with_small_pieces, 2, _whole_shard_backends_worker):
        assert r["reference"] == (True, 1, "the reference backend gathers a shard whole, as plain eager does"), r
        assert r["ring"] == (True, 4, None), r  # in pieces (helpers.with_small_pieces)
