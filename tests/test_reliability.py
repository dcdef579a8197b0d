"""Reliability: no hangs, nothing lost, clear errors, context rules.

Every test here talks between gloo ranks under the pool's time bounds: a hang
fails the test instead of stalling CI.
"""

from __future__ import annotations

import time

import pytest
import torch
from expecttest import assert_expected_inline
from helpers import all_gather, all_reduce, device_mesh, integer_tensor, left_in_cycles
from multirank import RankError, WorkerDied

from eagertp import EagerMicroPipeline, VerificationError


# -- mismatched collectives ----------------------------------------------------------


def _mismatch_worker(rank, group, verify, min_fuse_bytes=None):
    x = torch.ones(2 + rank, 4)  # rank r gathers 2 + r rows: a program bug
    try:
        with EagerMicroPipeline(verify=verify, min_fuse_bytes=min_fuse_bytes):
            y = all_gather(x, group) @ torch.ones(4, 3)
            y.sum()
    except VerificationError as e:
        return str(e)
    return "no error"


def test_verify_names_mismatched_shapes_on_every_rank(pool):
    messages = pool.run(_mismatch_worker, 2, True)
    assert messages[0] == messages[1]
    assert_expected_inline(
        messages[0],
        """eagertp verify: ranks of group '2' (2 ranks) issue different collectives at the same point (rank 0: all_gather of f32[2, 4]; rank 1: all_gather of f32[3, 4]). Every rank must issue the same collectives with the same shapes in the same order.""",
    )


@pytest.mark.parametrize("min_fuse_bytes", [64, 40], ids=["both_plain", "one_plain"])
def test_verify_names_mismatched_shapes_under_the_size_rule(pool, min_fuse_bytes):
    """Shards of 32 and 48 bytes: under the size rule on both ranks, or on rank 0
    only (so rank 0 issues it at once while rank 1 defers it). verify still
    stops both with the same message before any data moves."""
    messages = pool.run(_mismatch_worker, 2, True, min_fuse_bytes)
    assert messages[0] == messages[1]
    assert "(rank 0: all_gather of f32[2, 4]; rank 1: all_gather of f32[3, 4])" in messages[0], messages[0]


def _crash_worker(rank, group):
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def test_a_crashed_worker_fails_the_test_saying_how_and_where(pool):
    """Test infrastructure: a rank that crashes (here on purpose: a segfault
    it sends itself) fails the test at once, never run again into a pass, with
    how it ended, every thread's Python stack from faulthandler, and the jobs
    the pool ran before it, where memory corrupted by an earlier test would
    have come from."""
    start = time.monotonic()
    with pytest.raises(WorkerDied) as failed:
        pool.run(_crash_worker, 2, timeout=60)
    assert time.monotonic() - start < 20, "run once"
    message = str(failed.value)
    assert "rank 1: killed by SIGSEGV" in message, message
    assert "Fatal Python error: Segmentation fault" in message and "_crash_worker" in message, message
    assert "jobs since the pool started (" in message and "_crash_worker on 2 ranks" in message, message


def _hang_worker(rank, group):
    """Rank 0 waits for an event nothing sets: a hang no gloo timeout ends."""
    import threading

    if rank == 0:
        threading.Event().wait()
    return rank


def test_a_hung_job_fails_at_once_with_every_ranks_stacks(pool):
    """Test infrastructure: a job that outlives its timeout fails as a hang
    (TimeoutError, never run again), with every live rank's threads' stacks
    and the jobs the pool ran before it."""
    start = time.monotonic()
    with pytest.raises(TimeoutError) as hung:
        pool.run(_hang_worker, 2, timeout=3)
    assert time.monotonic() - start < 30, "run once, not again on a fresh pool"
    message = str(hung.value)
    assert "rank 0 did not finish within 3 s (hang)" in message, message
    assert "rank 0's faulthandler:" in message and "in _hang_worker" in message, message
    assert "jobs since the pool started (" in message and "_hang_worker on 2 ranks" in message, message


def _group_on_some_ranks_worker(rank, group):
    import torch.distributed as dist

    dist.new_group([0, 1])  # on ranks 0 and 1 only: the pool's other ranks never make it
    return rank


