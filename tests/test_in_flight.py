"""Gathers in flight: communication starts where the program issues it.

Each managed all-gather starts moving data at its program point; matmuls bind
to it later; a read completes only what it needs (Note [Deferral boundary]).
These tests pin the behaviours that the earlier one-pending-collective design
did not have: prefetches keep their overlap, several gathers are in flight at
once and complete in different orders on different ranks, one gather's read
leaves the others to their consumers.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from helpers import OpCounter, all_gather, all_reduce, fusion_report, integer_tensor
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on
from torch.utils._python_dispatch import TorchDispatchMode

from eagertp import EagerMicroPipeline

F32 = torch.float32


class _MatmulLog(TorchDispatchMode):
    """Entered outside the mode: the shapes of the matmuls eagertp runs, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
            self.shapes.append((*args[0].shape, args[1].shape[1]))
        return func(*args, **(kwargs or {}))


def _prefetch_worker(rank, group, consumer: bool, whole: bool = False, landed: str = "any"):
    """``ag = AG(x); z = a @ b; y = ag @ w``: plain eager's async gather hides
    behind ``a @ b``; eagertp must compute ``a @ b`` before waiting for the
    gather (Note [Work issued while a gather is in flight]). ``whole``: with
    Note [Landed gathers] on, as outside the tests; then ``landed`` says
    whether rank 0's gather has landed when ``y`` is read: "yes" (waited for
    after ``a @ b`` was read) or "no" (rank 1 issues its gather late)."""
    from eagertp import patterns

    patterns.WHOLE_WHEN_LANDED = whole
    try:
        return _prefetch(rank, group, consumer, landed)
    finally:
        patterns.WHOLE_WHEN_LANDED = False


