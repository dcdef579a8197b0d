"""``EagerMicroPipeline``: micro-pipelined tensor parallelism at run time.

The mode starts every all-gather on a group it manages where the program
issues it and hands the program a placeholder that the transfer fills, and
defers every matmul until the next op shows what it feeds (collectives too
small to gain, and matmuls that could only feed those, run at once: Note [Size
rule]). Matmuls on a gather in flight bind to it and run chunk by chunk as the
chunks land; a matmul (or a sum of matmuls) whose output is reduce-scattered
becomes the reduce-scatter's producer. A read of a pending tensor completes
only what it needs; ``flush()`` and leaving the block complete everything
(Note [Deferral boundary] in ``eagertp.deferred``)::

    >>> with EagerMicroPipeline() as pipe:
    ...     x = funcol.all_gather_single(x_shard, 0, tp_group)    # starts moving now
    ...     q, k, v = x @ wq, x @ wk, x @ wv                      # bound to the gather
    ...     y = attention(q, k, v)                                # ONE fused call
    ...     out = funcol.reduce_scatter_single(y @ wo, "sum", 0, tp_group)  # fused
    >>> print(pipe.explain())
    all_gather #0 f32[1024, 512] -> f32[2048, 512] on group '1' (2 ranks): fused with mm -> $1, mm -> $2, mm -> $3 [ring]
    reduce_scatter(sum) #0 f32[2048, 512] -> f32[1024, 512] on group '1' (2 ranks): fused with mm -> $5 [ring]

The mode lives on the dispatch-mode stack of the thread that entered it
(``TorchDispatchMode`` state is thread-local): ops from other threads are not
seen. One instance is active at most once at a time; nested blocks need
separate instances, and the inner one sees ops first.

Note [Compiled code inside the block]
-------------------------------------
Dynamo refuses to compile a frame while a (non-infra) dispatch mode is active,
and that refusal sticks to the code object: a ``torch.compile``'d function
first called inside the block would run uncompiled ever after, until
``torch._dynamo.reset()``. So the block sets the compiler's stance to
``"force_eager"`` (``torch.compiler.set_stance``) while it is active: compiled
functions and modules called inside run eagerly, their ops seen and fused like
any others, and Dynamo never looks at them; after the block the previous stance
is back and they run compiled (from their cache, or compiled on that first call
outside). The stance is process-wide, not per-thread: while a block is active,
compiled code on other threads runs eagerly too; blocks entered on several
threads at once restore stances in their own order.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist

from eagertp._format import group_str
from eagertp.engine import Engine
from eagertp.verify import VerificationError
from eagertp.mode import EagerTPMode

__all__ = ["EagerMicroPipeline", "VerificationError"]

log = logging.getLogger(__name__)


class EagerMicroPipeline:
    """Fuse all-gather + matmul and matmul + reduce-scatter at run time, with no
    compile step.

    Args:
        group: manage only collectives on this process group (e.g. the TP group,
            so FSDP's all-gathers pass through untouched). Default: every group.
        backend: ``"auto"`` (``"symm_mem"`` for CUDA tensors where torch's
            symmetric-memory primitives exist, else ``"ring"``), ``"ring"``
            (micro-pipeline over point-to-point ops, any process group),
            ``"symm_mem"`` (CUDA symmetric memory; an error where it cannot run)
            or ``"reference"`` (plain collective then matmul).
        verify: check every collective against plain eager: first that every
            rank issues the same collective (shapes, dtype), naming each rank's
            if not; then, when it completes, that its results equal plain
            eager's, raising ``VerificationError`` naming the op, shapes and
            difference if not. Costs extra collectives; for debugging.
        poison: fill every placeholder with NaN when it is made (debugging: an
            unfilled placeholder that escaped would show up as NaN).
        min_fuse_bytes: fuse a collective only if its per-rank buffer (the
            all-gather's shard, the reduce-scatter's output) has at least this
            many bytes; smaller ones are not deferred but issued as the program
            wrote them, and ``explain()`` says so. Default (``None``): per device,
            ``eagertp.backends.MIN_FUSE_BYTES`` (on CPU, measured: 1 MiB for
            all-gathers, 512 KiB for reduce-scatters; 0 on CUDA). ``0`` fuses
            every size. A dict sets it per kind (``{"all_gather": ...,
            "reduce_scatter": ..., "all_reduce": ...}``, as ``calibrate_min_fuse_bytes`` returns
            it); a kind left out keeps its default.
        trace: record the ordered trace of what the mode did (every deferred
            matmul, wait and flush, with short tensor ids) for ``debug_string()``.
            Off by default: it costs host time on every call (Note [The ordered
            trace when asked] in ``eagertp.trace``); ``explain()`` and ``stats``
            are kept either way.
        max_records: bound on the trace and ``explain()`` records kept.

    Attributes:
        stats: counters. ``all_gather_matmul``, ``matmul_reduce_scatter``
            and ``matmul_all_reduce`` (fused calls; Note [Matmul + all-reduce]), ``fused_matmuls`` (matmuls inside the fused
            all-gathers), ``fused_scale_gathers`` (all-gathers of row-wise FP8
            scales that fed a fused call's ``_scaled_mm`` calls chunk by chunk:
            Note [Gathered row-wise scales]), ``overlapped_all_gather`` (no matmul consumed it, but
            matmuls ran while it was in flight: a prefetch kept),
            ``unfused_all_gather`` (overlapped nothing),
            ``unfused_reduce_scatter`` and ``unfused_all_reduce``, each not fused with a reason in
            ``explain()``; ``matmul_all_gather`` (gathers whose shard the
            product made piece by piece as it was sent: Note [Matmul + all-gather]);
            ``rowwise_ops`` (ops run row by row on gathers' chunks: Note [Row-wise
            ops on gathered rows]); ``unseen_operations`` (communication on a
            managed group the mode did not see: Note [Collectives the mode did
            not see]).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        verify: bool = False,
        poison: bool = False,
        min_fuse_bytes: int | Mapping[str, int] | None = None,
        trace: bool = False,
        max_records: int = 10_000,
    ) -> None:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"EagerMicroPipeline(group=...) takes a torch.distributed.ProcessGroup "
                f"or None, got {type(group).__name__}; for a DeviceMesh pass "
                f"mesh.get_group('tp')"
            )
        self._engine = Engine(
            group=group,
            backend=backend,
            verify=verify,
            poison=poison,
            min_fuse_bytes=min_fuse_bytes,
            max_records=max_records,
            trace=trace,
        )
        self._mode: EagerTPMode | None = None
        self._stance: contextlib.AbstractContextManager | None = None

    # -- context manager ---------------------------------------------------

    def __enter__(self) -> EagerMicroPipeline:
        if self._mode is not None:
            raise RuntimeError(
                "EagerMicroPipeline is already active; nest a new instance instead "
                "of re-entering this one"
            )
        self._engine.reset()
        # Note [Compiled code inside the block]: applied at construction; its
        # __exit__ puts back the stance it replaced.
        stance = torch.compiler.set_stance("force_eager")
        try:
            mode = EagerTPMode(self._engine)
            mode.__enter__()
        except BaseException:
            stance.__exit__(None, None, None)
            raise
        self._stance, self._mode = stance, mode
        self._engine.mode = mode
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        mode, self._mode = self._mode, None
        stance, self._stance = self._stance, None
        assert mode is not None and stance is not None, "__exit__ without __enter__"
        self._engine.mode = None  # break the engine <-> mode cycle
        try:
            # NB: leave the mode first: what the last flush issues then dispatches
            # straight to outer modes and kernels, not through our own pass-through.
            mode.__exit__(None, None, None)
        finally:
            stance.__exit__(None, None, None)
        completed = False
        try:
            reason = "block exited" if exc is None else f"block exited by {exc_type.__name__}"
            self._engine.flush(reason)
            self._engine.check_unseen()  # Note [Collectives the mode did not see]
            completed = exc is None
        except Exception:
            if exc is None:
                raise
            # The block's own exception is the one the user must see.
            log.exception("eagertp: flush while leaving the block after %r failed", exc)
        finally:
            self._engine.unseen.reset()  # NB: holds no group between blocks
            self._engine.end_block(completed)  # Note [Deferrals that gained nothing] in eagertp.deferring

    # -- public API --------------------------------------------------------

    def flush(self) -> None:
        """Complete everything pending now (fused where a pattern matched)."""
        self._engine.flush("flush() called")

    def explain(self, *, summary: bool = False) -> str:
        """One line per all-gather / reduce-scatter / all-reduce: what it fused
        with, or why not; inside the block, gathers still in flight say so.
        ``summary=True``: one line per kind of collective and what became of
        it, with its count (for loops over many steps or tokens). ``hint:``
        lines follow where the plan issued collectives the step did not
        need: a shard gathered again while a gather of it was in flight, or
        all-reduced tensors added to each other (Note [One shard gathered
        twice], Note [Sums of all-reduced tensors] in eagertp.trace).
        Collectives on groups the pipeline does not manage (``group=``) are
        counted, a line per op and group, after the rest."""
        group = self._engine.group
        return self._engine.trace.explain(summary=summary, managed=None if group is None else group_str(group))

    def debug_string(self) -> str:
        """The ordered trace, with short stable tensor ids (``$0``) and shapes;
        recorded under ``EagerMicroPipeline(trace=True)`` only (a
        ``RuntimeError`` says so otherwise)."""
        return self._engine.trace.debug_string()

    @property
    def stats(self) -> collections.Counter[str]:
        return self._engine.stats

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._engine.group

    @property
    def verify(self) -> bool:
        return self._engine.verify

    @property
    def backend(self) -> str:
        return self._engine.backend.name
