"""The symm_mem backend on CPU, running torch's own symmetric-memory code.

torch's pipelined primitives and workspace are Python over a small CUDA
surface; ``symm_mem_emulation`` provides that surface across the test's worker
processes (shared-memory buffers, gloo barriers, in-order streams), so the
backend's argument order, buffers, callbacks, gather/scatter dims and local
reduction run inside torch's real chunk schedule. Selected by ``-k symm_mem``.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from helpers import OpCounter, all_gather, fusion_report, integer_tensor, reduce_scatter
from symm_mem_emulation import emulated_symm_mem, with_cpu_symm_mem

from eagertp import EagerMicroPipeline


def _mlp_worker(rank, group, gather_dim, reduce_op):
    import torch.nn.functional as F

    x = integer_tensor((2, 3, 8), torch.float32, seed=rank)
    w1 = integer_tensor((6, 8), torch.float32, seed=1)
    b1 = integer_tensor((6,), torch.float32, seed=2)
    w2 = integer_tensor((8, 6), torch.float32, seed=3 + rank)

    def program():
        g = all_gather(x, group, gather_dim)
        h = F.linear(g, w1, b1)
        wgrad = g.reshape(-1, 8).t() @ h.reshape(-1, 6)  # contraction over the gathered rows
        y = reduce_scatter(F.linear(torch.relu(h), w2), group, reduce_op, gather_dim)
        return y, wgrad

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(backend="symm_mem") as pipe:
        got = program()
    return {
        "ok": [torch.equal(g, e) for g, e in zip(got, expected)],
        "explain": pipe.explain(),
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gather_dim", [0, 1], ids=["dim0", "dim1"])
@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max"])
def test_symm_mem_backend_fuses_both_directions(pool, world, gather_dim, reduce_op):
    results = pool.run(with_cpu_symm_mem, world, _mlp_worker, gather_dim, reduce_op)
    for r in results:
        assert all(r["ok"]), r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "matmul_reduce_scatter": 1}, r
        assert r["p2p_ops"] == 0, "symm_mem moves the data, not the ring"
    if world == 2 and gather_dim == 0 and reduce_op == "sum":
        assert_expected_inline(results[0]["explain"], """\
all_gather #0 f32[2, 3, 8] -> f32[4, 3, 8] on group '2' (2 ranks): fused with addmm -> $1 [symm_mem]
reduce_scatter(sum) #0 f32[4, 3, 8] -> f32[2, 3, 8] on group '2' (2 ranks): fused with mm -> $3 [symm_mem]""")


def _stream_order_worker(rank, group, contraction):
    """Which consumer calls wait for which: a plain column-parallel matmul
    (each chunk's rows: free to overlap on torch's two streams) or a weight
    gradient contracting the gathered rows (one accumulator: chained)."""
    x = integer_tensor((2, 8), torch.float32, seed=rank)
    h = integer_tensor((2 * group.size(), 4), torch.float32, seed=9)
    w = integer_tensor((8, 4), torch.float32, seed=10)

    def program():
        g = all_gather(x, group)
        return g.t() @ h if contraction else g @ w

    expected = program()
    with emulated_symm_mem() as streams, EagerMicroPipeline(backend="symm_mem") as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats), "log": streams.log}


@pytest.mark.parametrize("contraction", [False, True], ids=["rows", "contraction"])
def test_symm_mem_orders_accumulating_consumers_across_streams(pool, contraction):
    """Note [Consumers on two streams] in eagertp/backends/symm_mem.py."""
    results = pool.run(_stream_order_worker, 4, contraction)
    for r in results:
        assert r["ok"] and r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["log"] == results[0]["log"], "every rank's schedule is the same"
    if not contraction:
        assert results[0]["log"] == [], "consumers of disjoint rows are left to overlap"
    else:
        assert_expected_inline("\n".join(results[0]["log"]), """\
current records e0
backend waits e0
backend records e1
current waits e1
current records e2
backend waits e2
backend records e3""")


def _unordered_contraction_worker(rank, group):
    """The contraction with its calls left unordered, as before the fix: the
    emulation's race check must catch it (what makes its silence elsewhere mean
    something)."""
    from eagertp.backends import symm_mem as backend

    saved, backend._in_call_order = backend._in_call_order, lambda consumer: consumer
    try:
        _stream_order_worker(rank, group, contraction=True)
    except AssertionError as e:
        return str(e)
    finally:
        backend._in_call_order = saved
    return None


def test_symm_mem_race_check_catches_an_unordered_accumulation(pool):
    for message in pool.run(_unordered_contraction_worker, 2):
        assert_expected_inline(message, """stream race: aten.addmm_.default writes on the backend stream bytes that aten.zero_.default wrote on the current stream, with no wait between them""")


def _wide_rows_worker(rank, group):
    """The matmul sees the gathered rows two at a time ([W*4, 16] as [W*2, 32]):
    its consumer needs each rank's shard whole, and symm_mem hands this rank's
    own over before ag_out holds it."""
    x = integer_tensor((4, 16), torch.float32, seed=rank)
    w = integer_tensor((32, 8), torch.float32, seed=5)

    def program():
        return all_gather(x, group).reshape(-1, 32) @ w

    expected = program()
    with EagerMicroPipeline(backend="symm_mem") as pipe:
        got = program()
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats)}


