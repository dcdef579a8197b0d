"""torchao's float8 training as a client: ``convert_to_float8_training`` with
tensor parallelism applied as torchtitan applies it (its float8 TP plan:
``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` /
``PrepareFloat8ModuleInput``), on a feed-forward block (RMSNorm, w1 and w3
column parallel, ``silu(w1 x) * w3 x``, w2 row parallel), bf16, forward and
backward.

torchao's ``Float8TrainingTensor`` issues its FP8 all-gather and its
``_scaled_mm`` from inside its own ``__torch_dispatch__``: they reach the mode
as plain ops (Note [Subclasses desugar first] in eagertp.mode) and fuse. Its
amax all-reduces, issued as written between a layer's backward matmuls, leave
those matmuls pending for the reduce-scatter of their sum (Note [Products past
their collective] in eagertp.deferred).

gloo has no float8 type: plain eager's FP8 all-gather fails there ("Invalid
scalar type"; NCCL moves the bytes). The reference run therefore gathers the
same bytes as uint8 and views them back (``_BytesGather``), which changes no
value. eagertp's ring moves FP8 with point-to-point messages, which gloo takes.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import NEEDS_ROWWISE_SCALED_MM, PlainCollectives

from eagertp import EagerMicroPipeline

DIM, HIDDEN, SEQ, BATCH = 64, 128, 32, 2


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.feed_forward = _FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(self.norm(x))


class _BytesGather(PlainCollectives):
    """Plain eager's FP8 all-gather on gloo: the same bytes as uint8. As
    ``PlainCollectives``, it also lists the collectives that reach it after
    subclasses desugared: entered below the block, what eagertp let through;
    alone, plain eager's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default and args[0].dtype in fp8:
            self.collectives.append("all_gather_into_tensor")
            return func(args[0].view(torch.uint8), *args[1:]).view(args[0].dtype)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _torchao_worker(rank, group, recipe: str, sequence_parallel: bool):
    import warnings

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    warnings.simplefilter("ignore")  # torchao's import-time notices
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput,
    )

    world = group.size()
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16)
    # torchtitan's choice: tensor-wise scaling with torchao's float8 TP styles
    # (the FP8 gather), row-wise with torch's plain ones (a bf16 gather).
    if recipe == "tensorwise":
        config = Float8LinearConfig()
        colwise, rowwise, prepare = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    else:
        config = Float8LinearConfig.from_recipe_name("rowwise")
        if recipe == "rowwise_exact_scales":  # scales not rounded to powers of 2 (log2, exp2)
            config = dataclasses.replace(config, round_scales_to_power_of_2=False)
        colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    convert_to_float8_training(model, config=config)
    if sequence_parallel:  # torchtitan's TP + SP plan
        plan = {
            "norm": SequenceParallel(),
            "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(output_layouts=Shard(1), use_local_output=False),
            "feed_forward.w3": colwise(),
        }
    else:  # plain TP: replicated activations, local tensors between the layers
        plan = {"feed_forward.w1": colwise(), "feed_forward.w2": rowwise(), "feed_forward.w3": colwise()}
    parallelize_module(model, mesh, plan)
    rows = SEQ // world if sequence_parallel else SEQ
    g = torch.Generator().manual_seed(1 + (rank if sequence_parallel else 0))
    x = torch.randn(BATCH, rows, DIM, generator=g).to(torch.bfloat16)

    def step(pipe):
        model.zero_grad()
        inp = x.clone().requires_grad_()
        if sequence_parallel:
            inp = DTensor.from_local(inp, mesh, [Shard(1)])
        with _BytesGather() as below, pipe or contextlib.nullcontext():
            y = model(inp)
            local = y.to_local() if isinstance(y, DTensor) else y
            local.float().sum().backward()
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        got = [local.detach().clone()] + [g.clone() for g in grads]
        return got, below.collectives

    expected, plain_collectives = step(None)
    pipe = EagerMicroPipeline(group=group, min_fuse_bytes=0)
    got, let_through = step(pipe)
    return {
        "equal": [torch.equal(a, b) for a, b in zip(got, expected)],
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
        "plain_collectives": plain_collectives,
        "let_through": let_through,
        "records": len(pipe._engine.trace.collectives),
    }


