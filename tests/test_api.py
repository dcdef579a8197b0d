"""Public surface: arguments, errors, context rules. Single process except where noted."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from helpers import OpCounter, all_gather, integer_tensor

import eagertp
from eagertp import EagerMicroPipeline
from eagertp._format import group_str


def test_public_names():
    assert eagertp.__all__ == [
        "BACKENDS", "Backend", "Calibration", "EagerMicroPipeline", "PeerError", "VerificationError",
        "calibrate_min_fuse_bytes",
    ]
    assert all(hasattr(eagertp, name) for name in eagertp.__all__)
    assert sorted(eagertp.BACKENDS) == ["reference", "ring", "symm_mem"]


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError) as e:
        EagerMicroPipeline(backend="nccl")
    assert_expected_inline(
        str(e.value),
        """EagerMicroPipeline: unknown backend 'nccl'; valid names: 'auto', 'ring', 'reference', 'symm_mem'""",
    )


def test_backend_names():
    assert EagerMicroPipeline().backend == "auto"
    assert EagerMicroPipeline(backend="reference").backend == "reference"


def test_auto_serves_cpu_tensors_with_the_ring():
    from eagertp.backends import BackendChoice

    backend, label = BackendChoice("auto").for_collective(torch.ones(1), group=None)  # no probe on CPU
    assert backend.name == "ring" and label == "ring"


def test_group_must_be_a_process_group():
    with pytest.raises(TypeError) as e:
        EagerMicroPipeline(group="tp")
    assert_expected_inline(
        str(e.value),
        """EagerMicroPipeline(group=...) takes a torch.distributed.ProcessGroup or None, got str; for a DeviceMesh pass mesh.get_group('tp')""",
    )


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        EagerMicroPipeline(None)  # type: ignore[misc]


def test_reentering_an_active_instance_is_an_error():
    pipe = EagerMicroPipeline()
    with pipe:
        with pytest.raises(RuntimeError, match="already active"):
            pipe.__enter__()
    with pipe:  # usable again once left
        pass


def test_explain_with_nothing_seen():
    with EagerMicroPipeline(trace=True) as pipe:
        torch.ones(2) + 1
    assert pipe.explain() == "eagertp: no all-gather, reduce-scatter or all-reduce seen on a managed group"
    assert pipe.explain(summary=True) == pipe.explain()
    assert pipe.debug_string() == ""
    assert not pipe.stats


def test_the_ordered_trace_is_recorded_only_when_asked():
    """Note [The ordered trace when asked]: explain() and stats either way;
    debug_string() names the option instead of returning an empty trace."""
    x = torch.randn(4, 4)
    for trace in (False, True):
        with EagerMicroPipeline(trace=trace, min_fuse_bytes=0) as pipe:
            (x @ x).relu()
        recorded = pipe._engine.trace.events  # the deferred matmul's line and the read's
        assert bool(recorded) == trace, list(recorded)
    with pytest.raises(RuntimeError) as raised:
        EagerMicroPipeline().debug_string()
    assert_expected_inline(str(raised.value), """debug_string(): this EagerMicroPipeline records no ordered trace; construct it with EagerMicroPipeline(trace=True) to record one (explain() and stats are always kept)""")


def test_explain_hints_at_all_reduces_added_to_each_other():
    """Note [Sums of all-reduced tensors]: the sums the adds made, merged where
    an add joins two; one hint line, after the records (and the summary's)."""
    from eagertp.trace import Meta, Trace

    class _Group:
        def __init__(self, name):
            self.group_name = name

        def size(self):
            return 2

    trace = Trace(max_records=100, events=False)
    meta = Meta(torch.float32, torch.Size([8, 4]))
    ar = [trace.new_collective("all_reduce(sum)", src=meta, dst=meta, group=_Group("tp")) for _ in range(5)]
    for record in ar:
        trace.mark_fused(record, ["mm"], "ring")
    assert "hint" not in trace.explain()
    trace.note_summed(ar[0], ar[1])
    trace.note_summed(ar[3], ar[4])  # another sum
    trace.note_summed(ar[4], ar[2])  # grows it
    assert [indices for _, indices in trace.summed] == [[0, 1], [2, 3, 4]]
    trace.note_summed(ar[1], ar[2])  # joins the two
    assert [indices for _, indices in trace.summed] == [[0, 1, 2, 3, 4]]
    lines = trace.explain().splitlines()
    assert len(lines) == 6 and lines[-1].startswith("hint: 5 all-reduces were added to each other, in 1 sum "), lines
    assert "(the first: all_reduce(sum) #0, #1, #2, #3, #4 on" in lines[-1] and "would issue 4 fewer" in lines[-1]
    assert trace.explain(summary=True).splitlines()[-1] == lines[-1]
    # A running sum of every all-reduce of a long block: bounded.
    for _ in range(200):
        record = trace.new_collective("all_reduce(sum)", src=meta, dst=meta, group=_Group("tp"))
        trace.note_summed(ar[0], record)
    assert len(trace.summed) == 1 and len(trace.summed[0][1]) == 64, trace.summed


def test_explain_hints_at_shards_gathered_twice(pool):
    """Note [One shard gathered twice]: a gather of the tensor an earlier
    gather of the block sent, unchanged, on the same group is noted; one
    written in place between, or another tensor with the same data, is not."""
    for r in pool.run(_gathered_twice_worker, 2):
        assert r == [
            "hint: 2 all-gathers sent a shard an earlier all-gather had sent, unchanged (the first: all_gather #1, "
            "what #0 sent, on group '2' (2 ranks)); gathering each shard once would issue 2 fewer: with DTensor, "
            "PrepareModuleInput on the module whose input their linears share (docs: tuning, 'One collective per "
            "region')"
        ], r


def _gathered_twice_worker(rank, group):
    x = integer_tensor((8, 16), torch.float32, seed=rank)
    b = integer_tensor((16, 8), torch.float32, seed=9)
    with EagerMicroPipeline(min_fuse_bytes=0) as pipe:
        outs = [all_gather(x, group) @ b for _ in range(2)]  # #0, then #1 sends what #0 sent
        x.add_(1)  # a write: #2 sends other data
        outs += [all_gather(x, group) @ b, all_gather(x.clone(), group) @ b]  # #3: a copy, another tensor
        outs.append(all_gather(x, group) @ b)  # #4 sends what #2 sent
        torch.stack(outs).sum().item()
    return [line for line in pipe.explain().splitlines() if line.startswith("hint: ")]


def test_plain_ops_pass_through_unchanged():
    x = torch.randn(4, 4)
    with EagerMicroPipeline():
        y = (x @ x).relu().sum(0)
    torch.testing.assert_close(y, (x @ x).relu().sum(0), rtol=0, atol=0)


# -- multi-rank context rules --------------------------------------------------------


def _group_filter_worker(rank, group):
    from multirank import OTHER_GROUPS

    other = OTHER_GROUPS[2]
    x = integer_tensor((2, 4), torch.float32, seed=rank)
    w = integer_tensor((4, 3), torch.float32, seed=9)
    with OpCounter() as counter, EagerMicroPipeline(group=group) as pipe:
        managed = all_gather(x, group) @ w
        unmanaged = all_gather(x, other) @ w  # passes through: a plain collective
    # The user's mistake: the pipeline given another group than the program's.
    with EagerMicroPipeline(group=other) as wrong_group:
        all_gather(x, group) @ w
        all_gather(x, group) @ w
    return {
        "ok": torch.equal(managed, unmanaged),
        "stats": dict(pipe.stats),
        "plain_gathers": counter.unfused_all_gathers,
        "explain": pipe.explain(),
        "wrong_group": (dict(wrong_group.stats), wrong_group.explain(), wrong_group.explain(summary=True)),
        "groups": (group_str(group), group_str(other)),
    }


def test_group_option_leaves_other_groups_untouched(pool):
    for r in pool.run(_group_filter_worker, 2):
        assert r["ok"]
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}
        assert r["plain_gathers"] == 1  # the unmanaged one, issued as the user wrote it
        group, other = r["groups"]
        gather = "_c10d_functional.all_gather_into_tensor.default"
        assert r["explain"].splitlines()[1:] == [f"1 x {gather} on {other}: passed through, not a managed group"]


