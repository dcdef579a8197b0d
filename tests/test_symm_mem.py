"""The symm_mem backend on CPU, over torch's own symmetric-memory code.

The backend's gathers, torch's pipelined reduce-scatter and its workspace are
Python over a small CUDA surface; ``symm_mem_emulation`` provides that surface
across the test's worker processes (shared-memory buffers, gloo barriers,
in-order streams whose races it checks), so the backend's buffers, streams,
events, barriers, callbacks, gather/scatter dims and local reduction run for
real: through the mode, and called directly with gathers in flight (started,
then consumed in any order). Selected by ``-k symm_mem``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from expecttest import assert_expected_inline
from helpers import OpCounter, all_gather, fusion_report, integer_tensor, reduce_scatter
from symm_mem_emulation import emulated_symm_mem, with_cpu_symm_mem

from eagertp import EagerMicroPipeline
from eagertp.backends import symm_mem
from eagertp.backends.base import OrderedConsumer
from eagertp.backends.symm_mem import SymmMemBackend


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


def _stream_log_worker(rank, group, contraction):
    """The stream schedule of a fused gather: a plain column-parallel matmul
    (each chunk's rows) or a weight gradient contracting the gathered rows (one
    accumulator): both consume on the current stream, each chunk behind its
    event."""
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
def test_symm_mem_consumers_wait_for_their_chunk_on_the_current_stream(pool, contraction):
    """Note [Gathers in flight on the comm stream] in eagertp/backends/symm_mem.py."""
    results = pool.run(_stream_log_worker, 4, contraction)
    for r in results:
        assert r["ok"] and r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["log"] == results[0]["log"], "every rank's schedule is the same"
    assert_expected_inline("\n".join(results[0]["log"]), """\
current records e0
comm waits current
record_stream on comm
comm barrier 2 timeout 20000 ms
comm records e1
comm records e2
comm records e3
comm barrier 2 timeout 20000 ms
current waits e0
current waits e1
current waits e2
current waits e3""")


# The backend called directly, as the engine does: gathers started at their
# program point, consumed later, in any order (the GatherHandle contract).


def _shards(world: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Every rank's shard, as each rank makes its own."""
    return [integer_tensor(shape, torch.float32, seed=seed + r) for r in range(world)]


def _rows_into(y: torch.Tensor, w: torch.Tensor, shard_rows: int):
    """A column-parallel matmul's consumer: y[rows of src] = chunk @ w."""

    def consume(piece, src, rows):
        start = src * shard_rows
        torch.mm(piece, w, out=y[start + rows.start : start + rows.stop])

    return consume


def _accumulate_into(acc: torch.Tensor, h: torch.Tensor, shard_rows: int) -> OrderedConsumer:
    """A weight gradient's consumer: acc += chunk.t() @ h[rows of src]."""

    def consume(piece, src, rows):
        start = src * shard_rows
        acc.addmm_(piece.t(), h[start + rows.start : start + rows.stop])

    return OrderedConsumer(consume)