def _prefetch(rank, group, consumer: bool, landed: str = "any"):
    import time

    x = integer_tensor((8, 16), F32, seed=rank)
    a, b, w = (integer_tensor(s, F32, seed=10 + i) for i, s in enumerate([(32, 24), (24, 40), (16, 8)]))
    gathered = torch.cat([integer_tensor((8, 16), F32, seed=r) for r in range(group.size())])
    log, counter = _MatmulLog(), OpCounter()
    landed_before_read = None
    with log, counter, EagerMicroPipeline(trace=True) as pipe:
        if landed == "no" and rank == 1:
            time.sleep(1.0)  # rank 0 reads y long before this rank's shard can reach it
        ag = all_gather(x, group)
        handle = pipe._engine.store.items[0].handle
        z = a @ b
        if landed != "any":
            z = z.clone()  # runs a @ b while the gather is in flight: it is watched from here
        if landed == "yes":
            deadline = time.monotonic() + 10
            while not handle.landed():
                assert time.monotonic() < deadline, "the watched gather never said it landed"
                time.sleep(0.001)
        landed_before_read = handle.landed()
        y = ag @ w if consumer else ag.cumsum(0)  # cumsum mixes rows: it reads the gather whole
        results = (z.clone(), y.clone())  # reads: z first, then the gather
        in_block = pipe.explain()
    expected = (a @ b, gathered @ w if consumer else gathered.cumsum(0))
    return {
        "trace": pipe.debug_string().splitlines()[-1],
        "ok": [torch.equal(g, e) for g, e in zip(results, expected)],
        "matmuls": log.shapes,
        "landed": landed_before_read,
        "explain": pipe.explain(),
        "in_block": in_block,
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_prefetched_gather_overlaps_the_matmul_issued_before_its_consumer(pool, backend):
    for r in run_on(backend, pool, _prefetch_worker, 2, True):
        assert all(r["ok"]), r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["plain_all_gathers"] == 0, r
        assert_moved_by(backend, r)
        # a @ b ([32, 24] @ [24, 40]) ran before the consumer's per-chunk matmuls ([8, 16] @ [16, 8]).
        assert r["matmuls"][0] == (32, 24, 40) and r["matmuls"][1:] == [(8, 16, 8)] * 2, r["matmuls"]


def test_prefetched_gather_on_gloo_that_landed_runs_its_consumer_whole(pool):
    """gloo's point-to-point Work says it completed only once waited for: a
    gather that matmul work overlaps is watched from then on, and once it has
    landed its consumer runs whole, one matmul (Note [Landed gathers])."""
    for r in pool.run(_prefetch_worker, 2, True, True, "yes"):
        assert all(r["ok"]), r
        assert r["landed"] is True, r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["matmuls"] == [(32, 24, 40), (16, 16, 8)], r["matmuls"]
        assert r["trace"] == "all_gather_matmul($0 -> $2, landed: whole) [ring]", r["trace"]


def test_prefetched_gather_on_gloo_still_in_flight_runs_its_consumer_by_chunk(pool):
    """The same program where rank 0's gather has not landed when its consumer
    binds (rank 1 issues its gather late): rank 0's own chunk is consumed at
    once, the peer's when it lands, as for a gather that nothing overlapped.
    Rank 1 finds rank 0's shard landed or not, as its watcher's timing goes;
    the messages are the same either way (Invariant 2)."""
    results = pool.run(_prefetch_worker, 2, True, True, "no")
    for r in results:
        assert all(r["ok"]), r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
    r = results[0]
    assert r["landed"] is False, r
    assert r["matmuls"] == [(32, 24, 40), (8, 16, 8), (8, 16, 8)], r["matmuls"]
    assert r["trace"] == "all_gather_matmul($0 -> $2) [ring]", r["trace"]


def test_gather_without_consumer_that_overlapped_a_matmul_is_not_counted_unfused(pool):
    results = pool.run(_prefetch_worker, 2, False)
    for r in results:
        assert all(r["ok"]), r
        assert r["stats"] == {"overlapped_all_gather": 1}, r
        assert r["plain_all_gathers"] == 0, r
    from expecttest import assert_expected_inline

    assert_expected_inline(results[0]["explain"], """all_gather #0 f32[8, 16] -> f32[16, 16] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten.cumsum.default read $0; 1 matmul ran while it was in flight""")
    assert_expected_inline(results[0]["in_block"], """all_gather #0 f32[8, 16] -> f32[16, 16] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten.cumsum.default read $0; 1 matmul ran while it was in flight""")


def _earlier_product_worker(rank, group, backend_name):
    """``z = a @ b`` (a weight gradient: nothing reads it until the step's
    end), then an all-reduce fused with its product, whose result the next op
    reads: ``z`` is computed while the all-reduce's gather half is in flight,
    before the read waits for it, not at the block's exit."""

    a, b = integer_tensor((32, 24), F32, seed=1), integer_tensor((24, 40), F32, seed=2)
    h, w = integer_tensor((8, 16), F32, seed=rank), integer_tensor((16, 6), F32, seed=10 + rank)
    v = integer_tensor((6, 4), F32, seed=3)

    def program():
        z = a @ b
        y = all_reduce(h @ w, group) + 1  # row by row: y @ v binds through it
        return z, (y @ v).clone()  # reads y @ v (only), inside the block

    expected = program()
    log, counter = _MatmulLog(), OpCounter()
    with log, counter, EagerMicroPipeline(backend=backend_name) as pipe:
        got = program()
    return {"ok": [torch.equal(g, e) for g, e in zip(got, expected)], "matmuls": log.shapes, **fusion_report(pipe, counter)}


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_products_pending_from_before_a_gather_run_while_it_is_in_flight(pool, backend):
    for r in run_on(backend, pool, _earlier_product_worker, 2, "auto"):
        assert all(r["ok"]), r
        assert r["stats"] == {"matmul_all_reduce": 1, "rowwise_ops": 1, "all_gather_matmul": 1, "fused_matmuls": 1}, r
        # The all-reduce's producer (h @ w, by chunk), then z = a @ b while its
        # gather half is in flight, then (y + 1) @ v chunk by chunk at the
        # read. (Kept pending instead, z would be computed at the block's exit, last.)
        assert r["matmuls"][-3:] == [(32, 24, 40), (4, 6, 4), (4, 6, 4)], r["matmuls"]
        assert all(shape[1:] == (16, 6) for shape in r["matmuls"][:-3]), r["matmuls"]


def _two_in_flight_worker(rank, group, read_second_first: bool):
    """Two gathers in flight with their consumers bound; ranks complete them in
    opposite orders (even ranks the second first), which the messages must
    allow (Invariant 2)."""
    world = group.size()
    xs = [integer_tensor((4, 8), F32, seed=100 * i + rank) for i in range(2)]
    ws = [integer_tensor((8, 6), F32, seed=7 + i) for i in range(2)]
    expected = [torch.cat([integer_tensor((4, 8), F32, seed=100 * i + r) for r in range(world)]) @ ws[i] for i in range(2)]
    counter = OpCounter()
    with counter, EagerMicroPipeline(trace=True) as pipe:
        ys = [all_gather(x, group) for x in xs]
        in_flight = pipe.explain()
        in_flight_summary = pipe.explain(summary=True)
        ys = [y @ w for y, w in zip(ys, ws)]
        order = [1, 0] if read_second_first and rank % 2 == 0 else [0, 1]
        got = {i: ys[i].clone() for i in order}
    return {
        "ok": [torch.equal(got[i], expected[i]) for i in range(2)],
        "in_flight": in_flight,
        "in_flight_summary": in_flight_summary,
        "summary": pipe.explain(summary=True),
        "trace": pipe.debug_string(),
        **fusion_report(pipe, counter),
    }


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_gathers_in_flight_complete_in_any_order_on_each_rank(pool, backend, world):
    results = run_on(backend, pool, _two_in_flight_worker, world, True)
    for r in results:
        assert all(r["ok"]), r
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 2}, r
        assert r["plain_all_gathers"] == 0, r
        assert_moved_by(backend, r)
    # Even ranks waited for the second gather first, odd ranks for the first.
    assert results[0]["trace"].index("all_gather_matmul($1") < results[0]["trace"].index("all_gather_matmul($0")
    assert results[1]["trace"].index("all_gather_matmul($0") < results[1]["trace"].index("all_gather_matmul($1")
    # explain() inside the block, before anything bound or read them.
    lines = results[0]["in_flight"].splitlines()
    assert [line.split(" f32")[0] for line in lines] == ["all_gather #0", "all_gather #1"], lines
    assert all(line.endswith(f"({world} ranks): in flight [{backend}]") for line in lines), lines
    # explain(summary=True): the same, counted by outcome.
    assert results[0]["in_flight_summary"] == (
        "2 collectives on managed groups: 0 fused, 0 not fused, 2 in flight\n     2 x all_gather in flight"
    ), results[0]["in_flight_summary"]
    assert results[0]["summary"] == (
        f"2 collectives on managed groups: 2 fused, 0 not fused\n     2 x all_gather fused [{backend}]"
    ), results[0]["summary"]


