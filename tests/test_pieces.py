"""The ring's piecewise pipeline: a shard may travel in pieces and the consumers
run per piece. It is off by default (one piece, by measurement on CPU) and on
here through helpers.with_small_pieces (up to 4 pieces of any size); every
fusion form must still equal plain eager bitwise, including consumers whose
rows do not split along the pieces (they wait for the whole shard)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from helpers import OpCounter, all_gather, all_reduce, fusion_report, integer_tensor, reduce_scatter, with_small_pieces
from symm_mem_emulation import run_on
from test_all_gather_matmul import _assert_fused, _contract_worker, _gather_dim_worker, _linear_worker

from eagertp import EagerMicroPipeline
from eagertp.backends.base import piece_dim
from eagertp.backends.ring import piece_rows, wire_rows

WORLDS = [2, 4]


def test_piece_rows_depend_on_shape_only():
    split = {"max_pieces": 4, "min_bytes": 64 * 1024}
    assert piece_rows(torch.empty(1, 8), "all_gather", **split) == (slice(0, 1),)
    assert piece_rows(torch.empty(1024, 1024), "all_gather", **split) == (
        slice(0, 256), slice(256, 512), slice(512, 768), slice(768, 1024)
    )
    assert piece_rows(torch.empty(3, 8), "all_gather", **split) == (slice(0, 3),)  # 96 bytes: below the minimum piece
    # The defaults (Note [Pieces]): up to 2 pieces of a gathered shard, 1 of a
    # reduce-scattered chunk, up to 2 of an all-reduced one from 2 MiB.
    assert piece_rows(torch.empty(1024, 1024), "all_gather") == (slice(0, 512), slice(512, 1024))
    assert piece_rows(torch.empty(1024, 1024), "reduce_scatter") == (slice(0, 1024),)
    assert piece_rows(torch.empty(1024, 1024), "all_reduce") == (slice(0, 512), slice(512, 1024))
    assert piece_rows(torch.empty(512, 512), "all_reduce") == (slice(0, 512),)  # 1 MiB: whole
    # A batch of one splits along the dim after it: the same bytes as [1024, 1024].
    assert piece_rows(torch.empty(1, 1024, 1024), "all_gather") == (slice(0, 512), slice(512, 1024))


def test_wire_rows_split_each_piece_where_it_holds_the_minimum_twice():
    """Note [Wire pieces]: on the 2-rank ring each piece travels as up to 2
    messages of at least the kind's minimum bytes; its rows are the piece's."""
    shard = torch.empty(1024, 1024)  # 4 KiB a row
    rows = piece_rows(shard, "all_gather")  # 2 pieces of 2 MiB
    assert wire_rows(shard, rows) == [[slice(0, 256), slice(256, 512)], [slice(512, 768), slice(768, 1024)]]
    small = torch.empty(96, 1024)  # 384 KiB: 1 piece, 1 message
    assert wire_rows(small, piece_rows(small, "all_gather")) == [[slice(0, 96)]]
    # Pieces of 320 and 192 KiB: neither holds twice the 256 KiB minimum, so each is one message.
    odd = torch.empty(128, 1024)
    assert wire_rows(odd, [slice(0, 80), slice(80, 128)]) == [[slice(0, 80)], [slice(80, 128)]]
    assert wire_rows(odd, [slice(0, 128)]) == [[slice(0, 128)]]
    assert wire_rows(torch.empty(2048, 1024), [slice(0, 1024), slice(1024, 2048)]) == [
        [slice(0, 512), slice(512, 1024)], [slice(1024, 1536), slice(1536, 2048)]
    ]


def _behind_the_wire_worker(rank, group, waited_s, late_rank):
    """``all_gather(x) @ w`` with an ``[8, 8]`` shard: 4 pieces of 2 rows, 2
    messages each on the 2-rank ring (Note [Wire pieces]). ``waited_s``
    overrides ring.WAITED_S (None: the default). Rank ``late_rank`` (if any)
    issues its gather 0.3 s late, so that its peer's consumer waits for its
    first message, and idles 0.3 s before its own matmul, by when its peer's
    messages have landed."""
    from eagertp.backends import ring

    x = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 8), torch.float32, seed=1)
    expected = all_gather(x, group) @ w
    saved = ring.WAITED_S
    ring.WAITED_S = saved if waited_s is None else waited_s
    try:
        with OpCounter() as counter, EagerMicroPipeline() as pipe:
            if rank == late_rank:
                time.sleep(0.3)
            g = all_gather(x, group)
            if rank == late_rank:
                time.sleep(0.3)
            got = g @ w
    finally:
        ring.WAITED_S = saved
    return {"ok": torch.equal(got, expected), "matmuls": counter.matmuls, **fusion_report(pipe, counter)}


@pytest.mark.parametrize(
    "waited_s,late_rank,matmuls",  # matmuls: (fewest, most) on each rank
    [
        (float("inf"), None, [(5, 5), (5, 5)]),  # never behind: a matmul a piece
        (-1.0, None, [(9, 9), (9, 9)]),  # always behind: a matmul a message
        (None, 1, [(6, 9), (5, 9)]),  # rank 0 waits for its late peer's first message at least
    ],
    ids=["landed", "behind", "late-peer"],
)
def test_a_consumer_behind_the_wire_multiplies_each_message(pool, waited_s, late_rank, matmuls):
    """A consumer of gathered rows that had to wait for a piece's first
    message multiplies each message of it as it lands; one whose messages had
    landed, each piece. This rank's shard comes first, whole. The messages
    are the same either way (4 pieces, 2 messages each), bitwise equal."""
    results = pool.run(with_small_pieces, 2, _behind_the_wire_worker, waited_s, late_rank, timeout=30)
    for (fewest, most), r in zip(matmuls, results):
        assert r["ok"], r
        _assert_fused(r, calls=1, matmuls=1)
        assert r["p2p_ops"] == 2 * 8, r  # 4 pieces, 2 messages each, sent and received
        assert fewest <= r["matmuls"] <= most, r


def test_piece_dim_skips_leading_ones_but_never_splits_the_last_dim():
    assert [piece_dim(s) for s in [(8,), (1, 8), (4, 8), (1, 4, 8), (1, 1, 4, 8), (2, 1, 4, 8), (1, 1, 8)]] == [
        0, 0, 0, 1, 2, 0, 1
    ]


def _batch_of_one_worker(rank, group, shard_shape, gather_dim, form):
    """A shard that leads with dims of size 1 (a batch of one, sharded along
    the sequence: DTensor SP's [1, S/W, D]) gathered along ``gather_dim`` and
    read by one matmul ``form`` on its rows [M, 8] (or, gathered along the last
    dim, its columns): it travels in pieces of its sequence rows, each consumed
    as it lands."""
    world = group.size()
    x = integer_tensor(shard_shape, torch.float32, seed=rank)
    rows = x.numel() * world // 8
    w = integer_tensor((8 * (world if gather_dim == len(shard_shape) - 1 else 1), 5), torch.float32, seed=1)
    h = integer_tensor((rows, 6), torch.float32, seed=2)
    matmuls = {"rows": lambda g: g @ w, "rows_t": lambda g: g.t() @ h, "b_rows": lambda g: h.t() @ g}

    def program():
        g = all_gather(x, group, gather_dim)
        return g, matmuls[form](g.reshape(-1, w.shape[0]) if form == "rows" else g.reshape(rows, 8))

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {
        "ok": [torch.equal(a, b) for a, b in zip(got, expected)],
        "matmuls": counter.matmuls,
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "shard_shape,gather_dim,form",
    [
        ((1, 6, 8), 1, "rows"), ((1, 6, 8), 1, "rows_t"), ((1, 6, 8), 1, "b_rows"),
        ((1, 6, 8), 0, "rows"), ((1, 6, 8), 2, "rows"), ((1, 1, 6, 8), 1, "rows"),
    ],
    ids=["sp", "sp-rows_t", "sp-b_rows", "dim0", "last", "two-ones"],
)
def test_a_batch_of_one_travels_in_pieces(pool, world, shard_shape, gather_dim, form):
    """Pieces split a shard past its leading dims of size 1 (``piece_dim``):
    4 pieces of every peer's shard, each with its own matmul, bitwise equal."""
    for r in pool.run(with_small_pieces, world, _batch_of_one_worker, shard_shape, gather_dim, form):
        assert all(r["ok"]), r
        _assert_fused(r, calls=1, matmuls=1)
        assert r["p2p_ops"] > 2 * (world - 1), "the shards travelled in pieces"
        if world == 2:  # 4 pieces of 1, 2, 1 and 2 rows, those of 2 in 2 messages (Note [Wire pieces])
            assert r["p2p_ops"] == 2 * 6, r
        # This rank's shard whole, then one matmul a piece, or a message where
        # a consumer of gathered rows waited for the piece's first (Note [Wire
        # pieces]). Gathered along the last dim, the rows form contracts over
        # the gathered columns: it accumulates, so it keeps its pieces.
        by_message = world == 2 and form == "rows" and gather_dim < len(shard_shape) - 1
        assert 1 + (world - 1) * 4 <= r["matmuls"] <= 1 + (world - 1) * (6 if by_message else 4), r


@pytest.mark.parametrize("form", ["rows", "rows_t", "b_rows"])
def test_a_batch_of_one_on_symm_mem_counts_whole_shards(pool, form):
    """symm_mem hands over whole shards (torch's chunking): their rows are
    counted along the same ``piece_dim``, so the accumulating consumers see
    every row once."""
    for r in run_on("symm_mem", pool, _batch_of_one_worker, 2, (1, 6, 8), 1, form):
        assert all(r["ok"]), r
        _assert_fused(r, calls=1, matmuls=1, backend="symm_mem")
        assert r["matmuls"] == 2, r  # one a rank's shard


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shard_shape", [(5, 16), (3, 4, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_in_pieces(pool, world, shard_shape, bias):
    for r in pool.run(with_small_pieces, world, _linear_worker, shard_shape, bias, "f32"):
        assert torch.equal(r["got"], r["expected"])
        _assert_fused(r, calls=1, matmuls=1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shard_shape,gather_dim", [((3, 3, 8), 1), ((3, 3, 8), 2), ((3, 8), 1)], ids=["dim1", "last", "2d-last"])
def test_gather_dims_in_pieces(pool, world, shard_shape, gather_dim):
    for r in pool.run(with_small_pieces, world, _gather_dim_worker, shard_shape, gather_dim, True, "f32"):
        assert all(r["ok"]), r
        _assert_fused(r, calls=1, matmuls=1)


@pytest.mark.parametrize("world", WORLDS)
def test_contracting_consumers_in_pieces(pool, world):
    forms = ("rows", "rows_t", "b_rows")
    for r in pool.run(with_small_pieces, world, _contract_worker, forms, "f32"):
        assert all(r["ok"]), r
        _assert_fused(r, calls=1, matmuls=3)


def _unaligned_worker(rank, group, shape=(4, 8)):
    """A row view that merges two shard rows into one: pieces of a shard do not
    map to whole rows, so that consumer waits for the whole shard."""
    x = integer_tensor(shape, torch.float32, seed=rank)
    w = integer_tensor((16, 5), torch.float32, seed=1)
    expected = all_gather(x, group).view(-1, 16) @ w
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = all_gather(x, group).view(-1, 16) @ w
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shape", [(4, 8), (1, 4, 8)], ids=["2d", "batch-of-one"])
def test_consumer_rows_not_aligned_with_pieces_waits_for_the_shard(pool, world, shape):
    for r in pool.run(with_small_pieces, world, _unaligned_worker, shape):
        assert r["ok"]
        _assert_fused(r, calls=1, matmuls=1)
        assert r["p2p_ops"] > 2 * (world - 1), "the shard travelled in pieces"


def _mixed_pieces_worker(rank, group):
    """Rank 0 reads the gathered tensor early (the gather alone, no consumer),
    rank 1 fuses it: both send the same pieces, since the split depends on the
    shard's shape only (Invariant 2)."""
    x = integer_tensor((6, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 5), torch.float32, seed=1)
    expected = F.linear(all_gather(x, group), w.t())
    with EagerMicroPipeline() as pipe:
        g = all_gather(x, group)
        if rank == 0:
            g.sum()
        got = F.linear(g, w.t())
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats)}