# Forward: with SP, the gather of the normed input (fused with w1's and w3's
# _scaled_mm) and w2's reduce-scatter; backward: the gather of the output
# gradient (w2's input gradient) and the reduce-scatter of w1's + w3's input
# gradients (row-wise: each multiplied in place by its scales first, Note
# [Epilogues] in eagertp.deferred). Without SP: w2's output all-reduced
# forward; backward, w1's and w3's input gradients, each all-reduced as its
# layer's replicated input takes it. The amax all-reduces are not matmul
# collectives.
#
# Row-wise scaling quantizes each gathered bf16 activation after its gather
# (abs, amax over its rows, casts, clamp, reciprocal, mul; the scales rounded
# down to powers of 2 by log2, floor, exp2 on aligned windows, Note [Aligned
# windows] in eagertp.rowwise), row by row as its chunks land; the first
# _scaled_mm reads each chunk with its rows' scales (the second quantizes
# again after silu read the first's output: the gather has completed).
# Backward, w2's input-gradient matmul on the gathered output gradient keeps
# its in-place scale per piece (Note [Epilogues]); w1's and w3's input
# gradients, each scaled by the rows of its own amax all-reduce, are unbound
# from those tiny gathers so that their sum feeds the reduce-scatter.
_NOT_A_PRODUCT = "its input is not the pending output of a matmul"
_FOUR_OF_FOUR = {"all_gather_matmul": 2, "fused_matmuls": 2, "matmul_reduce_scatter": 2}
_EXPECTED = {
    ("tensorwise", True): _FOUR_OF_FOUR,
    # The test's loss reads w2's all-reduced output after row-wise casts.
    ("tensorwise", False): {"matmul_all_reduce": 3, "rowwise_ops": 3},
    ("rowwise", True): {**_FOUR_OF_FOUR, "rowwise_ops": 80},
    ("rowwise", False): {"matmul_all_reduce": 3, "rowwise_ops": 52},
    # The same recipe with exact scales (``round_scales_to_power_of_2=False``).
    ("rowwise_exact_scales", True): {**_FOUR_OF_FOUR, "rowwise_ops": 59},
    ("rowwise_exact_scales", False): {"matmul_all_reduce": 3, "rowwise_ops": 37},
}


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["SP", "no SP"])
@pytest.mark.parametrize(
    "recipe", ["tensorwise", *(pytest.param(r, marks=NEEDS_ROWWISE_SCALED_MM) for r in ("rowwise", "rowwise_exact_scales"))]
)
def test_torchao_float8_with_tp_fuses_its_matmul_collectives(pool, recipe, sequence_parallel):
    """Every all-gather and reduce-scatter fused, and every all-reduce of a
    matmul output; the amax all-reduces issued as written, with their reason;
    bitwise plain eager's output and gradients."""
    for r in pool.run(_torchao_worker, 2, recipe, sequence_parallel):
        assert all(r["equal"]), r
        assert {k: v for k, v in r["stats"].items() if k != "unfused_all_reduce"} == _EXPECTED[recipe, sequence_parallel], r
        # No invisible collective: explain() has a line for each plain eager issued.
        assert r["records"] == len(r["plain_collectives"]) > 0, (r["plain_collectives"], r["explain"])
        not_fused = [line for line in r["explain"].splitlines() if "not fused" in line]
        assert all(line.startswith("all_reduce(max)") for line in not_fused), r["explain"]
        assert len(not_fused) == r["stats"]["unfused_all_reduce"] > 0, r["explain"]
        assert all("not split over" in line or _NOT_A_PRODUCT in line for line in not_fused), r["explain"]
        # Below the block, no gather or reduce-scatter: only amax all-reduces issued as written.
        assert set(r["let_through"]) <= {"all_reduce"}, r["let_through"]