def _read_leaves_other_gather_worker(rank, group):
    """The activation-checkpointing shape: a gather in flight with no consumer
    yet (a backward gather) while another gather's consumers are read (the
    recomputation): the first stays in flight and fuses with its later matmuls."""
    world = group.size()
    x1, x2 = integer_tensor((4, 8), F32, seed=rank), integer_tensor((4, 8), F32, seed=50 + rank)
    w1, w2 = integer_tensor((8, 6), F32, seed=1), integer_tensor((8, 6), F32, seed=2)
    g1 = torch.cat([integer_tensor((4, 8), F32, seed=r) for r in range(world)])
    g2 = torch.cat([integer_tensor((4, 8), F32, seed=50 + r) for r in range(world)])
    counter = OpCounter()
    with counter, EagerMicroPipeline() as pipe:
        ag1 = all_gather(x1, group)
        ag2 = all_gather(x2, group)
        r2 = (ag2 @ w2).relu()  # completes the second gather only
        r1 = (ag1 @ w1).relu()
    return {"ok": torch.equal(r1, (g1 @ w1).relu()) and torch.equal(r2, (g2 @ w2).relu()), **fusion_report(pipe, counter)}


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_reading_one_gather_leaves_the_other_in_flight_for_its_consumers(pool, backend):
    for r in run_on(backend, pool, _read_leaves_other_gather_worker, 2):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 2, "fused_matmuls": 2}, r
        assert r["plain_all_gathers"] == 0, r


# How a program may overwrite a shard right after gathering it: every kind of
# write the mode sees (Note [Sends from the shard] in eagertp.engine).
_SHARD_WRITES = {
    "in place": lambda x, group: x.add_(100),
    "out=": lambda x, group: torch.mul(x, 3, out=x),
    "foreach": lambda x, group: torch._foreach_add_([x], 100),
    "copy_": lambda x, group: x.copy_(torch.zeros_like(x)),
    "in-place collective": lambda x, group: torch.distributed.all_reduce(x, group=group),
}


class _LateReadingGather:
    """The reference gather, reading its shard only when released or
    consumed: a write that the engine let through without releasing the
    shard first changes the result, every time (on the ring it is a race)."""

    def __init__(self, shard, ag_out, group) -> None:
        self._shard, self._ag_out, self._group = shard, ag_out, group
        self._copy = None
        self.releases = 0

    def release_shard(self) -> None:
        self.releases += 1
        if self._copy is None:
            self._copy = self._shard.clone()

    def wait_chunk(self, src) -> None:
        raise AssertionError("no scale gathers here")

    def landed(self):
        return False

    def watch(self) -> None:
        pass

    def consume(self, consumer, *, own_chunk_unread=False) -> None:
        from eagertp.backends.base import consume_in_order
        from eagertp.backends.reference import all_gather_single

        shard = self._shard if self._copy is None else self._copy
        all_gather_single(self._ag_out, shard, group=self._group)
        consume_in_order(consumer, self._ag_out.view(self._group.size(), *shard.shape))