def test_ranks_fusing_differently_in_pieces_interoperate(pool):
    r0, r1 = pool.run(with_small_pieces, 2, _mixed_pieces_worker, timeout=30)
    assert r0["ok"] and r1["ok"]
    assert r0["stats"] == {"unfused_all_gather": 1}
    assert r1["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}


# -- reduce-scatter and all-reduce in pieces (Note [Pieces]) ------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "in_shape,scatter_dim",
    [((8, 16), 0), ((4, 4, 8), 0), ((2, 8, 8), 1), ((4, 8, 8), 2)],
    ids=["2d", "3d", "dim1", "columns"],
)
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter_in_pieces(pool, world, in_shape, scatter_dim, reduce_op):
    """Each chunk produced, sent and added piece by piece; the same bits as
    plain eager. Scattering the columns makes the pieces from A's rows."""
    from test_matmul_reduce_scatter import _rs_worker

    args = (in_shape, 8, "f32", reduce_op, True, True, scatter_dim)
    for r in pool.run(with_small_pieces, world, _rs_worker, *args):
        assert torch.equal(r["got"], r["expected"])
        assert r["stats"] == {"matmul_reduce_scatter": 1}, r
        assert r["plain_reduce_scatters"] == 0
        assert r["p2p_ops"] > 2 * (world - 1), "the chunks travelled in pieces"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shape", [(8, 8), (2, 4, 8)], ids=["2d", "3d"])
