"""Communication the mode did not see (Note [Collectives the mode did not see]
in eagertp.unseen): a tensor subclass that issues a collective with dispatch
off, or another thread, on a group the pipeline manages, is named in
explain() and counted; what the mode does see (collectives, point-to-point
messages, eagertp's own traffic) never is."""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
from helpers import against_plain_eager, all_reduce, integer_tensor

from eagertp import EagerMicroPipeline


class _Hiding(torch.Tensor):
    """A subclass whose every op all-reduces its result over its group with
    dispatch off: the mode sees the op handed to it, never the all-reduce."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, group: dist.ProcessGroup):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        t.elem, t.group = elem, group
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        group = next(a.group for a in args if isinstance(a, _Hiding))
        out = func(*(a.elem if isinstance(a, _Hiding) else a for a in args), **(kwargs or {}))
        with torch._C._DisableTorchDispatch():
            dist.all_reduce(out, group=group)
        return out


def _subclass_worker(rank, group):
    x, z = (integer_tensor((8, 8), torch.float32, seed=s + rank) for s in (0, 10))
    w = integer_tensor((8, 8), torch.float32, seed=20)

    def program():
        a = all_reduce(x @ w, group)  # seen: the group is watched from here
        y = _Hiding(z.clone(), group) * 2  # all-reduced unseen
        return [a, y]

    return against_plain_eager(program)


def test_a_collective_a_subclass_issues_with_dispatch_off_is_named(pool):
    for r in pool.run(_subclass_worker, 2, timeout=60):
        assert all(r["equal"]), r
        assert r["stats"]["unseen_operations"] == 1 and r["stats"]["matmul_all_reduce"] == 1, r
        lines = r["explain"].splitlines()
        assert len(lines) == 2, r["explain"]
        assert lines[1].startswith("1 operation(s) on group "), lines
        assert "after the mode handed aten.mul.Tensor to _Hiding" in lines[1], lines


def _thread_worker(rank, group):
    x, z = (integer_tensor((8, 8), torch.float32, seed=s + rank) for s in (0, 10))
    w = integer_tensor((8, 8), torch.float32, seed=20)

    def program():
        a = all_reduce(x @ w, group)
        other = z.clone()
        thread = threading.Thread(target=dist.all_reduce, args=(other,), kwargs={"group": group})
        thread.start()
        thread.join()
        b = all_reduce(z @ w, group)  # seen: finds the other thread's
        return [a, other, b]

    return against_plain_eager(program)


def test_another_threads_collective_on_a_managed_group_is_named(pool):
    for r in pool.run(_thread_worker, 2, timeout=60):
        assert all(r["equal"]), r
        assert r["stats"]["unseen_operations"] == 1 and r["stats"]["matmul_all_reduce"] == 2, r
        assert "that the mode did not see (from another thread, or issued with dispatch off)" in r["explain"], r


def _seen_worker(rank, group):
    """Point-to-point messages, a barrier and a broadcast on the managed
    group, between fused collectives: all seen, none reported."""
    x = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 8), torch.float32, seed=20)

    def program():
        a = all_reduce(x @ w, group)
        peer = dist.get_global_rank(group, 1 - group.rank())
        got = torch.empty(8, 8)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, group), dist.P2POp(dist.irecv, got, peer, group)]):
            work.wait()
        dist.barrier(group=group)
        b = x.clone()
        dist.broadcast(b, dist.get_global_rank(group, 0), group=group)
        return [a, got, b, all_reduce(b @ w, group)]

    return against_plain_eager(program)


def test_communication_the_mode_sees_is_never_reported(pool):
    for r in pool.run(_seen_worker, 2, timeout=60):
        assert all(r["equal"]), r
        assert r["stats"] == {"matmul_all_reduce": 2}, r
        assert "did not see" not in r["explain"], r["explain"]


def _group_freed_worker(rank, group):
    """The watch references a group only inside the block: a group destroyed
    after it is freed with its threads, not held until the next block."""
    x = integer_tensor((8, 8), torch.float32, seed=rank)
    w = integer_tensor((8, 8), torch.float32, seed=20)
    pipe = EagerMicroPipeline(min_fuse_bytes=0)
    before = sys.getrefcount(group)
    with pipe:
        all_reduce(x @ w, group)
        inside = sys.getrefcount(group)
    return {"fused": pipe.stats["matmul_all_reduce"], "before": before, "inside": inside, "after": sys.getrefcount(group)}


def test_the_watch_holds_no_group_after_the_block(pool):
    for r in pool.run(_group_freed_worker, 2, timeout=60):
        assert r["fused"] == 1 and r["inside"] > r["before"] == r["after"], r