def _overwritten_shard_worker(rank, group, backend="auto", write="in place"):
    """The gather reads its shard where the program issued it: overwriting the
    shard afterwards changes nothing. The ring sends from the shard itself, so
    the write first waits for those sends; the gather stays fused."""
    from eagertp.backends.reference import ReferenceBackend

    x = integer_tensor((4, 8), F32, seed=rank)
    w = integer_tensor((8, 6), F32, seed=3)
    expected = torch.cat([integer_tensor((4, 8), F32, seed=r) for r in range(group.size())]) @ w
    handles = []

    class LateReading(ReferenceBackend):
        def start_all_gather(self, shard, ag_out, group):
            handles.append(_LateReadingGather(shard, ag_out, group))
            return handles[-1]

    pipe = EagerMicroPipeline(backend=backend if backend != "late" else "reference", trace=True)
    if backend == "late":
        pipe._engine.backend._instances["reference"] = LateReading()
    with pipe:
        ag = all_gather(x, group)
        _SHARD_WRITES[write](x, group)
        y = (ag @ w).clone()
    return {
        "ok": torch.equal(y, expected),
        "stats": dict(pipe.stats),
        "waits": [e for e in pipe.debug_string().splitlines() if "wrote the shard" in e],
        "releases": [h.releases for h in handles],
    }


@pytest.mark.parametrize("world", [2, 4])  # 4 ranks on gloo: the ring on its helper thread
@pytest.mark.parametrize("backend", [*BOTH_BACKENDS, "reference"])
def test_overwriting_the_shard_after_the_gather_started_changes_nothing(pool, backend, world):
    if backend == "reference":
        results = pool.run(_overwritten_shard_worker, world, "reference")
    else:
        results = run_on(backend, pool, _overwritten_shard_worker, world)
    for r in results:
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["waits"] == ["wait: aten.add_.Tensor wrote the shard of $0: its sends complete first"], r


@pytest.mark.parametrize("write", list(_SHARD_WRITES))
def test_every_write_to_a_shard_in_flight_waits_for_its_sends(pool, write):
    """A backend that reads the shard late: each kind of write must release it
    first, once, and leave the gather fused."""
    for r in pool.run(_overwritten_shard_worker, 2, "late", write):
        assert r["ok"], r
        assert r["releases"][0] == 1, r  # (the in-place collective's gather half is another)
        assert r["stats"]["all_gather_matmul"] == 1, r
        assert len(r["waits"]) == 1, r


def _in_place_collective_on_an_input_worker(rank, group, how: str):
    """``dist.all_reduce(w)`` while a pending consumer reads ``w``: the
    consumer runs first, on the ``w`` the program gave it, whether eagertp
    leaves the all-reduce alone (``how``: its group is not managed), issues
    it as written (the size rule) or runs it on the ring. (c10d's in-place
    collectives do not declare their writes in their schemas.)"""
    import torch.distributed as dist
    from multirank import OTHER_GROUPS

    x = integer_tensor((4, 8), F32, seed=rank)
    w = integer_tensor((8, 6), F32, seed=3)
    expected = torch.cat([integer_tensor((4, 8), F32, seed=r) for r in range(group.size())]) @ w
    options = {
        "unmanaged": {"group": group},
        "as written": {"min_fuse_bytes": {"all_gather": 0, "all_reduce": 1 << 30}},
        "ring": {"min_fuse_bytes": 0},
    }[how]
    with EagerMicroPipeline(**options, trace=True) as pipe:
        y = all_gather(x, group) @ w
        dist.all_reduce(w, group=OTHER_GROUPS[group.size()])
        y = y.clone()
    return {
        "ok": [torch.equal(y, expected), torch.equal(w, integer_tensor((8, 6), F32, seed=3) * group.size())],
        "stats": dict(pipe.stats),
        "waits": [e for e in pipe.debug_string().splitlines() if e.startswith("wait")],
    }


