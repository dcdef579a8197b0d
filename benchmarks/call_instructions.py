"""Instructions one call costs, counted by valgrind's callgrind: what eagertp
adds to each fused form, exactly, where times on these shared machines move by
more than the change being measured.

    python benchmarks/call_instructions.py [--calls 100] [--forms matmul_reduce_scatter ...]
    python benchmarks/call_instructions.py --calls 30 --forms train_step train_step_no_sp

Needs valgrind (``apt-get install valgrind``). Two gloo ranks, 64 x 64 float32
(small, so that the count is the calls' Python and dispatch, not their FLOPs),
each form as a program writes it, then ``.sum()``:

- ``matmul_reduce_scatter``: ``funcol.reduce_scatter_single(a @ b, "sum", 0, group).wait()``
- ``matmul_all_reduce``: ``funcol.all_reduce(a @ b, "sum", group).wait()``
- ``all_gather_matmul``: ``funcol.all_gather_single(a, 0, group) @ b``
- ``deferred_matmul``: ``(a @ b).relu()``: a matmul eagertp defers until the
  next op shows what it feeds (every matmul in a block pays this)
- ``train_step``, ``train_step_no_sp``: one training step (forward, MSE loss,
  backward) of the demo's model (``eagertp.demo``: 2 blocks, DTensor TP with
  sequence parallel, or plain TP), at dims where compute is near zero (batch
  2, sequence 16, width 64, 4 heads), each step its own block: the whole
  host cost of a step, DTensor's and autograd's included

Each form runs ``--calls`` times in an empty ``TorchDispatchMode``, in an
empty one that lets tensor subclasses desugar first (as eagertp does, so it
also sees the ops DTensor issues inside its own dispatch) and in
``EagerMicroPipeline(min_fuse_bytes=0)``, every rank under callgrind (a
training step enters the mode per step; the others run in one block). A form's
timed calls run inside one C function of CPython's that nothing else here calls
(``--toggle-collect``), so only they are counted, with everything they call on
rank 0's own thread: not imports, start-up or warm-up, and not gloo's threads
(which move the bytes). The counts repeat to within about 0.3% run to run
with the same ``--forms`` and ``--calls``; compare those only: another order
or number of calls moves them by up to 20% (Python's garbage collector and
allocator run at other calls). The last column says how often the collector
ran among the counted calls, per mode: a run of its youngest generation costs
little, but one of an older generation can be a large part of a form's count
(1.6M instructions of the deferred matmul's 30 calls in one run:
benchmarks/NOTES.md, 2026-12-05 at f4af84c).

With ``--hand``, the three fused forms also run with no mode, twice: the
collective issued on the process group itself (``direct``:
``group._reduce_scatter_base``, ``allreduce``, ``_allgather_base``; no
funcol) and the schedule of ``hand_schedules.py`` (``hand``: in one piece, as
eagertp's ring sends 64 x 64; its buffers made at each call, as a program's
results are; its messages posted with the process group's own ``send`` and
``recv`` as eagertp's ring posts them, ``--hand group``, or with
torch.distributed's ``isend`` and ``irecv``, ``--hand dist``). ``hand -
direct`` is what overlapping by hand costs the host over the one collective
it replaces (gloo runs a collective on its own threads, not counted, and a
point-to-point message partly on the caller's); eagertp's own is the same
swap plus eagertp's bookkeeping (the ops eagertp issues run inside its own
dispatch, where no mode sees them, as the hand schedule's run where no mode
is set).

Prints rank 0's instructions per call in each mode, eagertp's own (its
difference from the empty mode) and eagertp's ratios to both empty modes.
``--frames`` runs no valgrind and counts eagertp's own Python frames in one
call of each form instead: a proxy (about 2-3k instructions a frame) that
takes seconds, for a loop of small changes between callgrind runs. Takes a few minutes: callgrind runs Python about 50x slower.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile

import _harness

# form -> the C function of CPython's its timed calls run inside, and how to
# call ``run(fn, calls)`` through it.
ENTRY_POINTS = {
    "matmul_reduce_scatter": ("_operator_call", lambda run, fn, calls: operator.call(run, fn, calls)),
    "matmul_all_reduce": ("starmap_next", lambda run, fn, calls: list(itertools.starmap(run, [(fn, calls)]))),
    "all_gather_matmul": (
        "accumulate_next", lambda run, fn, calls: list(itertools.accumulate([0, 1], lambda *_: run(fn, calls)))
    ),
    "deferred_matmul": (
        "filterfalse_next", lambda run, fn, calls: list(itertools.filterfalse(lambda _: run(fn, calls), [0]))
    ),
    "train_step": ("dropwhile_next", lambda run, fn, calls: list(itertools.dropwhile(lambda _: run(fn, calls), [0]))),
    "train_step_no_sp": (
        "takewhile_next", lambda run, fn, calls: list(itertools.takewhile(lambda _: run(fn, calls), [0]))
    ),
}
# Forms that are a whole training step: the mode entered per step.
STEPS = ("train_step", "train_step_no_sp")
MODES = ("empty", "desugaring", "eagertp")
HAND_MODES = ("direct", "hand")  # with --hand
# The forms with a hand-written schedule (the hand mode runs the others as written).
HAND_FORMS = ("matmul_reduce_scatter", "matmul_all_reduce", "all_gather_matmul")
_WARMUP = 10


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/call_instructions.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--calls", type=int, default=100, help="counted calls per form (instructions are per call)")
    parser.add_argument(
        "--forms", nargs="+", choices=list(ENTRY_POINTS), default=[f for f in ENTRY_POINTS if f not in STEPS],
        help="the calls by default; the training steps (about 1,000 calls' worth each) when named",
    )
    parser.add_argument(
        "--hand", choices=("group", "dist"), default=None,
        help="also count the fused forms written by hand (hand_schedules.py), their messages posted by the "
        "process group's own send/recv (as eagertp's ring posts) or by torch.distributed's isend/irecv",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    parser.add_argument(
        "--frames", action="store_true",
        help="no valgrind: count eagertp's own Python frames in one call of each form (seconds, not minutes; "
        "a proxy for instructions, about 2-3k a frame)",
    )
    parser.add_argument(
        "--rank-program", nargs=4, metavar=("MODE", "RANK", "PORT", "WORLD"), help=argparse.SUPPRESS
    )  # internal: one rank's calls, run under callgrind by the parent
    return parser.parse_args(argv)


def rank_program(args: argparse.Namespace) -> None:
    """One rank: warm every form up, then run each form's counted calls
    inside its entry point (counted only where callgrind runs it)."""
    mode, rank, port, world = args.rank_program
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    with _harness.quiet_warnings():
        import torch
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        import torch.distributed._functional_collectives as funcol
        import torch.nn.functional as F
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor
        from torch.distributed.device_mesh import init_device_mesh

        from eagertp import EagerMicroPipeline, demo
        from eagertp._compat import exit_spawned_rank, funcol_all_gather, funcol_reduce_scatter

    class EmptyMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class DesugaringMode(TorchDispatchMode):
        """An empty mode that lets tensor subclasses run their own dispatch
        first and sees the ops they issue, as eagertp must (Note [Subclasses
        desugar first] in eagertp.mode): the floor of any mode that sees what
        DTensor communicates. The empty mode runs DTensor's ops with itself off."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(
                t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
                and not issubclass(t, (torch.nn.Parameter, FakeTensor, FunctionalTensor))
                for t in types
            ):
                return NotImplemented
            return func(*args, **(kwargs or {}))

    modes = {"empty": EmptyMode, "desugaring": DesugaringMode, "direct": contextlib.nullcontext,
             "hand": contextlib.nullcontext}

    dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
    torch.set_num_threads(1)
    group = dist.group.WORLD
    torch.manual_seed(int(rank))
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    forms = {
        "matmul_reduce_scatter": lambda: funcol_reduce_scatter(a @ b, "sum", 0, group).wait().sum(),
        "matmul_all_reduce": lambda: funcol.all_reduce(a @ b, "sum", group).wait().sum(),
        "all_gather_matmul": lambda: (funcol_all_gather(a, 0, group) @ b).sum(),
        "deferred_matmul": lambda: (a @ b).relu().sum(),
    }
    if mode in HAND_MODES:
        import hand_schedules as hand

        def direct_reduce_scatter():
            out = a.new_empty(a.shape[0] // 2, b.shape[1])
            group._reduce_scatter_base(out, a @ b).wait()
            return out.sum()

        def direct_all_reduce():
            c = a @ b
            group.allreduce([c]).wait()
            return c.sum()

        def direct_all_gather():
            out = a.new_empty(a.shape[0] * 2, a.shape[1])
            group._allgather_base(out, a).wait()
            return (out @ b).sum()

        p2p = hand.P2P.on(group) if args.hand == "group" else hand.DIST
        written = {form: forms[form]() for form in HAND_FORMS}
        forms.update(
            {"matmul_reduce_scatter": direct_reduce_scatter, "matmul_all_reduce": direct_all_reduce,
             "all_gather_matmul": direct_all_gather} if mode == "direct" else
            {"matmul_reduce_scatter": lambda: hand.matmul_reduce_scatter(a, b, 1, p2p)().sum(),
             "matmul_all_reduce": lambda: hand.matmul_all_reduce(a, b, 1, p2p)().sum(),
             "all_gather_matmul": lambda: hand.all_gather_matmul(a, b, 1, p2p=p2p)().sum()}
        )
        # NB: they compute what the program as written does (sums of the same products, perhaps
        # added in another order: a tolerance).
        same = all(torch.allclose(forms[form](), want, rtol=1e-4, atol=1e-3) for form, want in written.items())
        print(f"{mode} forms {'match' if same else 'DIFFER FROM'} the program as written")

    pipe = EagerMicroPipeline(min_fuse_bytes=0)
    block = modes.get(mode, lambda: pipe)

    def train_step(model, x: torch.Tensor, target: torch.Tensor) -> None:
        """One training step in its own block."""
        with block():
            F.mse_loss(model(x), target).backward()

    mesh = init_device_mesh("cpu", (int(world),)) if any(form in STEPS for form in args.forms) else None
    for name, sequence_parallel in (("train_step", True), ("train_step_no_sp", False)):
        if name in args.forms:
            step_args = argparse.Namespace(
                layers=2, batch=2, seq=16, dim=64, heads=4, sequence_parallel=sequence_parallel
            )
            model = demo.build_model(step_args, mesh)
            x, target = (
                demo.local_input(torch.randn(2, 16, 64), sequence_parallel, int(rank), int(world)) for _ in range(2)
            )
            forms[name] = functools.partial(train_step, model, x, target)

    def run(fn, calls: int) -> int:
        for _ in range(calls):
            fn()
        return 0

    frames = {}

    def count(form: str) -> None:
        run(forms[form], _WARMUP)
        dist.barrier()
        collected = 0  # the garbage collector's runs among the counted calls

        def on_collect(phase: str, info: dict) -> None:
            nonlocal collected
            collected += phase == "start"

        gc.callbacks.append(on_collect)
        try:
            ENTRY_POINTS[form][1](run, forms[form], args.calls)
        finally:
            gc.callbacks.remove(on_collect)
        if rank == "0":
            print(f"gc {form} {collected}")
        if args.frames:  # one more call, rank 0's traced (every rank makes it: its collectives)
            if rank == "0":
                frames[form] = _frames_of(forms[form])
            else:
                forms[form]()

    calls = [form for form in args.forms if form not in STEPS]
    with block():
        for form in calls:
            count(form)
        fused = {k: pipe.stats[k] for k in ("matmul_reduce_scatter", "matmul_all_reduce", "all_gather_matmul")}
    steps = {}
    for form in args.forms:
        if form in STEPS:
            count(form)
            steps[form] = dict(pipe.stats)  # the last step's
    if mode == "eagertp":  # what was counted is what the tests prove: the fused paths ran
        print(f"stats {fused}")
        for form, stats in steps.items():
            print(f"{form} stats {stats}")
    if args.frames and rank == "0":
        for form, n in frames.items():
            print(f"frames {form} {n}")
    dist.destroy_process_group()
    # NB: no finalising: the direct collectives' Work left gloo's threads to abort there (docstring of
    # exit_spawned_rank); callgrind still writes its counts at the process's exit.
    exit_spawned_rank(0)


def _frames_of(fn) -> int:
    """The Python frames of eagertp's own code that one call of ``fn`` runs
    (rank 0's thread; generator resumptions count as frames, as they cost one)."""
    import eagertp

    package = os.path.dirname(eagertp.__file__)
    n = 0

    def profile(frame, event, arg) -> None:
        nonlocal n
        if event == "call" and frame.f_code.co_filename.startswith(package):
            n += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def _count(callgrind_out: str, calls: int) -> dict[str, float]:
    """Instructions per call inside each entry point, from a callgrind file."""
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", callgrind_out], capture_output=True, text=True, check=True
    ).stdout
    return parse_inclusive(annotated, calls)