def test_explain_names_the_groups_of_collectives_it_let_pass(pool):
    """A pipeline given another group than the program's fuses nothing, and
    explain() says which group it manages and where the collectives went."""
    for r in pool.run(_group_filter_worker, 2):
        group, other = r["groups"]
        stats, explain, summary = r["wrong_group"]
        assert not stats
        gather = "_c10d_functional.all_gather_into_tensor.default"
        assert explain == (
            f"eagertp: no all-gather, reduce-scatter or all-reduce seen on a managed group ({other})\n"
            f"2 x {gather} on {group}: passed through, not a managed group"
        )
        assert summary == explain


def _group_size_worker(rank, group):
    x = torch.ones(2, 4)
    with EagerMicroPipeline():
        try:
            torch.ops._c10d_functional.all_gather_into_tensor(x, 3, group.group_name)
        except ValueError as e:
            return str(e)
    return None


def test_wrong_group_size_names_op_and_fix(pool):
    msg, _ = pool.run(_group_size_worker, 2)
    assert_expected_inline(
        msg,
        """_c10d_functional.all_gather_into_tensor.default: group_size=3 but group '2' (2 ranks) has 2 ranks; pass the group's size""",
    )


def _odd_shards_worker(rank, group, kind):
    if kind == "noncontiguous":
        x = integer_tensor((6, 4), torch.float32, seed=rank).t()  # [4, 6], strides (1, 4)
    else:
        x = torch.empty(0, 6)
    w = integer_tensor((6, 5), torch.float32, seed=3)
    try:
        expected = all_gather(x, group) @ w
    except AssertionError as e:  # torch 2.11's funcol: "Tensor must be contiguous"
        return {"plain eager rejects": str(e)}
    with EagerMicroPipeline() as pipe:
        got = all_gather(x, group) @ w
    return {"ok": torch.equal(got, expected), "stats": dict(pipe.stats), "explain": pipe.explain()}