def test_a_job_that_makes_a_group_on_some_ranks_fails_by_name(pool):
    """Test infrastructure, Note [Groups made by jobs]: a job on 2 of the
    pool's ranks that makes a process group fails at once, naming the fix,
    instead of leaving a later job's group creation to hang."""
    with pytest.raises(RankError) as failed:
        pool.run(_group_on_some_ranks_worker, 2)
    message = str(failed.value)
    assert "groups made so far, by rank: [" in message, message
    assert "made process groups on some of the pool's 4 ranks only" in message, message
    assert "DeviceMesh.from_group(group, 'cpu')" in message, message
    assert pool.run(_group_on_some_ranks_worker, 4) == [0, 1, 2, 3], "on every rank: fine, and the pool is whole again"


def test_mismatched_shapes_without_verify_fail_like_plain_eager(pool):
    """Plain eager on gloo aborts the process ("Received data size doesn't match
    expected size"); eagertp's ring does the same, so a worker may die here on
    purpose. Never a silent result."""
    with pytest.raises((WorkerDied, RankError)):
        pool.run(_mismatch_worker, 2, False, timeout=40)


# -- schedule invariance ---------------------------------------------------------------


def _flush_on_one_rank_worker(rank, group):
    x = integer_tensor((4, 8), torch.float32, seed=rank)
    w1 = integer_tensor((8, 6), torch.float32, seed=1)
    w2 = integer_tensor((6, 8), torch.float32, seed=2 + rank)
    from helpers import reduce_scatter

    def program(pipe=None):
        h = all_gather(x, group) @ w1
        if pipe is not None and rank == 0:
            pipe.flush()  # only rank 0 flushes here
        y = torch.relu(h) @ w2
        if pipe is not None and rank == 1:
            pipe.flush()  # only rank 1 flushes here
        return reduce_scatter(y, group)

    expected = program()
    with EagerMicroPipeline() as pipe:
        got = program(pipe)
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats)}


