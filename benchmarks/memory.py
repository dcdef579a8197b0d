"""Peak memory of a fused step against the unfused one.

    python benchmarks/memory.py [--m 1024 --k 1024 --n 1024] [--json out.json]
    python benchmarks/memory.py --no-sequence-parallel   # the step in plain TP: all-reduces, row-wise chains
    python benchmarks/memory.py --at-peak                # and what is live at each step's peak

On 2 gloo ranks, for all-gather + matmul, matmul + reduce-scatter and the
demo's transformer step (forward + backward), measures the peak of tensor
memory allocated during the step (the profiler's allocation records; tensors
that existed before the step are not counted) for unfused eager and eagertp.
The target: fused peak <= unfused peak + one chunk (the largest per-rank
chunk of a collective in the step). ``left in cycles``: the tensor bytes a
fused run leaves in reference cycles, which only Python's garbage collector
frees, some steps later (Note [Freed without the garbage collector] in
eagertp/deferred.py); the target is none. ``--at-peak`` also lists, for the
transformer step, the allocations live at each peak by the op that made
them (the program's op, its autograd node, and eagertp's function where it
made a placeholder): where a fused step's extra bytes are.
"""

from __future__ import annotations

import argparse
import collections
import sys

import _harness


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/memory.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _harness.add_common_args(parser)
    parser.add_argument("--m", type=int, default=1024)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256, help="transformer step: sequence length")
    parser.add_argument("--dim", type=int, default=256, help="transformer step: model width")
    from eagertp.demo import add_plan_args, check_plan_args

    add_plan_args(parser)
    parser.add_argument("--at-peak", action="store_true", help="list the transformer step's live allocations at each peak")
    return check_plan_args(parser, parser.parse_args(argv))


