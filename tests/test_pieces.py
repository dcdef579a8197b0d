"""The ring's piecewise pipeline: a shard may travel in pieces and the consumers
run per piece. It is off by default (one piece, by measurement on CPU) and on
here through helpers.with_small_pieces (up to 4 pieces of any size); every
fusion form must still equal plain eager bitwise, including consumers whose
rows do not split along the pieces (they wait for the whole shard)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import OpCounter, all_gather, fusion_report, integer_tensor, with_small_pieces
from test_all_gather_matmul import _assert_fused, _contract_worker, _gather_dim_worker, _linear_worker

from eagertp import EagerMicroPipeline
from eagertp.backends.ring import piece_rows

WORLDS = [2, 4]


def test_piece_rows_depend_on_shape_only():
    split = {"max_pieces": 4, "min_bytes": 64 * 1024}
    assert piece_rows(torch.empty(1, 8), **split) == [slice(0, 1)]
    assert piece_rows(torch.empty(1024, 1024), **split) == [slice(0, 256), slice(256, 512), slice(512, 768), slice(768, 1024)]
    assert piece_rows(torch.empty(3, 8), **split) == [slice(0, 3)]  # 96 bytes: below the minimum piece
    assert piece_rows(torch.empty(1024, 1024)) == [slice(0, 1024)]  # the default: one piece


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


def _unaligned_worker(rank, group):
    """A row view that merges two shard rows into one: pieces of a shard do not
    map to whole rows, so that consumer waits for the whole shard."""
    x = integer_tensor((4, 8), torch.float32, seed=rank)
    w = integer_tensor((16, 5), torch.float32, seed=1)
    expected = all_gather(x, group).view(-1, 16) @ w
    with OpCounter() as counter, EagerMicroPipeline() as pipe:
        got = all_gather(x, group).view(-1, 16) @ w
    return {"ok": torch.equal(got, expected), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("world", WORLDS)
def test_consumer_rows_not_aligned_with_pieces_waits_for_the_shard(pool, world):
    for r in pool.run(with_small_pieces, world, _unaligned_worker):
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
