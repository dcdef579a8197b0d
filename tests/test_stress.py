"""The ring's threads: one at a time on a group of eagertp's own, and a
stress of many steps, every result checked.

Four ranks on gloo: each step starts three all-gathers (the ring over more than
2 ranks forwards on a helper thread), runs a matmul of its own while they are
in flight, consumes them, and ends with a matmul + reduce-scatter and a matmul
+ all-reduce, every chunk in pieces. Each rank draws every rank's inputs from
seeds, so it checks each step's results against plain matmuls of the full
tensors, bitwise (small integers), with no communication of its own.

Bounded at about STRESS_SECONDS (30 s) of steps. For a long manual run, under
glibc's checking allocator::

    LD_PRELOAD=libc_malloc_debug.so.0 \\
    GLIBC_TUNABLES=glibc.malloc.check=3:glibc.malloc.perturb=165 \\
    EAGERTP_STRESS_SECONDS=1800 python -m pytest tests/test_stress.py
"""

from __future__ import annotations

import os
import time

import torch
from helpers import GroupOpCounter, OpCounter, all_gather, all_reduce, integer_tensor, reduce_scatter, with_small_pieces

from eagertp import EagerMicroPipeline

STRESS_SECONDS = float(os.environ.get("EAGERTP_STRESS_SECONDS", "30"))
GATHERS = ((8, 16, 12), (6, 16, 20), (4, 8, 8))  # (rows per rank, K, N) of each gathered matmul


def _inputs(step: int, world: int):
    """Every rank's inputs of ``step`` (each rank draws them all alike)."""
    seed = 1000 * step
    shards = [[integer_tensor((m, k), torch.float32, seed + 10 * r + i) for r in range(world)]
              for i, (m, k, _) in enumerate(GATHERS)]
    weights = [integer_tensor((k, n), torch.float32, seed + 100 + i) for i, (_, k, n) in enumerate(GATHERS)]
    h = [integer_tensor((4 * world, 8), torch.float32, seed + 200 + r) for r in range(world)]
    w_out = integer_tensor((8, 12), torch.float32, seed + 300)
    return shards, weights, h, w_out


def _all_go_on(go_on: bool, group) -> bool:
    """Whether every rank goes on to another step (ranks reach the deadline
    at different steps; each must run the same collectives)."""
    import torch.distributed as dist

    flag = torch.tensor([int(go_on)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _stress_worker(rank, group, seconds):
    world = group.size()
    deadline = time.monotonic() + seconds
    steps, wrong = 0, []
    counter = OpCounter()
    pipe = EagerMicroPipeline(backend="ring")
    while _all_go_on(steps < 5 or time.monotonic() < deadline, group):
        shards, weights, h, w_out = _inputs(steps, world)
        with counter, pipe:
            gathered = [all_gather(s[rank], group) for s in shards]  # three in flight
            own = h[rank] @ h[rank].t()  # the program's own work meanwhile
            ys = [ag @ w for ag, w in zip(gathered, weights)]
            scattered = reduce_scatter(h[rank] @ w_out, group)
            reduced = all_reduce(h[rank] @ w_out, group)
            results = [y.clone() for y in ys] + [scattered.clone(), reduced.clone(), own.clone()]
        full = sum(hr @ w_out for hr in h)
        expected = [torch.cat(s) @ w for s, w in zip(shards, weights)]
        expected += [full.chunk(world)[rank], full, h[rank] @ h[rank].t()]
        if not all(torch.equal(got, want) for got, want in zip(results, expected)):
            wrong.append(steps)
        stats = dict(pipe.stats)
        # NB: the clone of the all-reduced tensor is a row-wise step on its gather half.
        want = {"all_gather_matmul": 3, "fused_matmuls": 3, "matmul_reduce_scatter": 1, "matmul_all_reduce": 1}
        if stats != {**want, "rowwise_ops": 1}:
            wrong.append((steps, stats))
        steps += 1
    return {"steps": steps, "wrong": wrong[:10], "p2p": counter.p2p, "unfused": counter.unfused_all_gathers}


def test_the_rings_threads_under_stress_give_every_step_right(pool):
    results = pool.run(with_small_pieces, 4, _stress_worker, STRESS_SECONDS, timeout=STRESS_SECONDS + 60)
    for rank, r in enumerate(results):
        assert r["wrong"] == [], f"rank {rank}: steps with wrong results or unfused collectives: {r['wrong']}"
        assert r["steps"] >= 5 and r["p2p"] > 0 and r["unfused"] == 0, r
    print(f"stress: {results[0]['steps']} steps in {STRESS_SECONDS:.0f} s, every result right on every rank")


class _OnePostAtATime:
    """Stands in for a transport's gloo group: records which threads posted,
    and how many were inside a post at once (each post lingers a little, so
    that two unordered posts would overlap)."""

    def __init__(self, group) -> None:
        import threading

        self._group = group
        self._guard = threading.Lock()
        self.inside = self.most_inside = 0
        self.threads: set[int] = set()

    def _post(self, method, tensors, peer, tag):
        import threading

        with self._guard:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.threads.add(threading.get_ident())
        time.sleep(0.002)
        try:
            return method(tensors, peer, tag)
        finally:
            with self._guard:
                self.inside -= 1

    def send(self, tensors, peer, tag):
        return self._post(self._group.send, tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        return self._post(self._group.recv, tensors, peer, tag)


def _one_thread_worker(rank, group):
    from eagertp.backends import ring

    counter = GroupOpCounter()
    with counter, EagerMicroPipeline(backend="ring"):  # the group's transport, made collectively
        (all_gather(integer_tensor((4, 8), torch.float32, rank), group) @ torch.ones(8, 2)).sum()
    transport = ring.transport_of(group, torch.device("cpu"), "the test")
    own = transport.own
    assert own is not None and transport.target is own and own is not group and own.group_name == ring.own_group_name(group.group_name)
    watched = transport.target = _OnePostAtATime(own)
    try:
        with counter, EagerMicroPipeline(backend="ring"):
            gathered = [all_gather(integer_tensor((8, 8), torch.float32, rank + i), group) for i in range(3)]
            for _ in range(3):  # the helpers forward while this thread multiplies
                torch.ones(64, 64) @ torch.ones(64, 64)
            total = sum((ag @ torch.ones(8, 2)).sum() for ag in gathered)
            total += reduce_scatter(torch.ones(8, 4) @ torch.ones(4, 4), group).sum()
    finally:
        transport.target = own
    posted = {op: n for (g, op), n in counter.by_group.items() if g == group.group_name and op in ("send", "recv_")}
    on_own = sum(n for (g, op), n in counter.by_group.items() if g == own.group_name)
    return {"most_inside": watched.most_inside, "threads": len(watched.threads),
            "users_group": posted, "own_group": on_own, "total": float(total)}


def test_the_ring_posts_on_its_own_group_one_thread_at_a_time(pool):
    """Note [eagertp's own connections]: the ring's helper threads and the
    program's thread all post, one at a time, on eagertp's own group."""
    results = pool.run(_one_thread_worker, 4)
    for rank, r in enumerate(results):
        assert r["most_inside"] == 1, f"rank {rank}: {r['most_inside']} threads posted at once"
        assert r["threads"] >= 2, f"rank {rank}: the helper threads posted too: {r}"
        assert r["users_group"] == {} and r["own_group"] > 0, f"rank {rank}: the ring posted on the user's group: {r}"