def _float8_stack_worker(rank, group, steps=2):
    """torchtitan's float8 stack on a 2 x 2 (dp, tp) mesh: float8 training
    with FSDP2's float8 all-gather of the weights on dp
    (``enable_fsdp_float8_all_gather``), the float8 TP + SP plan on tp, SGD;
    ``EagerMicroPipeline(group=tp)`` around each step's forward and backward."""
    import warnings

    import torch.distributed as dist
    from helpers import device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    warnings.simplefilter("ignore")  # torchao's import-time notices, DTensor's redistribution advice
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput,
    )

    assert group.size() == dist.get_world_size() == 4
    mesh = device_mesh((2, 2), ("dp", "tp"))
    tp, dp_rank, tp_rank = mesh["tp"], mesh.get_local_rank("dp"), mesh.get_local_rank("tp")

    def train(use_eagertp: bool):
        torch.manual_seed(0)
        model = _Block().to(torch.bfloat16)
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        parallelize_module(model, tp, {
            "norm": SequenceParallel(),
            "feed_forward": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": Float8ColwiseParallel(),
            "feed_forward.w2": Float8RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "feed_forward.w3": Float8ColwiseParallel(),
        })
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, stats = [], []
        pipe = EagerMicroPipeline(group=tp.get_group()) if use_eagertp else contextlib.nullcontext()  # one for the loop
        for step in range(steps):
            g = torch.Generator().manual_seed(10 * step + dp_rank)  # a batch per dp rank
            x = torch.randn(BATCH, SEQ, DIM, generator=g).to(torch.bfloat16).chunk(2, 1)[tp_rank].contiguous()
            with _BytesGather(), pipe:
                y = model(DTensor.from_local(x.requires_grad_(), tp, [Shard(1)]))
                loss = y.to_local().float().pow(2).mean()
                loss.backward()
            losses.append(loss.detach())
            stats.append(dict(pipe.stats) if use_eagertp else {})
            opt.step()
            opt.zero_grad()
        params = [p.full_tensor().detach().clone() for p in model.parameters()]
        return losses, params, pipe, stats

    plain, fused = train(False), train(True)
    return {
        "losses": (plain[0], fused[0]),
        "params_equal": [torch.equal(f, p) for f, p in zip(fused[1], plain[1])],
        "stats": fused[3],
        "explain": fused[2].explain(summary=True),
    }


def test_torchtitan_float8_stack_fsdp2_float8_all_gather_and_tp(pool):
    """Per step on tp: the 2 FP8 gathers and 2 reduce-scatters fused; the amax
    all-reduces and the sequence-parallel norm's weight gradient issued as
    written. FSDP's float8 all-gather, reduce-scatter and its amax all-reduces
    on dp pass through untouched; losses and trained weights bitwise plain eager's."""
    for r in pool.run(_float8_stack_worker, 4):
        assert [torch.equal(a, b) for a, b in zip(*r["losses"])] == [True, True], r["losses"]
        assert all(r["params_equal"]), r
        # One pipeline for the loop: its second step runs at once the matmuls
        # the first read whole (Note [Deferrals that gained nothing]).
        first, second = r["stats"]
        assert second.pop("matmuls_run_at_once", 0) > 0, r
        assert first == second == {
            "all_gather_matmul": 2, "fused_matmuls": 2, "matmul_reduce_scatter": 2, "unfused_all_reduce": 6,
        }, r
        passed = [line for line in r["explain"].splitlines() if "passed through, not a managed group" in line]
        assert any("c10d._allgather_base_" in line for line in passed), r["explain"]
        assert any("c10d._reduce_scatter_base_" in line for line in passed), r["explain"]