@pytest.mark.parametrize("how", ["unmanaged", "as written", "ring"])
def test_an_in_place_collective_on_an_input_of_pending_work_completes_it_first(pool, how):
    for r in pool.run(_in_place_collective_on_an_input_worker, 2, how):
        assert all(r["ok"]), r
        assert r["stats"]["all_gather_matmul"] == 1, r
        assert r["stats"].get("unfused_all_reduce", 0) == (how != "unmanaged"), r
        # Only the consumer that reads w: Note [Every write is seen] in eagertp.engine.
        assert r["waits"][0] == "wait: c10d.allreduce_.default writes what $1 reads", r


def _landed_worker(rank, group):
    """Every chunk landed before the consumers bind (the transfer hidden behind
    other work): the matmuls run on the whole tensors, one call each (Note
    [Landed gathers]). On the reference backend: gloo's point-to-point Work
    says it completed only once waited for, so the ring cannot tell."""
    import time

    from eagertp import patterns

    world = group.size()
    x = integer_tensor((4, 8), F32, seed=rank)
    w, h = integer_tensor((8, 6), F32, seed=3), integer_tensor((4 * world, 5), F32, seed=4)
    gathered = torch.cat([integer_tensor((4, 8), F32, seed=r) for r in range(world)])
    log = _MatmulLog()
    patterns.WHOLE_WHEN_LANDED = True
    try:
        with log, EagerMicroPipeline(backend="reference", trace=True) as pipe:
            ag = all_gather(x, group)
            handle = pipe._engine.store.items[0].handle
            deadline = time.monotonic() + 10
            while not handle.landed():
                assert time.monotonic() < deadline, "the gather never landed"
                time.sleep(0.001)
            y, dw = ag @ w, ag.t() @ h  # forward and a weight gradient
            got = (y.clone(), dw.clone())
    finally:
        patterns.WHOLE_WHEN_LANDED = False
    return {
        "ok": torch.equal(got[0], gathered @ w) and torch.equal(got[1], gathered.t() @ h),
        "matmuls": log.shapes,
        "trace": pipe.debug_string().splitlines()[-1],
        "stats": dict(pipe.stats),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_landed_gather_runs_its_matmuls_whole(pool, world):
    for r in pool.run(_landed_worker, world):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 2}, r
        assert r["matmuls"] == [(4 * world, 8, 6), (8, 4 * world, 5)], r["matmuls"]
        assert r["trace"] == "all_gather_matmul($0 -> $1, $2, landed: whole) [reference]", r["trace"]


class _FakeWork:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _fake_receives(*done: bool, on_cpu: bool):
    from eagertp.backends.ring import _Receives

    works = [_FakeWork(d) for d in done]
    return works, _Receives([(w, 1) for w in works], "test", None, on_cpu=on_cpu)


def test_ring_landed_asks_every_receive_off_the_cpu():
    """NCCL's Work answers ``is_completed`` from its CUDA event: the 2-rank ring
    asks each receive (no GPU here: a meta buffer stands for the device).
    gloo's point-to-point Work cannot tell until it is waited for."""
    from eagertp.backends.ring import _P2PGather

    gather = _P2PGather.__new__(_P2PGather)
    gather._chunks, gather._rest, gather._per_receive = torch.empty(2, 4, device="meta"), [], True
    works, gather._recvs = _fake_receives(True, False, on_cpu=False)
    assert gather.landed() is False
    works[1].done = True
    assert gather.landed() is True
    gather._chunks = torch.empty(2, 4)
    _, gather._recvs = _fake_receives(True, True, on_cpu=True)
    assert gather.landed() is None, "gloo's point-to-point Work cannot tell"


def test_interleaved_all_reduce_landed_asks_the_reduced_pieces_off_the_cpu():
    """The 2-rank all-reduce's gather half has landed when the peer's reduced
    pieces have (no GPU here: a meta buffer stands for the device)."""
    from eagertp.backends.ring import _InterleavedAllReduce

    handle = _InterleavedAllReduce.__new__(_InterleavedAllReduce)
    works, handle._reduced = _fake_receives(True, False, on_cpu=False)
    assert handle.landed() is False
    works[1].done = True
    assert handle.landed() is True
    _, handle._reduced = _fake_receives(True, True, on_cpu=True)
    assert handle.landed() is None