@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max"])
@pytest.mark.parametrize("in_place", [False, True], ids=["funcol", "in_place"])
def test_matmul_all_reduce_in_pieces(pool, world, shape, reduce_op, in_place):
    """On 2 ranks the reduced pieces go out as each is added (Note
    [Interleaved all-reduce]); on 4 the ring's reduce-scatter, then its gather,
    in pieces. A sum of two products, with bias: the same bits as plain eager."""
    from test_all_reduce import _funcol_worker

    for r in pool.run(with_small_pieces, world, _funcol_worker, reduce_op, in_place, shape, True, True):
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_reduce": 1}, r
        assert r["plain_all_reduces"] == 0
        assert r["p2p_ops"] > 4 * (world - 1), "the chunks travelled in pieces"


def _all_reduce_then_matmul_worker(rank, group, read_early):
    """A matmul on the all-reduced tensor binds to its gather half and runs
    as the peers' reduced pieces land; with ``read_early`` this rank reads the
    result first instead (the gather alone): the same messages."""

    h = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 8), torch.float32, seed=100 + rank)
    w2 = integer_tensor((8, 4), torch.float32, seed=7)

    def program():
        y = all_reduce(h @ w, group)
        if read_early:
            y.sum()
        return y @ w2

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
def test_matmul_on_an_all_reduce_in_pieces(pool, world):
    results = pool.run(with_small_pieces, world, _all_reduce_then_matmul_worker, False)
    for r in results:
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_reduce": 1, "all_gather_matmul": 1, "fused_matmuls": 1}, r