def test_ranks_flushing_at_different_points_interoperate(pool):
    r0, r1 = pool.run(_flush_on_one_rank_worker, 2, timeout=30)
    assert r0["ok"] and r1["ok"]
    assert r0["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "matmul_reduce_scatter": 1}
    # rank 1's flush issued the second matmul alone before its reduce-scatter
    assert r1["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "unfused_reduce_scatter": 1}


# -- only what it owns -----------------------------------------------------------------


def _mesh_worker(rank, group):
    import torch.distributed as dist
    from helpers import OpCounter, reduce_scatter

    mesh = device_mesh((2, 2), ("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    x = integer_tensor((2, 8), torch.float32, seed=rank)
    w1 = integer_tensor((8, 6), torch.float32, seed=1)
    w2 = integer_tensor((6, 8), torch.float32, seed=2 + rank)
    param_shard = integer_tensor((3, 6), torch.float32, seed=3 + rank)

    def program():
        h = all_gather(x, tp) @ w1  # TP: fused
        full_param = all_gather(param_shard, dp)  # FSDP-style gather on dp: untouched
        grad = h.sum(0, keepdim=True)
        dist.all_reduce(grad, group=dp)  # dp all-reduce: untouched, in order
        y = reduce_scatter((h @ full_param.t()[:6, :6]) @ w2[:6], tp)  # TP: fused
        return y, grad

    expected = program()
    with OpCounter() as counter, EagerMicroPipeline(group=tp) as pipe:
        got = program()
    return {
        "ok": all(torch.equal(g, e) for g, e in zip(got, expected)),
        "stats": dict(pipe.stats),
        "collectives": counter.collectives,
        "explain": pipe.explain(),
    }


def test_two_by_two_mesh_fuses_tp_and_passes_dp_through_in_order(pool):
    for r in pool.run(_mesh_worker, 4):
        assert r["ok"]
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "matmul_reduce_scatter": 1}, r
        # The TP gather's ring, then the dp gather and all-reduce exactly as written,
        # then the TP reduce-scatter's ring: program order, each ring's receive
        # posted first (Note [Receives first] in eagertp.backends.ring).
        assert r["collectives"] == [
            "recv_", "send", "all_gather_into_tensor", "allreduce_", "recv_", "send"
        ], r["collectives"]


# -- context rules -----------------------------------------------------------------


def _context_worker(rank, group, context):
    import threading

    x = integer_tensor((2, 4), torch.float32, seed=rank)
    w = integer_tensor((4, 3), torch.float32, seed=5)
    expected = all_gather(x, group) @ w
    seen = {}
    if context == "nested":
        with EagerMicroPipeline() as outer:
            with EagerMicroPipeline() as inner:
                got = all_gather(x, group) @ w  # the inner block sees it first
            later = all_gather(x, group) @ w
        return {"ok": torch.equal(got, expected) and torch.equal(later, expected),
                "stats": [dict(inner.stats), dict(outer.stats)]}
    if context == "thread":
        def elsewhere():
            seen["other_thread"] = torch.equal(x @ torch.ones(4, 2), x.sum(1, keepdim=True).expand(2, 2))

        with EagerMicroPipeline() as pipe:
            g = all_gather(x, group)
            worker = threading.Thread(target=elsewhere)
            worker.start()
            worker.join()  # its matmul ran outside the mode: not deferred, not counted
            got = g @ w
        return {"ok": torch.equal(got, expected) and seen["other_thread"], "stats": [dict(pipe.stats)]}
    if context == "compile":
        @torch.compile(backend="eager")
        def head(a):
            return torch.relu(a @ w) + 1

        with EagerMicroPipeline() as pipe:
            got = head(all_gather(x, group))
        return {"ok": torch.equal(got, torch.relu(expected) + 1), "stats": [dict(pipe.stats)]}
    grad_mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[context]
    with grad_mode(), EagerMicroPipeline() as pipe:
        got = torch.matmul(all_gather(x, group), w)
    return {"ok": torch.equal(got, expected), "stats": [dict(pipe.stats)]}


FUSED_ONCE = {"all_gather_matmul": 1, "fused_matmuls": 1}


@pytest.mark.parametrize("context", ["nested", "thread", "no_grad", "inference_mode", "compile"])
def test_context_rules(pool, context):
    """nested: each block fuses what it sees first; thread: the mode is
    thread-local, another thread's ops pass untouched; no_grad/inference_mode:
    fused (inference_mode's whole aten.matmul is decomposed); compile: a
    torch.compile'd function inside the block runs and its matmul fuses."""
    for r in pool.run(_context_worker, 2, context, timeout=120):
        assert r["ok"], r
        assert all(stats == FUSED_ONCE for stats in r["stats"]), r


def _inference_products_worker(rank, group, form):
    """A product and the collective it feeds, as TP inference writes it, under
    ``inference_mode`` (where ``linear`` and ``matmul`` reach the mode whole)
    and under ``no_grad`` (where autograd's key decomposes them first)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from helpers import OpCounter, reduce_scatter

    x = integer_tensor((2, 4, 8), torch.float32, seed=rank)  # [B, S, K/W]: a row-parallel input
    w = integer_tensor((6, 8), torch.float32, seed=5)
    bias = integer_tensor((6,), torch.float32, seed=6)

    def program():
        if form == "linear + all_reduce":  # RowwiseParallel / HF "rowwise", as funcol
            return all_reduce(F.linear(x, w), group)
        if form == "linear + bias + raw all_reduce":  # Megatron-style, in place
            y = F.linear(x, w, bias)
            dist.all_reduce(y, group=group)
            return y
        if form == "matmul + reduce_scatter":  # sequence parallel: along S
            return reduce_scatter(torch.matmul(x, w.t()), group, scatter_dim=1)
        if form == "einsum + all_reduce":  # a linear written as einsum: a bmm of a batch of one
            return all_reduce(torch.einsum("bsk,nk->bsn", x, w), group)
        raise AssertionError(form)

    expected = program()
    report = {}
    for grad_mode in (torch.no_grad, torch.inference_mode):
        counter, pipe = OpCounter(), EagerMicroPipeline()
        with grad_mode(), counter, pipe:
            got = program()
        report[grad_mode.__name__] = {
            "ok": torch.equal(got, expected),
            "stats": dict(pipe.stats),
            "issued": [op for op in counter.collectives if op not in ("send", "recv_")],
        }
    return report


@pytest.mark.parametrize(
    "form, fused",
    [
        ("linear + all_reduce", "matmul_all_reduce"),
        ("linear + bias + raw all_reduce", "matmul_all_reduce"),
        ("matmul + reduce_scatter", "matmul_reduce_scatter"),
        ("einsum + all_reduce", "matmul_all_reduce"),
    ],
)
def test_inference_mode_fuses_products_into_their_collectives(pool, form, fused):
    """Under inference_mode a whole ``linear``, ``matmul`` or ``einsum`` reaches
    the mode when nothing is pending; decomposed, its mm or addmm defers as under
    no_grad, and the collective of its output fuses (TP inference, HF
    ``generate``). Bitwise equal, fused, and the collective never issued."""
    for r in pool.run(_inference_products_worker, 2, form):
        for grad_mode in ("no_grad", "inference_mode"):
            assert r[grad_mode] == {"ok": True, "stats": {fused: 1}, "issued": []}, (grad_mode, r)


def _inference_whole_linear_worker(rank, group, op):
    """A linear (or einsum) whose all-reduce the size rule issues as written
    (1 MiB here) runs whole under inference_mode, one op, as plain eager runs
    it; one that can fuse (``min_fuse_bytes=0``) is decomposed into its mm."""
    import torch.nn.functional as F
    from helpers import OpCounter

    x = integer_tensor((2, 4, 8), torch.float32, seed=rank)
    w = integer_tensor((6, 8), torch.float32, seed=5)

    def product():
        return F.linear(x, w) if op == "linear" else torch.einsum("bsk,nk->bsn", x, w)

    expected = all_reduce(product(), group)
    report = {}
    for min_fuse_bytes in (0, 1 << 20):
        counter, pipe = OpCounter(), EagerMicroPipeline(min_fuse_bytes=min_fuse_bytes)
        with torch.inference_mode(), counter, pipe:
            got = all_reduce(product(), group)
        report[min_fuse_bytes] = {
            "ok": torch.equal(got, expected),
            "stats": dict(pipe.stats),
            "whole": counter.counts[f"aten.{op}.default"],
            "matmuls": counter.matmuls,
        }
    return report


@pytest.mark.parametrize("op", ["linear", "einsum"])
def test_inference_mode_runs_a_linear_whole_where_nothing_could_fuse(pool, op):
    for r in pool.run(_inference_whole_linear_worker, 2, op):
        assert r[0] == {"ok": True, "stats": {"matmul_all_reduce": 1}, "whole": 0, "matmuls": 2}, r  # one per chunk
        assert r[1 << 20] == {"ok": True, "stats": {"unfused_all_reduce": 1}, "whole": 1, "matmuls": 0}, r


# -- nothing lost, nothing accumulates ---------------------------------------------------


def _long_run_worker(rank, group, steps):
    import gc
    import weakref

    import torch.nn.functional as F
    from helpers import reduce_scatter

    x0 = integer_tensor((2, 3, 8), torch.float32, seed=rank)
    w1 = integer_tensor((8, 8), torch.float32, seed=1).requires_grad_()
    w2 = integer_tensor((8, 8), torch.float32, seed=2 + rank).requires_grad_()

    def step(pipe):
        x = x0.clone().requires_grad_()
        with pipe:
            h = F.linear(all_gather(x, group, 1), w1)
            y = reduce_scatter(F.linear(torch.relu(h), w2), group, "sum", 1)
            # A matmul read whole: run at once from the second step on (Note [Deferrals that gained nothing]).
            z = torch.relu(x0.view(-1, 8) @ w2.detach())
            (y * y).sum().backward()
        w1.grad = w2.grad = None
        return y + z.sum()

    def live_objects() -> tuple[int, int]:
        gc.collect()
        objects = gc.get_objects()
        return len(objects), sum(isinstance(o, torch.Tensor) for o in objects)

    # poison=True: every placeholder starts as NaN; none may reach a result.
    pipe = EagerMicroPipeline(poison=True, max_records=64)
    nan_seen = False
    for _ in range(50):  # warm-up: caches, the bounded trace filling up
        nan_seen |= bool(step(pipe).isnan().any())
    before = live_objects()
    for _ in range(steps):
        nan_seen |= bool(step(pipe).isnan().any())
    after = live_objects()
    stats = dict(pipe.stats)

    # No reference cycle through the mode: dropping the last reference frees it
    # at once, without the cycle collector.
    gc.disable()
    try:
        ref = weakref.ref(pipe)
        del pipe
        freed = ref() is None
    finally:
        gc.enable()
    return {"before": before, "after": after, "nan_seen": nan_seen, "stats": stats, "freed": freed}


def test_thousands_of_steps_leave_no_growth_and_no_unfilled_placeholder(pool):
    for r in pool.run(_long_run_worker, 2, 2000, timeout=120):
        assert not r["nan_seen"], "a poisoned placeholder escaped"
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 3, "matmul_reduce_scatter": 2, "matmuls_run_at_once": 1}, r
        # NB: no growth; a few fewer objects is a cache of torch's evicting old
        # entries (seen after earlier tests warmed the workers differently).
        grew = [a > b for a, b in zip(r["after"], r["before"])]
        assert not any(grew), f"live (objects, tensors) grew: {r['before']} -> {r['after']}"
        assert r["freed"], "the pipeline is kept alive by a reference cycle"


# -- a dead or stuck peer ------------------------------------------------------------------


def _lost_peer_worker(rank, group, kind, fate, first=False):
    """The last rank of a group with SHORT_TIMEOUT issues nothing (``"returns"``:
    alive, but on to other work; ``"dies"``: its process exits); the others
    issue one collective and must raise a PeerError within the group's timeout.
    Unless ``first``, every rank has run a ring collective on the group before,
    so that the one that fails finds the ring's own connections made (Note
    [eagertp's own connections] in eagertp.backends.ring)."""
    import os
    import time

    from helpers import reduce_scatter
    from multirank import SHORT_GROUPS

    from eagertp import PeerError

    short = SHORT_GROUPS[group.size()]
    if not first:
        with EagerMicroPipeline(backend="ring"):
            (all_gather(integer_tensor((2, 4), torch.float32, seed=rank), short) @ torch.ones(4, 3)).sum()
    if rank == group.size() - 1:
        if fate == "dies":
            os._exit(0)
        return None
    x = integer_tensor((2, 4), torch.float32, seed=rank)
    w = integer_tensor((4, 3), torch.float32, seed=5)

    def fail() -> dict:
        start = time.monotonic()
        try:
            with EagerMicroPipeline():
                if kind == "all_gather_read":  # read inside the block
                    (all_gather(x, short) @ w).sum()
                elif kind == "all_gather_at_exit":  # pending until the block's exit flushes it
                    all_gather(x, short) @ w
                elif kind == "all_gather_watched":  # a matmul ran while it was in flight: a thread waits for it
                    ag = all_gather(x, short)
                    (w @ w.t()).sum()
                    (ag @ w).sum()
                elif kind == "all_reduce":  # 2 ranks: the interleaved halves
                    all_reduce(torch.ones(2 * group.size(), 3) @ w.t(), short)
                else:
                    reduce_scatter(torch.ones(2 * group.size(), 3) @ w.t(), short)
        except PeerError as e:
            return {"error": str(e), "elapsed": time.monotonic() - start, "group": short.group_name}
        return {"error": None, "elapsed": time.monotonic() - start}

    # NB: the failure (a helper thread's, raised on this one) keeps nothing of the
    # block in a reference cycle (Note [Failures handed between threads] in
    # eagertp.backends.base).
    result, left = left_in_cycles(fail)
    return {**result, "left_in_cycles": left}


@pytest.mark.parametrize(
    "kind, world, fate",
    [
        ("all_gather_at_exit", 2, "returns"),
        ("all_gather_read", 2, "dies"),
        ("all_gather_read", 3, "returns"),  # the helper-thread ring (gloo, > 2 ranks)
        ("all_gather_watched", 2, "returns"),  # Note [Landed gathers]: the watcher thread's wait fails
        ("reduce_scatter", 2, "returns"),
        ("all_reduce", 2, "dies"),
    ],
)
def test_a_lost_peer_raises_naming_it_within_the_group_timeout(pool, kind, world, fate):
    """Plain gloo raises too, but names neither the collective nor the peer;
    a pending gather fails at the block's exit the same way (no hang there)."""
    from multirank import SHORT_TIMEOUT

    try:
        results = pool.run(
            _lost_peer_worker, world, kind, fate, timeout=60, dying_ranks=frozenset({world - 1} if fate == "dies" else ())
        )
    finally:
        if fate != "dies":
            pool.restart()  # NB: a timed-out receive may still be posted in gloo
    assert results[-1] is None
    what = {
        "reduce_scatter": "reduce_scatter(sum) -> f32[2, 4]",
        "all_reduce": "all_reduce(sum) of f32[4, 4]",
    }.get(kind, "all_gather of f32[2, 4]")
    for rank, r in enumerate(results[:-1]):
        assert r["error"] is not None, f"rank {rank} did not raise"
        # the last rank's neighbour waits for it; in the 3-rank ring rank 1 waits for
        # rank 0, which forwards what it never got
        peer = world - 1 if rank == 0 else rank - 1
        assert r["error"].startswith(
            f"eagertp: {what} on group {r['group']!r} ({world} ranks): rank {rank} waited for rank {peer} "
            f"(global rank {peer}) and the transfer failed: "
        ), r["error"]
        assert "A peer died or stopped issuing collectives" in r["error"], r["error"]
        assert r["left_in_cycles"] == {}, r
        assert r["elapsed"] < SHORT_TIMEOUT.total_seconds() + 5, r
        if fate == "returns" and rank == 0:  # it waited on the silent rank itself
            assert "Timed out" in r["error"] and r["elapsed"] > SHORT_TIMEOUT.total_seconds() - 1, r
        # NB: gloo closes a pair whose receive timed out, so in the 3-rank ring rank 1
        # then fails with "Connection closed by peer" naming rank 0, at once.


@pytest.mark.parametrize("world, fate", [(2, "dies"), (3, "returns")])
def test_a_peer_lost_before_the_first_ring_collective_is_named(pool, world, fate):
    """The ring's own connections are made by every rank of the group at its
    first ring collective: a peer that never comes is named as in a transfer."""
    from multirank import SHORT_TIMEOUT

    try:
        results = pool.run(
            _lost_peer_worker, world, "all_gather_read", fate, True,
            timeout=60, dying_ranks=frozenset({world - 1} if fate == "dies" else ()),
        )
    finally:
        if fate != "dies":
            pool.restart()
    for rank, r in enumerate(results[:-1]):
        assert r["error"] is not None, f"rank {rank} did not raise"
        assert r["error"].startswith(
            f"eagertp: all_gather of f32[2, 4] on group {r['group']!r} ({world} ranks): rank {rank} waited for "
            f"rank {world - 1} (global rank {world - 1}) and the transfer failed: it did not come to set up "
            "eagertp's own connections over the group within 0:00:05"
        ), r["error"]
        assert SHORT_TIMEOUT.total_seconds() - 1 < r["elapsed"] < SHORT_TIMEOUT.total_seconds() + 5, r


def _transport_ends_worker(rank, group):
    import gc

    import torch.distributed as dist

    from eagertp.backends import ring

    def gloo_threads() -> int:
        import os

        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
        return sum(n.startswith(("gloo", "pt_gloo")) for n in names)

    before = gloo_threads()
    mine = dist.new_group(list(range(group.size())))  # every pool rank makes it (Note [Groups made by jobs])
    name = mine.group_name
    with EagerMicroPipeline(backend="ring"):
        y = all_gather(integer_tensor((4, 8), torch.float32, rank), mine) @ torch.ones(8, 2)
    made = (name, True) in ring._transports and ring._transports[name, True][1].own is not None
    with_transport = gloo_threads()
    dist.destroy_process_group(mine)
    del mine
    gc.collect()
    return {"made": made, "gone": (name, True) not in ring._transports, "threads": (before, with_transport, gloo_threads()),
            "sum": float(y.sum())}


def test_a_groups_transport_ends_with_the_group(pool):
    """Note [eagertp's own connections]: nothing of eagertp keeps gloo threads
    alive once the user destroys the group its ring ran on."""
    for r in pool.run(_transport_ends_worker, 4):
        before, with_transport, after = r["threads"]
        assert r["made"] and r["gone"], r
        assert with_transport > before and after == before, r
