"""torch.compile'd code inside the block runs eagerly there (its ops seen and
fused as usual) and runs compiled again after the block, with no
``torch._dynamo.reset()`` (Note [Compiled code inside the block])."""

from __future__ import annotations

import pytest
import torch
from helpers import PlainCollectives, all_gather, explained_collectives, integer_tensor

from eagertp import EagerMicroPipeline


class CountingBackend:
    """A torch.compile backend that compiles with ``backend`` and counts how
    often Dynamo compiled a graph and how often a compiled graph ran."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.compiles = self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiles += 1
        compiled = self.backend(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run

    def counts(self) -> tuple[int, int]:
        return self.compiles, self.runs


def _compiled_worker(rank, group, backend):
    x = integer_tensor((2, 4), torch.float32, seed=rank)
    w = integer_tensor((4, 3), torch.float32, seed=5)
    with PlainCollectives() as plain:
        expected = torch.relu(all_gather(x, group) @ w) + 1
    assert plain.collectives == ["all_gather_into_tensor"], plain.collectives

    head_backend, linear_backend, block_backend = (CountingBackend(backend) for _ in range(3))

    @torch.compile(backend=head_backend)
    def head(a):  # reads a gathered tensor: its matmul binds to the gather
        return torch.relu(a @ w) + 1

    linear = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w.t())
    linear = torch.compile(linear, backend=linear_backend)

    @torch.compile(backend=block_backend)
    def block(shard):  # the gather itself inside the compiled function
        return torch.relu(all_gather(shard, group) @ w) + 1

    functions = {"head": lambda: head(all_gather(x, group)), "block": lambda: block(x)}
    if backend != "inductor":  # NB: one small inductor case (C++ compile on CPU)
        functions["module"] = lambda: torch.relu(linear(all_gather(x, group))) + 1
    backends = {"head": head_backend, "module": linear_backend, "block": block_backend}

    result = {}
    for name, fn in functions.items():
        with torch.no_grad(), EagerMicroPipeline() as pipe:
            inside = fn()
        counts_inside = backends[name].counts()
        with torch.no_grad():
            after = [fn(), fn()]
        result[name] = {
            "ok": all(torch.equal(y, expected) for y in [inside, *after]),
            "stats": dict(pipe.stats),
            "explained": explained_collectives(pipe),  # plain eager's one gather: none invisible
            "inside": counts_inside,  # (compiles, runs): none while inside the block
            "after": backends[name].counts(),  # compiled once, ran twice, no reset
        }
    result["stance"] = torch._dynamo.eval_frame._stance.stance
    return result


FUSED_ONCE = {"all_gather_matmul": 1, "fused_matmuls": 1}


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_code_fuses_inside_and_runs_compiled_after(pool, backend):
    for r in pool.run(_compiled_worker, 2, backend, timeout=300 if backend == "inductor" else 120):
        assert r.pop("stance") == "default", "the block leaked its compiler stance"
        assert set(r) == ({"head", "block"} if backend == "inductor" else {"head", "block", "module"}), r
        for name, got in r.items():
            assert got["ok"], (name, got)
            assert got["stats"] == FUSED_ONCE and got["explained"] == 1, (name, got)
            assert got["inside"] == (0, 0), (name, got)
            assert got["after"] == (1, 2), (name, got)


def _stance() -> str:
    return torch._dynamo.eval_frame._stance.stance


def test_the_stance_is_restored_when_nested_on_exceptions_and_when_enter_fails(monkeypatch):
    with torch.compiler.set_stance("eager_on_recompile"):
        with EagerMicroPipeline():
            with EagerMicroPipeline():
                assert _stance() == "force_eager"
            assert _stance() == "force_eager"
        assert _stance() == "eager_on_recompile"
        with pytest.raises(ZeroDivisionError), EagerMicroPipeline():
            1 / 0
        assert _stance() == "eager_on_recompile"

        def fail(self):
            raise OSError("mode refused")

        import eagertp.pipeline

        pipe = EagerMicroPipeline()
        monkeypatch.setattr(eagertp.pipeline.EagerTPMode, "__enter__", fail)
        with pytest.raises(OSError, match="mode refused"):
            pipe.__enter__()
        assert _stance() == "eager_on_recompile"
        monkeypatch.undo()
        with pipe:  # the failed enter left nothing behind
            assert _stance() == "force_eager"
    assert _stance() == "default"


def test_dynamo_never_traces_the_mode():
    """A program that sets another stance inside the block runs compiled code
    with Dynamo's frame hook set while its ops reach the mode: Dynamo compiles
    none of eagertp's frames, as with torch's own wrapper (Note [Dispatch
    without Dynamo's wrapper])."""
    backend = CountingBackend("eager")
    f = torch.compile(lambda x, w: torch.relu(x @ w) + 1, backend=backend)
    x, w = integer_tensor((64, 64), torch.float32, seed=0), integer_tensor((64, 64), torch.float32, seed=1)
    with EagerMicroPipeline(min_fuse_bytes=0):  # every matmul deferred: the engine's frames run
        with torch.compiler.set_stance("default"):
            got = f(x, w)
    assert torch.equal(got, torch.relu(x @ w) + 1)
    assert backend.counts() == (0, 0)