def peak_bytes(fn) -> int:
    """Peak bytes of tensor memory allocated while ``fn()`` runs: the running sum
    of the profiler's allocation / free records, in time order, counting only
    the frees of what ``fn()`` allocated (``_allocations``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for _, _, nbytes, _ in _allocations(prof):
        current += nbytes
        peak = max(peak, current)
    return peak


def cyclic_bytes(fn) -> int:
    """Bytes of tensor storage that ``fn()`` leaves in reference cycles: what the
    garbage collector finds unreachable right after it, saved instead of freed."""
    import gc

    import torch

    gc.collect()
    debug = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        storages = {}
        for o in gc.garbage:
            if issubclass(type(o), torch.Tensor):  # NB: type(): isinstance() of a dead weakref proxy raises
                storage = o.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())
    finally:
        gc.garbage.clear()
        gc.set_debug(debug)
        gc.collect()  # NB: frees what it saved: clearing gc.garbage leaves the cycles themselves


def _allocations(prof) -> list[tuple[int, int, int, str]]:
    """The allocations and frees a profile recorded, in time order, as
    ``(time, address, bytes: negative for a free, made by)``; "made by" as
    ``live_at_peak`` names it (empty unless the profile recorded stacks).
    Frees of memory allocated before the profile started are left out: the
    profiler records those whose size it knows (blocks allocated while an
    earlier profile ran, an earlier run's tensors freed during this one), and
    counting them put a run's peak below what it allocated (every third fused
    run of the plain-TP step read 4.02 MiB instead of 7.02)."""
    from torch._C._profiler import _EventType

    found = []

    def walk(node, ops: tuple[str, ...], ours: str) -> None:
        if node.typed[0] == _EventType.Allocation:
            allocation = node.typed[1]
            found.append((node.start_time_ns, allocation.ptr, allocation.alloc_size, " > ".join(ops[:2]) + ours))
            return
        try:
            name = node.name
        except UnicodeDecodeError:  # NB: a Python frame's name the profiler stored cut
            name = ""
        if name.startswith("aten::") or name.endswith(("Backward0", "Backward1")):
            ops += (name.removeprefix("autograd::engine::evaluate_function: "),)
        elif "/eagertp/" in name and "/eagertp/demo.py" not in name:  # "/.../eagertp/rowwise.py(661): defer"
            ours = f" [eagertp {name.rsplit('/', 1)[-1].split('(')[0]}:{name.rsplit(': ', 1)[-1]}]"
        for child in node.children:
            walk(child, ops, ours)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, (), "")
    allocated, kept = set(), []
    for event in sorted(found, key=lambda a: a[0]):
        _, address, nbytes, _ = event
        if nbytes > 0:
            allocated.add(address)
        elif address in allocated:
            allocated.discard(address)
        else:
            continue  # allocated before the profile started
        kept.append(event)
    return kept


def live_at_peak(fn) -> tuple[int, list[tuple[int, int, str]]]:
    """The peak bytes allocated while ``fn()`` runs, as ``peak_bytes``, and the
    allocations live at that point: ``(bytes, count, made by)`` rows, largest
    first. "Made by": the program's op (and its autograd node), then the
    innermost eagertp function on the stack if eagertp made it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        fn()
    live: dict[int, tuple[int, str]] = {}
    at_peak: dict[int, tuple[int, str]] = {}
    current = peak = 0
    for _, address, nbytes, made_by in _allocations(prof):
        current += nbytes
        if nbytes > 0:
            live[address] = (nbytes, made_by)
        else:
            live.pop(address, None)
        if current > peak:
            peak, at_peak = current, dict(live)
    rows = collections.Counter(at_peak.values())
    return peak, sorted(((n, count, made_by) for (n, made_by), count in rows.items()), key=lambda r: -r[0] * r[1])


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import argparse as ap

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh

    from eagertp import EagerMicroPipeline
    from eagertp._compat import funcol_all_gather, funcol_reduce_scatter
    from eagertp.demo import build_model, local_input

    group = dist.group.WORLD
    m, k, n = args.m, args.k, args.n
    shard = torch.randn(m // world, k)
    a, b = torch.randn(m, k), torch.randn(k, n)

    def ag_mm():
        return funcol_all_gather(shard, 0, group) @ b

    def mm_rs():
        return funcol_reduce_scatter(a @ b, "sum", 0, group).wait()

    mesh = DeviceMesh("cpu", list(range(world)))
    model_args = ap.Namespace(
        dim=args.dim, heads=8, layers=1, sequence_parallel=args.sequence_parallel,
        one_all_reduce_per_region=args.one_all_reduce_per_region,
    )
    model = build_model(model_args, mesh)
    x = local_input(torch.randn(2, args.seq, args.dim), args.sequence_parallel, rank, world)

    def train_step():
        F.mse_loss(model(x), torch.zeros_like(x)).backward()
        for p in model.parameters():
            p.grad = None

    cases = [
        ("all_gather_matmul", ag_mm, m // world * n * 4),  # chunk: one rank's rows of the output
        ("matmul_reduce_scatter", mm_rs, m // world * n * 4),
        # The largest chunk: with sequence parallel the MLP's; without, the all-reduced activation's.
        ("transformer_step", train_step, 2 * args.seq // world * (4 if args.sequence_parallel else 1) * args.dim * 4),
    ]
    results = []
    for name, fn, chunk in cases:
        # NB: every collective fused whatever its size (at these sizes the
        # default rule fuses none of the step's).
        pipe = EagerMicroPipeline(min_fuse_bytes=0)
        fn()  # warm-up (allocator, caches)
        with pipe:
            fn()
        unfused = peak_bytes(fn)

        def fused(fn=fn):
            with pipe:
                fn()

        peak = peak_bytes(fused)
        calls = sum(n for key, n in pipe.stats.items() if key in _FUSED_CALLS)
        results.append({"case": name, "peak_unfused": unfused, "peak_fused": peak, "chunk": chunk, "fused_calls": calls,
                        "cyclic_fused": cyclic_bytes(fused)})
        if args.at_peak and name == "transformer_step":
            # NB: the run with the median peak of three: a run's peak moves with timing.
            results[-1]["at_peak"] = {
                column: sorted((live_at_peak(f) for _ in range(3)), key=lambda r: r[0])[1]
                for column, f in (("unfused", fn), ("fused", fused))
            }
    return results


# The stats that count fused calls: what says the fused column measured fusion.
_FUSED_CALLS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def main(argv=None) -> int:
    args = parse_args(argv)
    with _harness.quiet_warnings():
        results = _harness.run(args, _worker)
    print(f"memory: peak tensor bytes allocated during the step, rank 0 of {args.world_size} (MiB)")
    rows = [
        {
            **r,
            "unfused": r["peak_unfused"] / 2**20,
            "fused": r["peak_fused"] / 2**20,
            "chunk_mib": r["chunk"] / 2**20,
            "cyclic": r["cyclic_fused"] / 2**20,
            "within": "yes" if r["peak_fused"] <= r["peak_unfused"] + r["chunk"] else "NO",
        }
        for r in results
    ]
    print(
        _harness.table(
            rows,
            [
                ("case", "case", ""),
                ("unfused", "unfused", ".2f"),
                ("fused", "fused", ".2f"),
                ("chunk_mib", "one chunk", ".2f"),
                ("cyclic", "left in cycles", ".2f"),
                ("fused_calls", "fused calls", ""),
                ("within", "fused <= unfused + chunk", ""),
            ],
        )
    )
    for r in results:
        for column, (peak, rows) in r.get("at_peak", {}).items():
            print(f"\n{r['case']}, {column}: live at the peak ({peak / 2**20:.2f} MiB), by what made it:")
            for nbytes, count, made_by in rows:
                print(f"  {count:3d} x {nbytes / 2**10:8.1f} KiB  {made_by}")
    _harness.write_json(args.json, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
