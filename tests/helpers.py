"""Inputs and probes shared by the multi-rank tests (imported inside workers)."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode

from eagertp._compat import cpu_scaled_mm_takes_rowwise_scales, funcol_all_gather, funcol_reduce_scatter

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
FP8 = torch.float8_e4m3fn


def integer_tensor(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers: every matmul over them is exact, so fused == eager bitwise.
    Drawn on the CPU, placed on the default device (``with torch.device("cuda")``
    runs a worker on a GPU: tests/test_cuda.py)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g, device="cpu").to(torch.get_default_device(), dtype)


class _CorruptedGather:
    """A ring gather's handle whose consume() then corrupts one element of the
    gathered tensor. A wrapper, not ``consume`` replaced by a closure over the
    handle's own method: that would be a reference cycle of the test's making."""

    def __init__(self, handle, out: torch.Tensor, corrupt: bool) -> None:
        self._handle, self._out, self._corrupt = handle, out, corrupt

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def consume(self, consumer, **kwargs) -> None:
        self._handle.consume(consumer, **kwargs)
        if self._corrupt:
            self._out.view(-1)[0] += 1


def corrupt_rank0_gathers(pipe) -> None:
    """``pipe``'s ring, then one wrong element in rank 0's copy of every
    gathered tensor: ``verify=True`` must catch it."""
    from eagertp.backends.ring import RingBackend

    class CorruptingRing(RingBackend):
        def start_all_gather(self, shard, ag_out, group):
            return _CorruptedGather(super().start_all_gather(shard, ag_out, group), ag_out, group.rank() == 0)

    pipe._engine.backend._instances["ring"] = CorruptingRing()  # what "auto" picks for CPU tensors


def left_in_cycles(fn, *, tensors: bool = True):
    """``fn()``'s result, and the objects of eagertp's (and, with ``tensors``,
    the tensors) it left in reference cycles, by type name: what Python's
    garbage collector finds unreachable right after it, saved instead of freed
    (Note [Freed without the garbage collector] in eagertp/deferred.py)."""
    import gc

    # NB: what exists already is frozen, out of every collection until the end:
    # only what fn() makes is looked at, and a collection costs what fn() made,
    # not the whole heap's tens of milliseconds (torch's objects).
    gc.freeze()
    debug = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = fn()
        gc.collect()
        left = collections.Counter(
            type(o).__qualname__ for o in gc.garbage  # NB: type(): isinstance() of a dead weakref proxy raises
            if type(o).__module__.startswith("eagertp") or (tensors and issubclass(type(o), torch.Tensor))
        )
    finally:
        gc.garbage.clear()
        gc.set_debug(debug)
        gc.collect()  # NB: frees what it saved: clearing gc.garbage leaves the cycles themselves
        gc.unfreeze()
    return result, dict(left)


def fp8_tensor(shape, seed: int) -> torch.Tensor:
    """Integer values in FP8 (exact: |v| <= 448 and few bits)."""
    return integer_tensor(shape, torch.float32, seed=seed).to(FP8)


def col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()  # _scaled_mm wants B column-major


def fp8_scales(kind: str, m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_scaled_mm``'s scales: tensor-wise, or row-wise (scale_a per row of A
    [M, 1], scale_b per column of B [1, N]), powers of two so products stay exact."""
    if kind == "tensorwise":
        return torch.tensor(1.0), torch.tensor(2.0)
    g = torch.Generator().manual_seed(seed)
    scale_a = 2.0 ** torch.randint(-1, 2, (m, 1), generator=g, device="cpu").float()
    scale_b = 2.0 ** torch.randint(-1, 2, (1, n), generator=g, device="cpu").float()
    return scale_a.to(torch.get_default_device()), scale_b.to(torch.get_default_device())


def random_tensor(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, device="cpu").to(torch.get_default_device(), dtype)


