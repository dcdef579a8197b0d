"""Buffers reused across collectives: every write is seen (Note [Every write is
seen] in eagertp.engine).

Megatron-core gathers every sequence-parallel layer's input with raw c10d into
one global buffer, handing out views of one storage in several shapes, while
a weight gradient on the previous gather may still be pending. Before any op
writes memory that pending work reads or a gather in flight fills, that work
completes; a new gather into the buffer waits its turn, in program order.

The property test draws such programs (hypothesis): raw c10d gathers and
reduce-scatters into shared buffers and views of them, matmuls reading them in
every form a gather feeds (forward and dgrad rows, weight gradients on either
side), some left pending, in-place writes and in-place all-reduces over them,
and reads and flushes in random order, on one rank or all. Every tensor the
program observes equals plain eager, bitwise (integer values; weights are
signed permutations, so magnitudes grow only through sums over ranks).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers import OpCounter, PlainCollectives, explained_collectives, fusion_report, integer_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on

from eagertp import EagerMicroPipeline

F32 = torch.float32
H = 8  # hidden
R = 2  # rows of one rank's shard


def _gathers_into_one_buffer_worker(rank, group, views):
    """The program that broke under Megatron's tied GPTModel: two raw gathers
    into one buffer, a weight gradient on the first left pending, then a read
    of the first product. ``views``: each gather writes a new view of the
    buffer (``get_tensor`` of Megatron's global memory buffer), else the same
    tensor."""
    world = group.size()
    x1, x2 = integer_tensor((R, H), F32, seed=rank), integer_tensor((R, H), F32, seed=10 + rank)
    g = integer_tensor((R * world, 6), F32, seed=20)
    storage = torch.zeros(2 * R * world * H)

    def buffer():
        return storage[: R * world * H].view(R * world, H) if views else whole

    whole = storage[: R * world * H].view(R * world, H)

    def program():
        storage.zero_()
        b1 = buffer()
        dist.all_gather_into_tensor(b1, x1, group=group)
        dw1 = g.t() @ b1  # autograd's weight gradient: left pending
        b2 = buffer()
        dist.all_gather_into_tensor(b2, x2, group=group)
        dw2 = g.t() @ b2
        first = dw1.clone()  # the read
        return first, dw2.clone(), b2.clone()

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = program()
    return {
        "equal": [torch.equal(a, b) for a, b in zip(got, expected)],
        "waits": [e for e in pipe.debug_string().splitlines() if e.startswith("wait")],
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("views", [False, True], ids=["same tensor", "new views"])
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_a_gather_into_a_buffer_pending_work_reads_waits_its_turn(pool, backend, world, views):
    for r in run_on(backend, pool, _gathers_into_one_buffer_worker, world, views):
        assert all(r["equal"]), r
        # Both gathers fused with their weight gradient; the second waited for the first.
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 2}, r
        assert r["plain_all_gathers"] == 0, r
        assert r["waits"][0] == "wait: c10d._allgather_base_.default writes $0's buffer", r
        assert_moved_by(backend, r)


def _writes_worker(rank, group, how):
    """A write into memory that a pending product reads completes that
    product, and only it: an unrelated product stays pending and still fuses
    with its reduce-scatter."""
    world = group.size()
    x = integer_tensor((R * world, H), F32, seed=rank)
    w = integer_tensor((H, H), F32, seed=3)
    h, v = integer_tensor((R * world, H), F32, seed=4), integer_tensor((H, H), F32, seed=5)

    def program():
        buf = x.clone()
        y = buf @ w  # reads buf: pending
        z = h @ v  # unrelated: pending, feeds the reduce-scatter below
        if how == "add_":
            buf.add_(1)
        elif how == "copy_":
            buf.copy_(h)
        elif how == "mm out=":
            torch.mm(h, v, out=buf)
        elif how == "all_reduce in place":
            dist.all_reduce(buf, group=group)
        elif how == "reduce_scatter out":
            dist.reduce_scatter_tensor(buf[:R], h.clone(), group=group)
        elif how == "all_gather out":
            dist.all_gather_into_tensor(buf, h[:R].clone(), group=group)
        elif how == "broadcast":
            dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        elif how == "all_to_all out":
            dist.all_to_all_single(buf, h.clone(), group=group)
        elif how == "set_":  # buf now views other memory: y must have read the old
            buf.set_(h.clone())
        elif how == "resize_":  # buf's shape changes: y must have read the old
            buf.resize_(R, H)
        out = torch.empty(R, H)
        dist.reduce_scatter_tensor(out, z, group=group)
        return y.clone(), buf.clone(), out

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
        got = program()
    return {
        "equal": [torch.equal(a, b) for a, b in zip(got, expected)],
        "waits": [e for e in pipe.debug_string().splitlines() if e.startswith(("wait", "flush"))],
        **fusion_report(pipe, counter),
    }


WRITES = [
    "add_", "copy_", "mm out=", "all_reduce in place", "reduce_scatter out", "all_gather out", "broadcast",
    "all_to_all out", "set_", "resize_",
]


@pytest.mark.parametrize("how", WRITES)
def test_a_write_completes_only_the_work_that_reads_it(pool, how):
    for r in pool.run(_writes_worker, 2, how):
        assert all(r["equal"]), r
        assert r["stats"]["matmul_reduce_scatter"] == 1, r  # z stayed pending through the write
        op = {
            "add_": "aten.add_.Tensor", "copy_": "aten.copy_.default", "mm out=": "aten.mm.out",
            "all_reduce in place": "c10d.allreduce_.default", "reduce_scatter out": "c10d._reduce_scatter_base_.default",
            "all_gather out": "c10d._allgather_base_.default", "broadcast": "c10d.broadcast_.default",
            "all_to_all out": "c10d.alltoall_base_.default", "set_": "aten.set_.source_Tensor",
            "resize_": "aten.resize_.default",
        }[how]
        assert r["waits"][0] == f"wait: {op} writes what $0 reads", r


# -- the property test ------------------------------------------------------

# Regions of two buffers a program gathers into, reduce-scatters into, reads
# and writes, each time as a new view (Megatron's global buffer): the low and
# high half of buffer 0, the low half of buffer 1, and buffer 0 from its
# second row (overlapping both of its halves).
REGIONS = 4
STEPS = ["gather", "gather_async", "funcol_gather", "dgrad", "wgrad", "wgrad_t", "reduce_scatter",
         "all_reduce_product", "all_reduce_region", "add_", "copy_", "mm_out", "read", "flush"]


def _overlap(a: int, b: int) -> bool:
    """Regions ``a`` and ``b`` share memory (plain eager refuses such copies)."""
    return a == b or {a, b} in ({0, 3}, {1, 3})


@st.composite
def buffer_programs(draw) -> list[tuple]:
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        step = draw(st.sampled_from(STEPS))
        region = draw(st.integers(0, REGIONS))  # REGIONS: funcol's last gathered tensor
        other = draw(st.integers(0, REGIONS))
        rank = draw(st.sampled_from([0, 1, None]))  # a read or flush on one rank, or on all
        steps.append((step, region, other, rank))
    return steps


def _buffer_program(rank, group, steps, min_fuse_bytes, small_pieces):
    import torch.distributed._functional_collectives as funcol

    world = group.size()
    half = world * R * H

    def perm(i):
        # A signed permutation: values stay integers of the same magnitudes.
        g = torch.Generator().manual_seed(1000 + i)
        signs = torch.randint(0, 2, (H,), generator=g).float() * 2 - 1
        return torch.eye(H)[torch.randperm(H, generator=g)] * signs[:, None]

    def signs(i):
        g = torch.Generator().manual_seed(2000 + i)
        return torch.randint(0, 2, (world * R, H), generator=g).float() * 2 - 1

    def execute(pipe):
        buffers = [torch.zeros(2 * half), torch.zeros(2 * half)]
        gathered = [torch.zeros(world * R, H)]  # funcol's latest result

        def region(i):
            """A new view of region ``i``, as the program sees it."""
            if i == 0:
                return buffers[0][:half].view(world * R, H)
            if i == 1:
                return buffers[0][half:].view(world * R, H)
            if i == 2:
                return buffers[1][:half].view(world * R, H)
            if i == 3:
                return buffers[0][H : H + half].view(world * R, H)
            return gathered[0]

        def rows(i):
            return region(i).view(world * R, H)

        kept = []
        for i, (step, a, b, on) in enumerate(steps):
            shard = integer_tensor((R, H), F32, seed=100 * i + rank)
            here = on is None or on == rank
            if step == "gather" and a < REGIONS:
                dist.all_gather_into_tensor(region(a), shard, group=group)
            elif step == "gather_async" and a < REGIONS:
                # Megatron's backward: the gather overlaps an unrelated matmul, then waits.
                work = dist.all_gather_into_tensor(region(a), shard, group=group, async_op=True)
                kept.append(shard @ perm(i))
                work.wait()
            elif step == "funcol_gather":
                gathered[0] = funcol.all_gather_tensor(shard, 0, group).wait()
            elif step == "dgrad":
                kept.append(rows(a) @ perm(i))
            elif step == "wgrad":  # autograd's weight gradient, gathered rows as B
                kept.append(signs(i).t() @ rows(a))
            elif step == "wgrad_t":  # gathered rows as A.t()
                kept.append(rows(a).t() @ signs(i))
            elif step == "reduce_scatter":  # into a region's first rows, or a new tensor
                out = rows(b)[:R] if b < REGIONS else torch.empty(R, H)
                dist.reduce_scatter_tensor(out, rows(a) @ perm(i), group=group)
                kept.append(out)
            elif step == "all_reduce_product":
                y = rows(a) @ perm(i)
                dist.all_reduce(y, group=group)
                kept.append(y)
            elif step == "all_reduce_region":
                dist.all_reduce(region(a), group=group)
            elif step == "add_":
                region(a).add_(1)
            elif step == "copy_" and not _overlap(a, b):
                rows(a).copy_(rows(b))
            elif step == "mm_out" and not _overlap(a, b):
                torch.mm(rows(b), perm(i), out=rows(a))
            elif step == "read" and here:
                kept.append(rows(a).clone())
            elif step == "flush" and here and pipe is not None:
                pipe.flush()
        return kept + buffers + gathered

    with PlainCollectives() as plain:
        expected = execute(None)
    pipe = EagerMicroPipeline(poison=True, min_fuse_bytes=min_fuse_bytes)

    def run(*_):
        with pipe:
            return execute(pipe)

    if small_pieces:
        from helpers import with_small_pieces

        got = with_small_pieces(rank, group, run)
    else:
        got = run()
    return {
        "equal": [torch.equal(g, e) for g, e in zip(got, expected)],
        "explain": pipe.explain(),
        "collectives_seen": (len(plain.collectives), explained_collectives(pipe)),
    }


# EAGERTP_BUFFER_EXAMPLES=2000 for a long run by hand.
@settings(max_examples=int(os.environ.get("EAGERTP_BUFFER_EXAMPLES", 40)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=buffer_programs(), world=st.sampled_from([2, 3, 4]), small_pieces=st.booleans(),
    # Per-rank buffers are 64 bytes: 0 fuses everything, 1 KiB issues every collective as written.
    min_fuse_bytes=st.sampled_from([0, 0, 1024]),
)
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_programs_that_reuse_buffers_match_plain_eager(pool, backend, steps, world, min_fuse_bytes, small_pieces):
    args = (steps, min_fuse_bytes, small_pieces)
    for rank, r in enumerate(run_on(backend, pool, _buffer_program, world, *args, timeout=30)):
        assert all(r["equal"]), (
            f"rank {rank} of {world} differs from plain eager for {steps} on {backend} "
            f"(min_fuse_bytes={min_fuse_bytes}, small_pieces={small_pieces}): {r['equal']}\n{r['explain']}"
        )
        plain, explained = r["collectives_seen"]  # no invisible collective
        assert plain == explained, (steps, r["collectives_seen"], r["explain"])


def _scatter_into_its_input_worker(rank, group):
    """A reduce-scatter into the buffer its own input product reads (found by
    the property test): the product must be computed before the output is
    written, so it completes first and the reduce-scatter runs unfused."""
    world = group.size()
    storage = torch.zeros(2 * world * R * H)
    x = integer_tensor((R, H), F32, seed=rank)
    w = integer_tensor((H, H), F32, seed=3)

    def program():
        storage.zero_()
        region = storage[: world * R * H].view(world * R, H)
        dist.all_gather_into_tensor(region, x, group=group)
        dist.all_gather_into_tensor(storage[world * R * H :].view(world * R, H), x * 2, group=group)
        out = region[:R]  # the first rows of what the product reads
        dist.reduce_scatter_tensor(out, region @ w, group=group)
        return storage.clone()

    from helpers import with_small_pieces

    expected = program()
    pipe = EagerMicroPipeline()

    def fused(*_):
        with pipe:
            return program()

    got = with_small_pieces(rank, group, fused)  # the ring writes each piece as it reduces it
    return {"equal": torch.equal(got, expected), "stats": dict(pipe.stats)}


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_a_reduce_scatter_into_the_memory_its_product_reads(pool, backend):
    for r in run_on(backend, pool, _scatter_into_its_input_worker, 2):
        assert r["equal"], r
        assert r["stats"].get("matmul_reduce_scatter", 0) == 0, r