def _mixed_all_reduce_worker(rank, group):
    return _all_reduce_then_matmul_worker(rank, group, read_early=rank == 0)


def test_ranks_reading_an_all_reduce_differently_in_pieces_interoperate(pool):
    r0, r1 = pool.run(with_small_pieces, 2, _mixed_all_reduce_worker, timeout=30)
    assert r0["ok"] and r1["ok"]
    assert r0["stats"] == {"matmul_all_reduce": 1}, r0
    assert r1["stats"] == {"matmul_all_reduce": 1, "all_gather_matmul": 1, "fused_matmuls": 1}, r1


def _unfused_collectives_worker(rank, group, in_place_all_reduce):
    """Collectives of tensors that are not pending products, 3-D: the ring's
    copy producer, whole or in pieces."""

    x = integer_tensor((4, 2, 8), torch.float32, seed=rank)

    def program():
        if in_place_all_reduce:
            y = x.clone()
            torch.ops._c10d_functional.all_reduce_(y, "sum", group.group_name)
            return torch.ops._c10d_functional.wait_tensor(y)
        return reduce_scatter(x, group, "sum", 0), all_reduce(x, group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": all(torch.equal(g, e) for g, e in zip(got, expected)), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("in_place", [False, True], ids=["funcol", "in_place"])
def test_unfused_collectives_copy_their_chunks(pool, world, pieces, in_place):
    if pieces:
        results = pool.run(with_small_pieces, world, _unfused_collectives_worker, in_place)
    else:
        results = pool.run(_unfused_collectives_worker, world, in_place)
    for r in results:
        assert r["ok"], r
        expected = {"unfused_all_reduce": 1} if in_place else {"unfused_reduce_scatter": 1, "unfused_all_reduce": 1}
        assert r["stats"] == expected, r
        assert r["p2p_ops"] > 0 and r["plain_reduce_scatters"] == 0, r


def _odd_view_worker(rank, group):
    """The all-reduced tensor's rows are half rows of the product (a [8, 6]
    output viewed as [16, 3]): a piece of a chunk is no whole product rows, so
    the producer makes the chunk and keeps the piece."""

    h = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 6), torch.float32, seed=100 + rank)

    def program():
        return all_reduce((h @ w).view(16, 3), group)

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter)}


def test_pieces_that_are_not_whole_product_rows(pool):
    for r in pool.run(with_small_pieces, 2, _odd_view_worker):
        assert r["ok"], r
        assert r["stats"] == {"matmul_all_reduce": 1}, r
        assert r["p2p_ops"] > 4, "the chunks travelled in pieces"