@pytest.mark.parametrize("world", [2, 4])
def test_symm_mem_matmul_over_rows_spanning_shard_rows(pool, world):
    for r in pool.run(with_cpu_symm_mem, world, _wide_rows_worker):
        assert r["ok"] and r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r


@pytest.mark.parametrize("min_fuse_bytes", [0, 40], ids=["both_fused", "one_plain"])
def test_symm_mem_verify_names_mismatched_shapes_before_the_rendezvous(pool, min_fuse_bytes):
    """Rank 1 gathers 3 rows, rank 0 two (with 40, under the size rule on rank 0
    only): verify compares the ranks before symm_mem's first rendezvous on the
    group, itself a collective that they would not both reach."""
    from test_reliability import _mismatch_worker

    messages = pool.run(with_cpu_symm_mem, 2, _mismatch_worker, True, min_fuse_bytes)
    assert messages[0] == messages[1]
    assert "(rank 0: all_gather of f32[2, 4]; rank 1: all_gather of f32[3, 4])" in messages[0], messages[0]


def _cpu_tensors_worker(rank, group):
    try:
        with EagerMicroPipeline(backend="symm_mem"):
            all_gather(torch.ones(2, 4), group) @ torch.ones(4, 3)
    except ValueError as e:
        return str(e)
    return None


def test_symm_mem_backend_on_cpu_tensors_says_why_and_what_to_use(pool):
    msg, _ = pool.run(_cpu_tensors_worker, 2)
    assert_expected_inline(msg, """EagerMicroPipeline(backend='symm_mem') cannot serve this collective: symmetric memory needs CUDA tensors, this collective's are on cpu. Use backend='ring' (any process group) or backend='auto' (symm_mem where it works).""")


def _workspace_error_worker(rank, group):
    """torch's own error (the workspace cannot grow during CUDA graph capture)
    reaches the user with the collective named and torch's fix intact."""
    x = integer_tensor((2, 4), torch.float32, seed=rank)
    with EagerMicroPipeline(backend="symm_mem"):
        all_gather(x, group) @ torch.ones(4, 3)  # sizes the workspace (32 bytes, 64 emulated)
    torch.cuda.is_current_stream_capturing = lambda: True  # restored by emulated_symm_mem
    try:
        with EagerMicroPipeline(backend="symm_mem"):
            all_gather(torch.cat([x, x, x, x]), group) @ torch.ones(4, 3)  # needs 128
    except RuntimeError as e:
        return str(e)
    return None


def test_symm_mem_surfaces_torch_errors_with_the_collective_named(pool):
    msg = pool.run(with_cpu_symm_mem, 2, _workspace_error_worker)[0]
    assert_expected_inline(msg, """eagertp symm_mem backend, all_gather of f32[8, 4] on group '2' (2 ranks): get_symm_mem_workspace(): the requested size (128 bytes) is greater than the size of the currently allocated workspace (64 bytes). It's currently not possible to expand the workspace size during graph capture. Please invoke `get_symm_mem_workspace(group_name="2", min_size="128")` before initiating the graph capture and try again.""")


def _rendezvous_failure_worker(rank, group):
    from helpers import all_gather as gather

    x = integer_tensor((2, 4), torch.float32, seed=rank)
    w = integer_tensor((4, 3), torch.float32, seed=1)
    with EagerMicroPipeline() as auto:
        y = gather(x, group) @ w
    try:
        with EagerMicroPipeline(backend="symm_mem"):
            gather(x, group) @ w
        error = None
    except ValueError as e:
        error = str(e)
    return {"ok": torch.equal(y, gather(x, group) @ w), "explain": auto.explain(), "error": error}


def _with_failing_rendezvous(rank, group, worker):
    import torch.distributed._symmetric_memory as symm_mem

    def no_peer_access(tensor, group_name=None):
        raise RuntimeError("no peer access between the devices")

    with emulated_symm_mem():
        symm_mem._SymmetricMemory.rendezvous = no_peer_access  # the emulation's, gone on exit
        return worker(rank, group)


def test_symm_mem_rendezvous_failure_falls_back_to_the_ring_or_says_why(pool):
    """auto: the ring serves the group, and explain() says why; symm_mem: an error."""
    r0 = pool.run(_with_failing_rendezvous, 2, _rendezvous_failure_worker)[0]
    assert r0["ok"]
    assert_expected_inline(r0["explain"], """all_gather #0 f32[2, 4] -> f32[4, 4] on group '2' (2 ranks): fused with mm -> $1 [ring; symm_mem unavailable: its workspace rendezvous on group '2' (2 ranks) failed: no peer access between the devices]""")
    assert_expected_inline(r0["error"], """EagerMicroPipeline(backend='symm_mem') cannot serve this collective: its workspace rendezvous on group '2' (2 ranks) failed: no peer access between the devices. Use backend='ring' (any process group) or backend='auto' (symm_mem where it works).""")