class _BlockingWork:
    """A receive that lands when the test says so, or fails."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> bool:
        assert self.arrived.wait(10), "the test never let this receive land"
        if self.error is not None:
            raise self.error
        return True


def test_watched_receives_say_which_landed_and_hand_on_a_failure():
    """Once watched, a thread waits for the receives in order: ``landed`` turns
    True when the last one has, ``wait(i)`` returns as receive i lands, and a
    failed receive is raised on the consuming thread, for it and every later one."""
    from eagertp.backends.ring import _Receives

    works = [_BlockingWork() for _ in range(3)]
    receives = _Receives([(w, 1) for w in works], "test", None, on_cpu=True)
    assert receives.landed() is None, "not watched: gloo cannot tell"
    receives.watch()
    receives.watch()  # once only
    assert receives.landed() is False
    works[0].arrived.set()
    receives.wait(0)
    assert receives.landed() is False
    works[1].error = ValueError("the peer is gone")
    works[1].arrived.set()
    for i in (1, 2):
        with pytest.raises(ValueError, match="the peer is gone"):
            receives.wait(i)
    receives.wait(0)  # landed before the failure
    assert receives.landed() is False

    works = [_BlockingWork() for _ in range(2)]
    receives = _Receives([(w, 1) for w in works], "test", None, on_cpu=True)
    works[0].arrived.set()
    receives.wait(0)  # waited for here, before the watch
    receives.watch()
    works[1].arrived.set()
    receives.wait(1)
    assert receives.landed() is True


class _ShardCopies(TorchDispatchMode):
    """Entered outside the mode: how many times eagertp copies ``shard`` (into
    this rank's chunk of a gathered tensor)."""

    def __init__(self, shard: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.count = shard.data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[1].data_ptr() == self.ptr:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _own_chunk_worker(rank, group, how: str):
    """``AG(x) @ w`` where the program keeps the gathered tensor or not: this
    rank's chunk of it is copied from the shard only if something can still
    read it (Note [This rank's chunk, unread] in eagertp.engine)."""
    x = integer_tensor((8, 16), F32, seed=rank)
    w = integer_tensor((16, 8), F32, seed=10)
    gathered = torch.cat([integer_tensor((8, 16), F32, seed=r) for r in range(group.size())])
    copies = _ShardCopies(x)
    seen = None
    with copies, EagerMicroPipeline(poison=True) as pipe:
        if how == "dropped":
            y = all_gather(x, group) @ w
        elif how == "kept":
            ag = all_gather(x, group)
            y = ag @ w
        elif how == "view kept in inference mode":
            with torch.inference_mode():
                ag = all_gather(x, group)
                kept = ag.view(2, -1, 16)  # holds no base in inference mode: only its storage tells
                y = ag @ w
                del ag
        else:  # "saved for backward"
            w.requires_grad_(True)
            y = all_gather(x, group) @ w
        got = y.clone()
        if how == "kept":
            seen = ag.clone()
        elif how == "view kept in inference mode":
            seen = kept.reshape(-1, 16).clone()
    ok = torch.equal(got, gathered @ w) and (seen is None or torch.equal(seen, gathered))
    if how == "saved for backward":
        y.backward(torch.ones_like(y))  # w.grad = AG(x).t() @ 1: reads the saved gathered tensor
        ok = ok and torch.equal(w.grad, gathered.t() @ torch.ones_like(y))
    return {"ok": ok, "copies": copies.count, "stats": dict(pipe.stats)}


@pytest.mark.parametrize("how", ["dropped", "kept", "view kept in inference mode", "saved for backward"])
def test_own_chunk_is_copied_only_if_something_can_read_it(pool, how):
    for r in pool.run(_own_chunk_worker, 2, how):
        assert r["ok"], r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}, r
        assert r["copies"] == (0 if how == "dropped" else 1), r


def _watcher_threads_worker(rank, group):
    """Prefetches whose gathers are watched, block after block."""
    import os
    import time

    x = integer_tensor((8, 16), F32, seed=rank)
    a, w = integer_tensor((32, 16), F32, seed=10), integer_tensor((16, 8), F32, seed=11)

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    pipe = EagerMicroPipeline()
    for _ in range(20):
        with pipe:
            ag = all_gather(x, group)
            (a @ w).sum()  # matmul work while the gather is in flight: watched
            (ag @ w).sum()
    deadline = time.monotonic() + 5
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)  # a watcher may still be returning from its last wait
    return {"before": before, "after": threads(), "stats": dict(pipe.stats)}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_watcher_threads_end_with_their_gathers(pool):
    for r in pool.run(_watcher_threads_worker, 2):
        # (a @ w) ran at once after the first block (Note [Deferrals that gained nothing]).
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "matmuls_run_at_once": 1}, r
        assert r["after"] <= r["before"], r