def _two_in_flight_worker(rank, group):
    """Two gathers started, then consumed in opposite orders on even and odd
    ranks; the second is bigger, so the workspace grows while the first is in
    flight."""
    world = group.size()
    firsts, seconds = _shards(world, (2, 8), seed=0), _shards(world, (3, 8), seed=100)
    w = integer_tensor((8, 4), torch.float32, seed=7)
    h = integer_tensor((3 * world, 5), torch.float32, seed=8)
    g1, g2 = torch.cat(firsts), torch.cat(seconds)
    y, acc = torch.empty(2 * world, 4), torch.zeros(8, 5)
    with emulated_symm_mem() as streams:
        symm_mem.WORKSPACE_MIN_BYTES = 1  # each gather grows it (restored by emulated_symm_mem)
        ag1, ag2 = torch.empty_like(g1), torch.empty_like(g2)
        backend = SymmMemBackend()
        first = backend.start_all_gather(firsts[rank], ag1, group)
        second = backend.start_all_gather(seconds[rank], ag2, group)
        order = [(first, _rows_into(y, w, 2)), (second, _accumulate_into(acc, h, 3))]
        for handle, consumer in order if rank % 2 == 0 else reversed(order):
            handle.consume(consumer)
    return {
        "ok": [torch.equal(ag1, g1), torch.equal(ag2, g2), torch.equal(y, g1 @ w), torch.equal(acc, g2.t() @ h)],
        "log": streams.log,
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_symm_mem_gathers_in_flight_consumed_in_any_order(pool, world):
    results = pool.run(with_cpu_symm_mem, world, _two_in_flight_worker)
    for r in results:
        assert all(r["ok"]), r
    if world == 2:  # every start enqueues its whole transfer; the consumers wait for their chunk only
        assert_expected_inline("\n".join(results[0]["log"]), """\
current records e0
comm waits current
record_stream on comm
host waits comm
comm barrier 2 timeout 20000 ms
comm records e1
comm barrier 2 timeout 20000 ms
current records e2
comm waits current
record_stream on comm
host waits comm
comm barrier 2 timeout 20000 ms
comm records e3
comm barrier 2 timeout 20000 ms
current waits e0
current waits e1
current waits e2
current waits e3""")
        # rank 1 consumes the second first
        assert_expected_inline("\n".join(results[1]["log"][-4:]), """\
current waits e2
current waits e3
current waits e0
current waits e1""")


def _overwritten_shard_worker(rank, group):
    world = group.size()
    shards = _shards(world, (2, 8), seed=20)
    with emulated_symm_mem():
        ag = torch.empty(2 * world, 8)
        shard = shards[rank].clone()
        handle = SymmMemBackend().start_all_gather(shard, ag, group)
        shard.fill_(-9)  # the caller's buffer is free as soon as the gather has started
        handle.consume(None)
    return torch.equal(ag, torch.cat(shards))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_symm_mem_gather_takes_the_shard_at_its_start(pool, world):
    assert all(pool.run(with_cpu_symm_mem, world, _overwritten_shard_worker))


def _other_stream_worker(rank, group, skip_own_event):
    """Consumed on another stream than the one that started it (a user
    stream, say): this rank's own chunk, copied at the start, is waited for too.
    Without that event the race check must say so."""
    world = group.size()
    shards = _shards(world, (2, 8), seed=60)
    w = integer_tensor((8, 3), torch.float32, seed=9)
    y = torch.empty(2 * world, 3)
    with emulated_symm_mem():
        backend = SymmMemBackend()
        backend.start_all_gather(shards[rank], torch.empty(2 * world, 8), group).consume(None)  # makes the comm stream
        other = torch.cuda.Stream()
        handle = backend.start_all_gather(shards[rank], torch.empty(2 * world, 8), group)
        if skip_own_event:
            handle.arrivals[0] = (rank, None)
        try:
            with other:
                handle.consume(_rows_into(y, w, 2))
        except AssertionError as e:
            return str(e)
        torch.cuda.current_stream().wait_stream(other)
    return torch.equal(y, torch.cat(shards) @ w)


def test_symm_mem_consumed_on_another_stream(pool):
    assert pool.run(with_cpu_symm_mem, 2, _other_stream_worker, False) == [True, True]
    message, other = pool.run(with_cpu_symm_mem, 2, _other_stream_worker, True)
    assert message == other
    assert_expected_inline(message, """stream race: aten.mm.out reads on the stream2 stream bytes that aten.copy_.default wrote on the current stream, with no wait between them""")


def _scatter_between_worker(rank, group, skip_wait):
    """A gather in flight, a reduce-scatter, then the gather consumed. With
    ``skip_wait`` the reduce-scatter does not wait for the gathers in flight:
    the race check must say so (its writes to the workspace that the peers'
    comm streams may still read)."""
    from eagertp.backends import symm_mem

    world = group.size()
    shards = _shards(world, (4, 8), seed=30)  # 128 bytes: the reduce-scatter needs no bigger workspace
    inputs = _shards(world, (2 * world, 8), seed=40)  # rank i's input to reduce-scatter
    w = integer_tensor((8, 3), torch.float32, seed=9)
    y, out = torch.empty(4 * world, 3), torch.empty(2, 8)

    def producer(dst, buf, rows):  # symm_mem asks for whole chunks (rows: every row)
        buf.copy_(inputs[rank][2 * dst : 2 * dst + 2][rows])

    saved = symm_mem._wait_for_gathers
    if skip_wait:
        symm_mem._wait_for_gathers = lambda stream, group, device: None
    try:
        with emulated_symm_mem():
            backend = SymmMemBackend()
            ag = torch.empty(4 * world, 8)
            handle = backend.start_all_gather(shards[rank], ag, group)
            backend.produce_reduce_scatter(producer, out, group, "sum")
            handle.consume(_rows_into(y, w, 4))
    except AssertionError as e:
        return str(e)
    finally:
        symm_mem._wait_for_gathers = saved
    g = torch.cat(shards)
    expected = sum(x[2 * rank : 2 * rank + 2] for x in inputs)
    return [torch.equal(ag, g), torch.equal(y, g @ w), torch.equal(out, expected)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_symm_mem_reduce_scatter_between_start_and_consume(pool, world):
    for r in pool.run(with_cpu_symm_mem, world, _scatter_between_worker, False):
        assert r == [True, True, True], r


def test_symm_mem_race_check_catches_a_reduce_scatter_over_gathers_in_flight(pool):
    message, other = pool.run(with_cpu_symm_mem, 2, _scatter_between_worker, True)
    assert message == other
    assert_expected_inline(message, """stream race: aten.copy_.default writes on the backend stream bytes that aten.copy_.default wrote on the comm stream, with no wait between them""")


def _unwaited_consumer_worker(rank, group):
    """A consume that skips its chunks' events (they are swapped for events
    never recorded): the race check must catch the consumer reading a chunk
    the comm stream writes."""
    world = group.size()
    shards = _shards(world, (2, 8), seed=50)
    w = integer_tensor((8, 3), torch.float32, seed=9)
    with emulated_symm_mem() as streams:
        handle = SymmMemBackend().start_all_gather(shards[rank], torch.empty(2 * world, 8), group)
        handle.arrivals = [(src, streams.event()) for src, _ in handle.arrivals]
        try:
            handle.consume(_rows_into(torch.empty(2 * world, 3), w, 2))
        except AssertionError as e:
            return str(e)
    return None


def test_symm_mem_race_check_catches_a_consumer_that_skips_its_event(pool):
    message, other = pool.run(with_cpu_symm_mem, 2, _unwaited_consumer_worker)
    assert message == other
    assert_expected_inline(message, """stream race: aten.mm.out reads on the current stream bytes that aten.copy_.default wrote on the comm stream, with no wait between them""")


def _unsynchronized_growth_worker(rank, group):
    """The workspace grown while a gather still uses it, without the host wait
    (Note [Workspace growth]): the emulation must catch the free."""
    from eagertp.backends import symm_mem

    world = group.size()
    saved = symm_mem._workspace
    symm_mem._workspace = lambda group, nbytes, stream: symm_mem._symm_mem_module().get_symm_mem_workspace(
        group.group_name, min_size=nbytes
    )
    try:
        with emulated_symm_mem():
            backend = SymmMemBackend()
            backend.start_all_gather(_shards(world, (2, 8), seed=0)[rank], torch.empty(2 * world, 8), group)
            backend.start_all_gather(_shards(world, (4, 8), seed=0)[rank], torch.empty(4 * world, 8), group)
    except AssertionError as e:
        return str(e)
    finally:
        symm_mem._workspace = saved
    return None


def test_symm_mem_emulation_catches_a_workspace_freed_in_use(pool):
    message, other = pool.run(with_cpu_symm_mem, 2, _unsynchronized_growth_worker)
    assert message == other
    assert_expected_inline(message, """the workspace of group '2' is freed while aten.copy_.default on the comm stream may still write it: the host never waited for that stream""")


def test_symm_mem_emulation_catches_memory_freed_while_another_stream_uses_it():
    """Note [Freed on one stream, used on another] in symm_mem_emulation.py:
    CUDA's caching allocator hands a freed block to the next allocation on
    the stream it was allocated on at once, unless that stream waited for the
    other streams that used it, or record_stream named them."""

    def free_while_written_on(comm_stream, make_safe):
        t = torch.empty(16)  # allocated on the current stream
        comm_stream.wait_stream(torch.cuda.current_stream())
        with comm_stream:
            t.fill_(1.0)
        make_safe(t)
        del t
        torch.empty(16)  # the next allocation: where CUDA would lend t's memory

    with emulated_symm_mem() as streams:
        comm = torch.cuda.Stream()
        with pytest.raises(AssertionError) as freed:
            free_while_written_on(comm, lambda t: None)
        free_while_written_on(comm, lambda t: streams.record_stream(t, comm))
        free_while_written_on(comm, lambda t: torch.cuda.current_stream().wait_stream(comm))
    assert_expected_inline(str(freed.value), """freed while in use: the program freed memory allocated on the current stream that aten.fill_.Scalar on the comm stream may still write, with no wait on the current stream and no record_stream(comm): CUDA's caching allocator may hand it to the next allocation on the current stream""")


def _gather_freed_unconsumed_worker(rank, group, recorded):
    """A gather's output freed before it is consumed (an exception between
    its start and its reader): its pulls on the comm stream may still write
    it, which the symm_mem backend tells the caching allocator with
    record_stream; ``recorded=False`` runs it as if it did not."""
    with emulated_symm_mem():
        if not recorded:
            symm_mem._record_stream = lambda t, stream: None  # NB: the emulation puts its own back on exit
        handle = SymmMemBackend().start_all_gather(_shards(group.size(), (2, 8), 0)[rank], torch.empty(4, 8), group)
        del handle
        try:
            torch.empty(4, 8)
        except AssertionError as e:
            return str(e)
    return None


def test_symm_mem_gather_output_freed_unconsumed_is_recorded_on_the_comm_stream(pool):
    assert pool.run(_gather_freed_unconsumed_worker, 2, True) == [None, None]
    for message in pool.run(_gather_freed_unconsumed_worker, 2, False):
        assert message is not None and message.startswith("freed while in use: ") and "on the comm stream" in message, message


def _unclosed_gather_worker(rank, group):
    """Gathers without their closing barrier: the next one overwrites this
    rank's buffer while a peer may still pull from it. No op of this process
    races with another of its own; the race check sees it through the peers'
    accesses, mirrored (Note [Peers, mirrored] in symm_mem_emulation.py)."""
    import symm_mem_emulation
    from eagertp.backends import symm_mem

    world = group.size()
    saved = symm_mem_emulation._Handle.barrier
    calls = []

    def opening_only(handle, channel=0, timeout_ms=0):
        calls.append(channel)
        if channel != symm_mem._COMM_CHANNEL or calls.count(channel) % 2 == 1:
            saved(handle, channel, timeout_ms)

    symm_mem_emulation._Handle.barrier = opening_only
    try:
        with emulated_symm_mem():
            backend = SymmMemBackend()
            for seed in (0, 10):
                backend.start_all_gather(_shards(world, (2, 8), seed)[rank], torch.empty(2 * world, 8), group)
    except AssertionError as e:
        return str(e)
    finally:
        symm_mem_emulation._Handle.barrier = saved
    return None


def test_symm_mem_race_check_sees_the_peers_reads(pool):
    message, other = pool.run(with_cpu_symm_mem, 2, _unclosed_gather_worker)
    assert message == other
    assert_expected_inline(message, """stream race: aten.copy_.default writes on the comm stream bytes that aten.copy_.default (by a peer) read on the peers' comm stream, with no wait between them""")


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
    symm_mem.WORKSPACE_MIN_BYTES = 1  # restored by emulated_symm_mem
    with EagerMicroPipeline(backend="symm_mem"):
        all_gather(x, group) @ torch.ones(4, 3)  # sizes the workspace (32 bytes)
    torch.cuda.is_current_stream_capturing = lambda: True  # restored by emulated_symm_mem
    try:
        with EagerMicroPipeline(backend="symm_mem"):
            all_gather(torch.cat([x, x, x, x]), group) @ torch.ones(4, 3)  # needs 128
    except RuntimeError as e:
        return str(e)
    return None


def test_symm_mem_surfaces_torch_errors_with_the_collective_named(pool):
    msg = pool.run(with_cpu_symm_mem, 2, _workspace_error_worker)[0]
    assert_expected_inline(msg, """eagertp symm_mem backend, all_gather of f32[8, 4] on group '2' (2 ranks): get_symm_mem_workspace(): the requested size (128 bytes) is greater than the size of the currently allocated workspace (32 bytes). It's currently not possible to expand the workspace size during graph capture. Please invoke `get_symm_mem_workspace(group_name="2", min_size="128")` before initiating the graph capture and try again.""")


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
    assert_expected_inline(r0["explain"], """all_gather #0 f32[2, 4] -> f32[4, 4] on group '2' (2 ranks): fused with mm -> $1 [ring; symm_mem unavailable: its workspace on group '2' (2 ranks): rendezvous failed on rank 0: no peer access between the devices]""")
    assert_expected_inline(r0["error"], """EagerMicroPipeline(backend='symm_mem') cannot serve this collective: its workspace on group '2' (2 ranks): rendezvous failed on rank 0: no peer access between the devices. Use backend='ring' (any process group) or backend='auto' (symm_mem where it works).""")


def _mismatched_barrier_worker(rank, group):
    """Rank 1 meets its peer at another channel's barrier: on CUDA neither
    signal wait would ever be answered (a hang; with timeout_ms, a trap), so
    the emulation fails both ranks at once instead (Note [Barriers time out]
    in eagertp.backends.symm_mem)."""
    import torch.distributed._symmetric_memory as torch_symm_mem

    with emulated_symm_mem():
        workspace = torch_symm_mem.get_symm_mem_workspace(group.group_name, min_size=64)
        workspace.barrier(channel=2, timeout_ms=1000)  # agreed: passes
        try:
            workspace.barrier(channel=2 if rank == 0 else 0, timeout_ms=1000)
        except RuntimeError as e:
            return str(e)
    return None


def test_symm_mem_emulation_fails_ranks_at_different_barriers(pool):
    message, other = pool.run(_mismatched_barrier_worker, 2)
    assert message == other
    assert_expected_inline(message, """emulated symmetric memory: ranks meet at different barriers (channel, barrier number on it, workspace bytes): rank 0: [2, 2, 64]; rank 1: [0, 1, 64]. On CUDA their signal waits would never match: a hang, then a trap after 1000 ms""")


def _growing_shapes_worker(rank, group):
    """Gathers whose shards grow a row at a time (sequence lengths that vary):
    the workspace grows at least twofold (Note [Workspace growth]), so ten new
    maxima cost five growths, each a host wait, not ten."""
    world = group.size()
    with emulated_symm_mem() as streams:
        symm_mem.WORKSPACE_MIN_BYTES = 1  # restored by emulated_symm_mem
        backend = SymmMemBackend()
        for rows in range(1, 11):  # shards of 32 * rows bytes
            shards = _shards(world, (rows, 8), seed=rows)
            ag = torch.empty(rows * world, 8)
            backend.start_all_gather(shards[rank], ag, group).consume(None)
            assert torch.equal(ag, torch.cat(shards))
        held = torch.distributed._symmetric_memory._group_name_to_workspace_tensor[group.group_name]
        return {"growths": streams.log.count("host waits comm"), "bytes": held.numel()}


def test_symm_mem_workspace_grows_geometrically(pool):
    for r in pool.run(with_cpu_symm_mem, 2, _growing_shapes_worker):
        assert r == {"growths": 5, "bytes": 512}, r  # 32, 64, 128, 256, 512


def _captured_worker(rank, group):
    """A block inside a CUDA graph capture (emulated: the capture checks that
    every stream forked from the captured one is joined back, Note [Capture]
    in eagertp.backends.symm_mem). First a collective under capture on a group
    never probed: served by the ring, with the reason, and not cached. Then a
    warm-up outside capture (probes, sizes the workspace), then a captured
    block whose last collective is a gather, then growth after the capture,
    which keeps the captured workspace for replays."""
    x = integer_tensor((2, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 3), torch.float32, seed=5)
    with emulated_symm_mem() as streams:
        symm_mem.WORKSPACE_MIN_BYTES = 1  # restored by emulated_symm_mem
        streams.begin_capture()
        with EagerMicroPipeline() as pipe:
            unprobed = all_gather(x, group) @ w
        streams.end_capture()
        first = pipe.explain()
        with EagerMicroPipeline() as pipe:  # the warm-up: probes now
            expected = all_gather(x, group) @ w
        warm = pipe.explain()
        streams.begin_capture()
        try:
            with EagerMicroPipeline() as pipe:
                got = all_gather(x, group) @ w
            streams.end_capture()
        except AssertionError as e:
            return {"error": str(e)}
        captured = torch.distributed._symmetric_memory._group_name_to_workspace_tensor[group.group_name]
        with EagerMicroPipeline():  # grows the workspace
            all_gather(torch.cat([x] * 4), group) @ w
        return {
            "equal": [torch.equal(unprobed, expected), torch.equal(got, expected)],
            "explain": [first, warm, pipe.explain()],
            "kept": any(t is captured for t in symm_mem._kept_after_capture),
        }


def test_symm_mem_under_cuda_graph_capture(pool):
    for r in pool.run(with_cpu_symm_mem, 2, _captured_worker):
        assert "error" not in r, r["error"]
        assert all(r["equal"]), r
        first, warm, captured = r["explain"]
        assert "[ring; symm_mem unavailable: " in first and "ran under CUDA graph capture" in first, first
        assert warm.endswith("[symm_mem]") and captured.endswith("[symm_mem]"), r["explain"]
        assert r["kept"], r


def _partial_probe_failure_worker(rank, group, how):
    """Only rank 1 cannot set symmetric memory up: its allocation fails, or it
    runs on another host. Every rank agrees on the ring, with rank 1's reason;
    none waits for a rendezvous its peer never joins (Note [Probing a group]
    in eagertp.backends.symm_mem)."""
    import socket
    from unittest import mock

    import torch.distributed._symmetric_memory as torch_symm_mem

    x = integer_tensor((2, 4), torch.float32, seed=rank)
    w = integer_tensor((4, 3), torch.float32, seed=1)
    with emulated_symm_mem():

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("CUDA out of memory")

        patches = {
            "allocation": mock.patch.object(torch_symm_mem._SymmetricMemory, "empty_strided_p2p", out_of_memory),
            "host": mock.patch.object(socket, "gethostname", lambda: "another-host"),
        }
        with patches[how] if rank == 1 else contextlib.nullcontext(), EagerMicroPipeline() as pipe:
            y = all_gather(x, group) @ w
    return {"ok": torch.equal(y, torch.cat([integer_tensor((2, 4), torch.float32, seed=r) for r in range(2)]) @ w),
            "explain": pipe.explain()}


@pytest.mark.parametrize("how", ["allocation", "host"])
def test_symm_mem_probe_failing_on_one_rank_sends_every_rank_to_the_ring(pool, how):
    r0, r1 = pool.run(_partial_probe_failure_worker, 2, how, timeout=30)
    assert r0["ok"] and r1["ok"]
    assert r0["explain"] == r1["explain"], (r0["explain"], r1["explain"])
    why = {
        "allocation": "its workspace on group '2' (2 ranks): allocation failed on rank 1: CUDA out of memory",
        "host": "the ranks of group '2' (2 ranks) do not share one host and temp dir",
    }[how]
    assert f"[ring; symm_mem unavailable: {why}" in r0["explain"], r0["explain"]


def _define_test_symm_mem_op() -> None:
    """``symm_mem::eagertp_test_fill_(Tensor(a!) buf)``: stands in for torch's
    own symmetric-memory ops (CUDA-only), writing this rank's workspace
    buffer from the current stream; once per worker process."""
    from eagertp.collectives.torch_symm_mem import register_torch_symm_mem_ops

    if not hasattr(torch.ops.symm_mem, "eagertp_test_fill_"):
        lib = torch.library.Library("symm_mem", "FRAGMENT")
        lib.define("eagertp_test_fill_(Tensor(a!) buf) -> ()")
        lib.impl("eagertp_test_fill_", _fill_sevens, "CPU")
        _LIBRARIES.append(lib)  # NB: the definition lives as long as the library object
        register_torch_symm_mem_ops()


_LIBRARIES: list = []


def _fill_sevens(buf: torch.Tensor) -> None:
    buf.fill_(7)


def _torch_op_after_gather_worker(rank, group):
    """torch's own symm_mem op writes this rank's workspace right after a
    gather was consumed, while its closing barrier (and so the peers' pulls
    from this buffer) may still run on the comm stream: it must wait for the
    comm stream first (Note [torch's symmetric-memory ops])."""
    import torch.distributed._symmetric_memory as torch_symm_mem

    _define_test_symm_mem_op()
    world = group.size()
    x = integer_tensor((2, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 3), torch.float32, seed=5)
    with emulated_symm_mem():
        try:
            with EagerMicroPipeline(backend="symm_mem") as pipe:
                y = all_gather(x, group) @ w
                total = y.sum()  # consumed: every chunk pulled here, peers maybe not yet
                workspace = torch_symm_mem.get_symm_mem_workspace(group.group_name, min_size=64)
                torch.ops.symm_mem.eagertp_test_fill_(workspace.get_buffer(group.rank(), (2, 8), torch.float32))
        except AssertionError as e:
            return str(e)
    expected = torch.cat([integer_tensor((2, 8), torch.float32, seed=r) for r in range(world)]) @ w
    return {"ok": torch.equal(total, expected.sum()), "stats": dict(pipe.stats)}


def test_torch_symm_mem_ops_wait_for_gathers_in_flight(pool):
    for r in pool.run(_torch_op_after_gather_worker, 2):
        assert isinstance(r, dict), r
        assert r["ok"] and r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
