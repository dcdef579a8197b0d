"""Print ``explain()`` for each fusing pattern on 2 gloo CPU ranks.

The outputs in docs/patterns.md come from this script::

    python docs/_examples/patterns_explain.py

Shapes are tiny, so every example runs with ``min_fuse_bytes=0`` (fuse every
size); the last one keeps the default size rule to show what it says.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from eagertp import EagerMicroPipeline
from eagertp._compat import all_gather_single, reduce_scatter_single  # c10d's newest names

WORLD = 2


def _wait(t):
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _gather(x, group, dim=0):
    return _wait(funcol.all_gather_single(x, dim, group))


def _scatter(x, group, op="sum", dim=0):
    return _wait(funcol.reduce_scatter_single(x, op, dim, group))


def examples(rank, group):
    torch.manual_seed(rank)
    w = [torch.randn(16, 16) for _ in range(4)]
    x = torch.randn(8, 16)  # this rank's shard of a [16, 16] activation
    out = {}

    def run(name, fn, **kwargs):
        kwargs.setdefault("min_fuse_bytes", 0)
        with EagerMicroPipeline(**kwargs) as pipe:
            fn()
        out[name] = pipe.explain()

    # 1. all-gather then Q, K, V on the gathered tensor: one fused call.
    def qkv():
        g = _gather(x, group)
        q, k, v = g @ w[0], g @ w[1], g @ w[2]
        return q + k + v

    run("all_gather_matmul", qkv)

    # 2. weight gradient: the gathered tensor as A.t() (contraction over its rows).
    def wgrad():
        g = _gather(x, group)
        dy = torch.randn(16, 16)
        return g.t() @ dy

    run("gathered_a_t", wgrad)

    # 3. gathered along the last dim (column blocks).
    def cols():
        g = _gather(torch.randn(16, 8), group, dim=1)
        return g @ w[0]

    run("gathered_columns", cols)

    # 4. row-parallel forward: matmul then reduce-scatter.
    def rs():
        h = torch.randn(16, 16)
        return _scatter(h @ w[0], group)

    run("matmul_reduce_scatter", rs)

    # 5. a sum of products reduce-scattered (dQ @ Wq + dK @ Wk + dV @ Wv).
    def rs_sum():
        a, b, c = (torch.randn(16, 16) for _ in range(3))
        return _scatter(a @ w[0] + b @ w[1] + c @ w[2], group)

    run("sum_reduce_scatter", rs_sum)

    # 6. TP without SP: matmul then all-reduce, the next matmul on its result.
    def ar():
        h = torch.randn(16, 16)
        y = _wait(funcol.all_reduce(h @ w[0], "sum", group))
        return y @ w[1]

    run("matmul_all_reduce", ar)

    # 6b. TP without SP as models write it: the residual add and the norm
    # between the all-reduce and the next matmul run row by row.
    def ar_norm():
        h, residual = torch.randn(16, 16), torch.randn(16, 16)
        y = residual + _wait(funcol.all_reduce(h @ w[0], "sum", group))
        n = torch.nn.functional.layer_norm(y, [16])
        return n @ w[1], n @ w[2]

    run("rowwise_all_reduce", ar_norm)

    # 7. column-parallel linear whose output is gathered (colwise_rep); a
    # 1 MiB shard, so that it travels in pieces the product can be made in.
    def mag():
        h = torch.randn(2048, 16)
        return _gather(h @ torch.randn(16, 128), group, dim=1)

    run("matmul_all_gather", mag)

    # 8. autocast: the cast of a gathered activation before a linear.
    def amp():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g = _gather(x, group)
            return torch.nn.functional.linear(g, w[0])

    run("autocast", amp)

    # 9. einsum's bmm with a batch of one.
    def einsum():
        g = _gather(x.unsqueeze(0), group, dim=1)
        return torch.einsum("bsd,de->bse", g, w[0])

    run("einsum_bmm", einsum)

    # 10. FP8: _scaled_mm on a gathered uint8 tensor viewed back as FP8.
    def fp8():
        xs = (torch.randn(16, 32) * 4).round().to(torch.float8_e4m3fn)
        wt = (torch.randn(16, 32) * 4).round().to(torch.float8_e4m3fn).t()
        g = _gather(xs.view(torch.uint8), group).view(torch.float8_e4m3fn)
        return torch._scaled_mm(g, wt, torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.float32)

    run("scaled_mm", fp8)

    # 11. raw c10d, Megatron style: gather into a buffer, reduce-scatter into one.
    def megatron():
        full = torch.empty(16, 16)
        all_gather_single(full, x, group=group)
        h = torch.relu(full @ w[0])
        y = h @ w[1]
        shard = torch.empty(8, 16)
        reduce_scatter_single(shard, y, group=group)
        return shard

    run("raw_c10d", megatron)

    # 12. unfused: a non-matmul read first, and the default size rule.
    def read_first():
        g = _gather(x, group)
        return g.sum() + (g @ w[0]).sum()

    run("read_first", read_first)
    run("size_rule", qkv, min_fuse_bytes=None)

    # 13. group= names another group than the one the program uses.
    other = dist.new_group(list(range(WORLD)))

    def summary_prog():
        for _ in range(3):
            qkv()

    with EagerMicroPipeline(group=other, min_fuse_bytes=0) as pipe:
        summary_prog()
    out["passed_through"] = pipe.explain(summary=True)
    with EagerMicroPipeline(min_fuse_bytes=0) as pipe:
        summary_prog()
    out["summary"] = pipe.explain(summary=True)
    return out


def _worker(rank, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out = examples(rank, dist.group.WORLD)
        if rank == 0:
            queue.put(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see eagertp._compat.exit_spawned_rank


def main():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = None
    while out is None:
        try:
            out = queue.get(timeout=1)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                sys.exit("a rank failed")
    for p in procs:
        p.join()
    for name, text in out.items():
        print(f"== {name}\n{text}\n")


if __name__ == "__main__":
    main()
