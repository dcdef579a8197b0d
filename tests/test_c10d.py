"""Raw c10d (Megatron-style) collectives: the caller's output buffer becomes the
placeholder, and the Work returned behaves like a finished one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import OpCounter, PlainCollectives, explained_collectives, fusion_report, integer_tensor
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on

from eagertp import EagerMicroPipeline

WORLDS = [2, 4]


def _column_parallel(x, w, group, *, async_op, api):
    """Megatron's sequence-parallel column-parallel linear forward."""
    world = group.size()
    out = torch.empty(world * x.shape[0], *x.shape[1:])
    if api == "stacked":  # the other output form c10d accepts: [W, *x.shape]
        out = torch.empty(world, *x.shape)
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
        out = out.view(world * x.shape[0], *x.shape[1:])
    else:
        gather = getattr(dist, api)
        work = gather(out, x, group=group, async_op=async_op)
    if async_op:
        assert work.wait() is True and work.is_completed() and work.is_success()
    else:
        assert work is None
    return out @ w


def _row_parallel(h, w, group, *, async_op, op=dist.ReduceOp.SUM, api="reduce_scatter_tensor"):
    y = h @ w
    out = torch.empty(y.shape[0] // group.size(), *y.shape[1:])
    work = getattr(dist, api)(out, y, op=op, group=group, async_op=async_op)
    if async_op:
        work.wait()
    return out


def _megatron_worker(rank, group, async_op, api, min_fuse_bytes=None):
    x = integer_tensor((4, 8), torch.float32, seed=rank)
    w1 = integer_tensor((8, 6), torch.float32, seed=10 + rank)
    w2 = integer_tensor((6, 8), torch.float32, seed=20 + rank)

    def mlp(api):
        h = _column_parallel(x, w1, group, async_op=async_op, api=api)
        scatter = "reduce_scatter_single" if api == "all_gather_single" else "reduce_scatter_tensor"
        return _row_parallel(torch.relu(h), w2, group, async_op=async_op, api=scatter)

    # NB: gloo rejects the stacked output form NCCL accepts; eagertp takes both.
    with PlainCollectives() as plain:
        expected = mlp("all_gather_into_tensor" if api == "stacked" else api)
    with OpCounter() as counter, EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes) as pipe:
        got = mlp(api)
    return {
        "ok": torch.equal(got, expected),
        "explain": pipe.explain(),
        "collectives_seen": (len(plain.collectives), explained_collectives(pipe)),
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
# all_gather_single / reduce_scatter_single exist since torch 2.13.
@pytest.mark.parametrize("api", ["all_gather_into_tensor", "stacked"] + ["all_gather_single"] * hasattr(dist, "all_gather_single"))
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_megatron_style_mlp_fuses_both_collectives(pool, world, async_op, api, backend):
    for r in run_on(backend, pool, _megatron_worker, world, async_op, api):
        assert r["ok"]
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "matmul_reduce_scatter": 1}, r
        assert r["plain_all_gathers"] == 0 and r["plain_reduce_scatters"] == 0, r
        assert r["collectives_seen"] == (2, 2), r  # no invisible collective
        assert_moved_by(backend, r)


def _reduce_op_worker(rank, group, op_name):
    op = getattr(dist.ReduceOp, op_name)
    h = integer_tensor((4, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 6), torch.float32, seed=20 + rank)
    expected = _row_parallel(h, w, group, async_op=False, op=op)
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = _row_parallel(h, w, group, async_op=False, op=op)
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("op_name", ["SUM", "AVG", "MAX"])
def test_c10d_reduce_ops(pool, op_name):
    for r in pool.run(_reduce_op_worker, 2, op_name):
        assert r["ok"]
        assert r["stats"] == {"matmul_reduce_scatter": 1}, r
        assert r["plain_reduce_scatters"] == 0


def _future_worker(rank, group):
    x = integer_tensor((2, 4), torch.float32, seed=rank)
    out = torch.empty(2 * group.size(), 4)
    with EagerMicroPipeline() as pipe:
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=True)
        (value,) = work.get_future().wait()
        total = value.sum()  # a read: issues the pending gather
    expected = torch.empty_like(out)
    dist.all_gather_into_tensor(expected, x, group=group)
    return {"same_buffer": value is out, "ok": torch.equal(out, expected), "total": total.item(), "stats": dict(pipe.stats)}