def all_gather(x: torch.Tensor, group, gather_dim: int = 0) -> torch.Tensor:
    return funcol_all_gather(x, gather_dim, group)


def reduce_scatter(x: torch.Tensor, group, reduce_op: str = "sum", scatter_dim: int = 0) -> torch.Tensor:
    """funcol's reduce-scatter, waited: workers return plain tensors to the test."""
    out = funcol_reduce_scatter(x, reduce_op, scatter_dim, group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def all_reduce(x: torch.Tensor, group, reduce_op: str = "sum") -> torch.Tensor:
    """funcol's all-reduce, waited."""
    out = funcol.all_reduce(x, reduce_op, group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A new CPU ``DeviceMesh`` (new groups), for a job whose DTensors must
    run on it. NB: DTensor caches sharding decisions by mesh, and meshes of
    one layout and dim names compare equal whatever their groups (torch 2.13;
    so do the ``"tp"`` submeshes of a ``("dp", "tp")`` and a ``("pp", "tp")``
    mesh): in a worker that ran an earlier job, some DTensor outputs would
    land on that job's mesh and their collectives on its groups, which
    ``EagerMicroPipeline(group=...)`` does not manage. So the caches are
    cleared first, as torch's debug helper does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


@contextlib.contextmanager
def async_wrapper_ops() -> Iterator[list[str]]:
    """The names of the ops that reach funcol's ``AsyncCollectiveTensor.__torch_dispatch__``
    (its own Python: Note [Pending async tensors] in eagertp.mode), in order."""
    seen: list[str] = []
    original = funcol.AsyncCollectiveTensor.__torch_dispatch__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(func.__name__)
        return original(cls, func, types, args, kwargs)

    with mock.patch.object(funcol.AsyncCollectiveTensor, "__torch_dispatch__", classmethod(counting)):
        yield seen


def fusion_report(pipe, counter: OpCounter, plain: PlainCollectives | None = None) -> dict:
    """What a worker returns so the test can prove which path ran (and, given
    the ``PlainCollectives`` of its plain eager run, that explain() accounts
    for each collective plain eager issued: ``collectives_seen``)."""
    return {
        "stats": dict(pipe.stats),
        "plain_all_gathers": counter.unfused_all_gathers,
        "plain_reduce_scatters": counter.unfused_reduce_scatters,
        "p2p_ops": counter.p2p,
        **({} if plain is None else {"collectives_seen": (collectives_seen(plain), collectives_seen(pipe))}),
    }


class OpCounter(TorchDispatchMode):
    """Counts every op that reaches it. Entered *outside* EagerMicroPipeline, it
    sees what eagertp actually issued: its point-to-point ring and the plain ops
    it let through, never the collectives it deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.collectives: list[str] = []  # communication ops, in issue order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        if func.namespace in ("c10d", "_c10d_functional") and not str(func).split(".")[1].startswith(("wait", "_wrap")):
            self.collectives.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))

    @property
    def unfused_all_gathers(self) -> int:
        return self.counts["_c10d_functional.all_gather_into_tensor.default"] + self.counts[
            "c10d._allgather_base_.default"
        ]

    @property
    def unfused_reduce_scatters(self) -> int:
        return self.counts["_c10d_functional.reduce_scatter_tensor.default"] + self.counts[
            "c10d._reduce_scatter_base_.default"
        ]

    @property
    def p2p(self) -> int:
        return self.counts["c10d.send.default"] + self.counts["c10d.recv_.default"]

    @property
    def matmuls(self) -> int:
        """Every mm and addmm (in place and out= too): one per piece a consumer or producer ran."""
        return sum(n for op, n in self.counts.items() if op.startswith(("aten.mm", "aten.addmm")))


class GroupOpCounter(OpCounter):
    """OpCounter that also records each collective's process group (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_group: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch.distributed as dist

        if func.namespace in ("c10d", "_c10d_functional"):
            name = str(func).split(".")[1]
            if not name.startswith(("wait", "_wrap")):
                group = "?"
                for a in (*args, *(kwargs or {}).values()):
                    if isinstance(a, torch.ScriptObject):  # c10d ops take the group boxed
                        with contextlib.suppress(RuntimeError):  # or a ReduceOp
                            group = dist.ProcessGroup.unbox(a).group_name
                    elif isinstance(a, dist.ProcessGroup):
                        group = a.group_name
                    elif isinstance(a, str) and func.namespace == "_c10d_functional":
                        group = a
                self.by_group[(group, name)] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def with_small_pieces(rank, group, worker, *args):
    """Run ``worker`` with the ring splitting every chunk of every collective
    into up to 4 pieces of one byte or more, so that small test shapes exercise
    the piecewise pipelines, their consumers and producers."""
    from eagertp.backends import ring

    saved = dict(ring.PIECES)
    ring.PIECES.update({kind: (4, 1) for kind in ring.PIECES})
    try:
        return worker(rank, group, *args)
    finally:
        ring.PIECES.update(saved)


# A test or case that runs CPU ``_scaled_mm`` with row-wise scales (torch 2.12 on).
NEEDS_ROWWISE_SCALED_MM = pytest.mark.skipif(
    not cpu_scaled_mm_takes_rowwise_scales(), reason="this torch's CPU _scaled_mm takes tensor-wise scales only"
)
ROWWISE_SCALES = pytest.param("rowwise", marks=NEEDS_ROWWISE_SCALED_MM)


def explained_kind(name: str) -> bool:
    """True if explain() accounts for the c10d or funcol op ``name``
    (Invariant 4: every all-gather, reduce-scatter and all-reduce, on a
    managed group or passed through): ``all_reduce``, ``_allgather_base_``, ..."""
    return name.lstrip("_").startswith(("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce"))


class PlainCollectives(TorchDispatchMode):
    """Lists the all-gathers, reduce-scatters and all-reduces plain eager
    issues, after tensor subclasses desugar (DTensor's, torchao's: their ops
    come back here on the plain tensors inside), in issue order."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[str] = []

    def __enter__(self):
        self.collectives = []  # per block, as explain() is
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        if any(t is not torch.Tensor and not issubclass(t, (torch.nn.Parameter, FakeTensor, FunctionalTensor)) for t in types):
            return NotImplemented  # the subclass desugars first
        if not any(issubclass(t, FakeTensor) for t in types) and func.namespace in ("c10d", "_c10d_functional"):
            name = func.__name__.split(".")[0]
            if explained_kind(name):
                self.collectives.append(name)
        return func(*args, **(kwargs or {}))


def explained_collectives(pipe) -> int:
    """How many collectives ``pipe.explain()`` accounts for: a line each, and
    those on groups it does not manage counted on their lines."""
    trace = pipe._engine.trace
    return len(trace.collectives) + trace.dropped + sum(trace.passed_through.values())


def collectives_seen(ctx) -> int:
    """The all-gathers, reduce-scatters and all-reduces of ``ctx``'s last
    block: those plain eager issued (``PlainCollectives``), or those the
    pipeline's explain() accounts for."""
    return len(ctx.collectives) if isinstance(ctx, PlainCollectives) else explained_collectives(ctx)


def against_plain_eager(program, **pipe_kwargs) -> dict:
    """``program()`` (a list of tensors) in plain eager, then inside an
    ``EagerMicroPipeline(**pipe_kwargs)``: what a worker returns so the test
    can check the answers, the path that ran, and that explain() accounts for
    each collective plain eager issued (``collectives_seen``)."""
    from eagertp import EagerMicroPipeline

    with PlainCollectives() as plain:
        expected = program()
    with EagerMicroPipeline(**pipe_kwargs) as pipe:
        got = program()
    return {
        "equal": [torch.equal(g, e) for g, e in zip(got, expected)],
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
        "collectives_seen": (collectives_seen(plain), collectives_seen(pipe)),
    }