def test_noncontiguous_shard_fuses(pool):
    for r in pool.run(_odd_shards_worker, 2, "noncontiguous"):
        if "plain eager rejects" in r:
            pytest.skip(f"plain eager rejects non-contiguous shards on this torch: {r['plain eager rejects']}")
        assert r["ok"]
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1}


def test_zero_size_shard_is_issued_unfused_with_reason(pool):
    results = pool.run(_odd_shards_worker, 2, "empty")
    for r in results:
        assert r["ok"]
        assert r["stats"] == {"unfused_all_gather": 1}
    assert_expected_inline(
        results[0]["explain"],
        """all_gather #0 f32[0, 6] -> f32[0, 6] on group '2' (2 ranks): not fused [ring]: no matmul consumed it before aten.mm.default reads an empty gathered tensor: there is nothing to overlap, and none ran while it was in flight""",
    )


def test_the_handler_table_refuses_a_second_handler_and_finds_the_ops_the_dispatcher_hands_a_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    from eagertp.table import HANDLERS, register

    mm = torch.ops.aten.mm.default
    with pytest.raises(RuntimeError) as e:
        register([mm])(lambda engine, func, args, kwargs: None)
    assert_expected_inline(str(e.value), """eagertp: aten.mm.default already handled by defer_matmul; cannot also register <lambda>""")

    # The table is keyed by each OpOverload's C++ entry point (the NB in eagertp.table):
    # the op a mode receives must be the one torch.ops holds, or every lookup would miss.
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2, 2) @ torch.ones(2, 2)
    assert [f for f in seen if f._op in HANDLERS] == [mm], seen


def test_info_prints_what_a_bug_report_needs():
    """``python -m eagertp.info``, as a user runs it: versions, devices, which
    backends can serve here and why not, the size rule in force; nothing on
    stderr, no process group needed."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "eagertp.info"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"eagertp {eagertp.__version__}"
    assert lines[1].startswith(f"torch {torch.__version__} ")
    assert "  gloo: yes" in lines
    assert "  ring: any process group (point-to-point ops)" in lines
    assert "  symm_mem: no: no CUDA device here (it needs CUDA tensors)" in lines or torch.cuda.is_available()
    assert "  cpu: all_gather 1 MiB, reduce_scatter 512 KiB, all_reduce 1 MiB" in lines