def test_work_future_returns_the_output_buffer(pool):
    for r in pool.run(_future_worker, 2):
        assert r["same_buffer"] and r["ok"]
        assert r["stats"] == {"unfused_all_gather": 1}


def _list_forms_worker(rank, group):
    """The list and coalesced forms of the collectives (``dist.all_gather``
    into a list, ``dist.reduce_scatter`` from one, ``all_reduce_coalesced``):
    eagertp fuses only the single-tensor forms, so they run as written, each
    with its explain() line and reason (Invariant 4)."""
    from helpers import against_plain_eager

    x = integer_tensor((4, 8), torch.float32, seed=rank)
    world = group.size()

    def program():
        gathered = [torch.empty(4, 8) for _ in range(world)]
        dist.all_gather(gathered, x, group=group)
        scattered = torch.empty(4, 8)
        dist.reduce_scatter(scattered, [x * (i + 1) for i in range(world)], group=group)
        a, b = x.clone(), x * 2
        dist.all_reduce_coalesced([a, b], group=group)
        return [*gathered, scattered, a, b]

    return against_plain_eager(program)


def test_list_and_coalesced_forms_run_as_written_and_are_explained(pool):
    for r in pool.run(_list_forms_worker, 2, timeout=60):
        assert all(r["equal"]), r
        assert r["collectives_seen"] == (3, 3), r
        assert r["stats"] == {"unfused_all_gather": 1, "unfused_reduce_scatter": 1, "unfused_all_reduce": 1}, r
        lines = r["explain"].splitlines()
        # Every tensor of a list form, not only its first.
        assert [line.split(" on group")[0] for line in lines] == [
            "all_gather #0 f32[4, 8] -> [f32[4, 8], f32[4, 8]]",
            "reduce_scatter #0 [f32[4, 8], f32[4, 8]] -> f32[4, 8]",
            "all_reduce #0 [f32[4, 8], f32[4, 8]] -> [f32[4, 8], f32[4, 8]]",
        ], lines
        assert all("eagertp fuses the single-tensor forms; c10d." in line for line in lines), lines


def _out_forms_worker(rank, group):
    """funcol's ``_out`` forms (the output passed as ``out=``) run as written,
    explained by their input and output."""
    from helpers import against_plain_eager

    x = integer_tensor((4, 8), torch.float32, seed=rank)
    ops, world = torch.ops._c10d_functional, group.size()

    def program():
        gathered = torch.empty(4 * world, 8)
        ops.wait_tensor(ops.all_gather_into_tensor_out(x, world, group.group_name, out=gathered))
        scattered = torch.empty(4 // world, 8)
        ops.wait_tensor(ops.reduce_scatter_tensor_out(x, "sum", world, group.group_name, out=scattered))
        return [gathered, scattered]

    return against_plain_eager(program)


def test_out_forms_run_as_written_and_are_explained_by_input_and_output(pool):
    for r in pool.run(_out_forms_worker, 2, timeout=60):
        assert all(r["equal"]), r
        assert r["collectives_seen"] == (2, 2), r
        lines = r["explain"].splitlines()
        assert [line.split(" on group")[0] for line in lines] == [
            "all_gather #0 f32[4, 8] -> f32[8, 8]",
            "reduce_scatter #0 f32[4, 8] -> f32[2, 8]",
        ], lines


def _list_form_writes_worker(rank, group):
    """``dist.all_gather`` into a list whose buffer a deferred matmul reads
    (its outputs nest two lists deep, ``Tensor[][]``): the write completes the
    matmul first (Invariant 9)."""
    x = integer_tensor((4, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 8), torch.float32, seed=5)

    def program():
        a = integer_tensor((4, 8), torch.float32, seed=10 + rank)
        y = a @ w  # deferred: it could feed a reduce-scatter
        dist.all_gather([a, torch.empty(4, 8)] if rank == 0 else [torch.empty(4, 8), a], x, group=group)
        return [y, a]

    expected = program()
    with EagerMicroPipeline(trace=True) as pipe:
        got = program()
    return {"equal": [torch.equal(g, e) for g, e in zip(got, expected)], "trace": pipe.debug_string()}


def test_a_list_form_collective_writing_what_a_deferred_matmul_reads_completes_it_first(pool):
    for r in pool.run(_list_form_writes_worker, 2, timeout=60):
        assert all(r["equal"]), r
        assert "wait: c10d.allgather_.default writes what $0 reads" in r["trace"], r["trace"]