def parse_inclusive(annotated: str, calls: int) -> dict[str, float]:
    """``callgrind_annotate --inclusive=yes`` output -> form -> instructions per call."""
    counts = {}
    for form, (entry, _) in ENTRY_POINTS.items():
        found = re.search(rf"^\s*([\d,]+) \([^)]*\)\s+\S*:{entry}\b", annotated, re.MULTILINE)
        if found:
            counts[form] = int(found.group(1).replace(",", "")) / calls
    return counts


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rank_program:
        rank_program(args)
        return
    if args.frames:
        print(_frames_table(args))
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        raise SystemExit("call_instructions.py needs valgrind's callgrind: apt-get install valgrind")
    world = 2
    toggles = [f"--toggle-collect={ENTRY_POINTS[form][0]}" for form in args.forms]
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for mode in MODES + (HAND_MODES if args.hand else ()):  # every mode at once: each its own ranks
            port = str(_harness._free_port())
            for rank in range(world):
                out = os.path.join(tmp, f"{mode}.{rank}.out")
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *toggles,
                       sys.executable, __file__, "--calls", str(args.calls), "--forms", *args.forms,
                       *(("--hand", args.hand) if args.hand else ()),
                       "--rank-program", mode, str(rank), port, str(world)]
                procs[mode, rank] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out)
        counts, collections, stats = {}, {}, ""
        for (mode, rank), (proc, out) in procs.items():
            stdout, stderr = proc.communicate(timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"{mode} rank {rank} failed ({proc.returncode}):\n{stdout}\n{stderr[-4000:]}")
            if rank == 0:
                counts[mode] = _count(out, args.calls)
                collections[mode] = dict(re.findall(r"^gc (\w+) (\d+)$", stdout, re.MULTILINE))
                if mode == "eagertp":
                    stats = "\n".join(line for line in stdout.splitlines() if "stats " in line)
                if mode in HAND_MODES and f"{mode} forms match" not in stdout:
                    raise SystemExit(f"the {mode} forms do not compute the program's results:\n{stdout}")
    print(f"call_instructions: {world} ranks, gloo, 64 x 64 float32, rank 0's instructions per call "
          f"(callgrind, {args.calls} calls)")
    rows = [
        {"form": form, "empty": counts["empty"][form], "desugaring": counts["desugaring"][form],
         "eagertp": counts["eagertp"][form], "added": counts["eagertp"][form] - counts["empty"][form],
         "ratio": counts["eagertp"][form] / counts["empty"][form],
         "ratio_desugaring": counts["eagertp"][form] / counts["desugaring"][form],
         "gc": " / ".join(collections[mode].get(form, "?") for mode in MODES),
         **({"direct": counts["direct"][form], "hand_total": counts["hand"][form],
             "hand": counts["hand"][form] - counts["direct"][form]} if args.hand and form in HAND_FORMS else {})}
        for form in args.forms
    ]
    print(_harness.table(rows, [("form", "form", "s"), ("empty", "empty mode", ",.0f"),
                                ("desugaring", "desugaring mode", ",.0f"), ("eagertp", "eagertp", ",.0f"),
                                ("added", "eagertp's own", ",.0f"), ("ratio", "/ empty", ".2f"),
                                ("ratio_desugaring", "/ desugaring", ".2f"),
                                ("gc", "collector runs (empty / desugaring / eagertp)", "s")]))
    hand_rows = [r for r in rows if "hand" in r]
    if hand_rows:
        print(f"\nwith no mode (--hand {args.hand}): the collective on the process group itself, the schedule "
              "written by hand, what the schedule adds (hand - direct), and eagertp's own (eagertp - empty mode)")
        print(_harness.table(hand_rows, [("form", "form", "s"), ("direct", "direct", ",.0f"),
                                         ("hand_total", "hand", ",.0f"), ("hand", "hand - direct", ",.0f"),
                                         ("added", "eagertp's own", ",.0f")]))
    print(f"eagertp {stats}")
    _harness.write_json(args.json, {"calls": args.calls, "world_size": world, "rows": rows})


def _frames_table(args: argparse.Namespace) -> str:
    """``--frames``: both ranks in eagertp's mode, no valgrind; rank 0's
    frames per form."""
    port, world = str(_harness._free_port()), 2
    cmd = [sys.executable, __file__, "--calls", "1", "--frames", "--forms", *args.forms, "--rank-program", "eagertp"]
    procs = [subprocess.Popen([*cmd, str(rank), port, str(world)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(world)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, outs):
        if proc.returncode != 0:
            raise SystemExit(f"a rank failed ({proc.returncode}):\n{stdout}\n{stderr[-4000:]}")
    rows = [{"form": form, "frames": int(n)} for form, n in re.findall(r"^frames (\w+) (\d+)$", outs[0][0], re.MULTILINE)]
    return (f"call_instructions --frames: {world} ranks, gloo, 64 x 64 float32, eagertp's own Python frames in "
            f"one call (rank 0)\n" + _harness.table(rows, [("form", "form", "s"), ("frames", "frames", "d")]))


if __name__ == "__main__":
    main()
