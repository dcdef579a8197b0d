"""The deferral engine: gathers in flight, pending matmuls, and what completes them.

``Engine`` holds one ``EagerMicroPipeline``'s state (the pending store, the
trace, the counters, the backend choice) and the operations the op handlers
call: start a gather, defer a matmul (as a gather's consumer or standalone),
complete what a read needs, and flush everything. Note [Deferral boundary] in
``eagertp.deferred`` says when each happens. The handlers
(``eagertp.collectives``, ``eagertp.matmuls``) turn ops into these calls; the
reduce-scatter and all-reduce families run their fused collectives in their own
modules with the engine's small surface for them (``choose_backend``,
``add_gather``, ``gather_reference``, ``issue_as_is``, ``new_record``,
``profiler_range``). The public class (``eagertp.pipeline``) owns the engine;
the engine imports no family.

What the engine reads, split by concern: ``eagertp.op_facts`` (what an op
writes and reads, from its schema), ``eagertp.operands`` (which gather in
flight a matmul consumes, and how), ``eagertp.verify`` (``verify=True``'s
checks), ``eagertp.deferred`` (the pending records and their store).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from eagertp._format import dtype_str, group_str
from eagertp import rowwise
from eagertp.backends import Backend, BackendChoice
from eagertp.backends.base import all_gather_consume
from eagertp.backends.reference import ReferenceBackend
from eagertp.deferred import (
    GatheredView,
    Operand,
    Pending,
    PendingCast,
    PendingGather,
    PendingMatmul,
    PendingPointwise,
    PendingStore,
    PendingSum,
    Product,
    Scaled,
    ScatterView,
    is_weight_gradient,
    operand_str,
    orphaned_storages,
    storage_key,
    storage_uses,
    tensor_leaves,
    tensors_in,
)
from eagertp.patterns import AllGatherMatmulPlan, gather_signature, gathered_product, shard_producer
from eagertp.op_facts import OP_FACTS, OpFacts, op_facts, written_tensors
from eagertp.operands import match_gather_operand, matmul_out_dtype, same_views
from eagertp.trace import CollectiveRecord, Meta, Reason, Text, Trace, metas_of
from eagertp.unseen import Unseen
from eagertp.verify import check_equal, check_ranks_agree

log = logging.getLogger(__name__)

# Bytes per element of the widest output a fused reduce-scatter takes from a
# matmul: float32, also after autocast's cast of a half-precision one. (A cast
# to float64 of a matmul small by this bound is issued unfused: still right.)
_WIDEST_CAST = 4


class Engine:
    """Pending work of one ``EagerMicroPipeline`` and the operations on it."""

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        backend: str,
        verify: bool,
        poison: bool,
        min_fuse_bytes: int | Mapping[str, int] | None,
        max_records: int,
        trace: bool,
    ) -> None:
        self.group = group
        self.verify = verify
        self.poison = poison
        self.stats: collections.Counter[str] = collections.Counter()
        self.backend = BackendChoice(backend, min_fuse_bytes)
        self.max_records = max_records
        self.trace = Trace(max_records=max_records, events=trace)
        self.store = PendingStore()
        # The dispatch mode while the block is active (composite ops re-enter it).
        self.mode: Any = None
        # True while the engine issues work: its own ops pass through the mode.
        self.issuing = False
        # Matmuls run or computed so far (Note [Overlap accounting]).
        self.matmul_work = 0
        # device type -> the smallest matmul output (bytes) a fused collective
        # could take; read per block (MIN_FUSE_BYTES may change between blocks).
        self._deferral_bytes: dict[str, int] = {}
        # The latest trace id recorded before the latest collective on a managed
        # group: products up to it are past their collective (Note [Products past their collective]).
        self.before_collective = -1
        # Communication on managed groups the mode did not see (Note [Collectives
        # the mode did not see] in eagertp.unseen).
        self.unseen = Unseen()

    def reset(self) -> None:
        self.stats.clear()
        self.trace = Trace(max_records=self.max_records, events=self.trace.recording)
        self.store.reset()
        self.matmul_work = 0
        self._deferral_bytes.clear()
        self.before_collective = -1
        self.unseen.reset()

    def never_fused(self, rows: int, cols: int, device_type: str) -> bool:
        """True if a product of ``rows x cols`` is too small for any reduce-
        scatter or all-reduce of it to fuse: run at once, not deferred, while
        nothing is pending (Note [Deferral boundary])."""
        nbytes = self._deferral_bytes.get(device_type)
        if nbytes is None:  # the smallest matmul output (bytes) a fused collective could take
            nbytes = self._deferral_bytes[device_type] = min(
                self.backend.min_bytes(device_type, "reduce_scatter"),
                self.backend.min_bytes(device_type, "all_reduce"),
            )
        return rows * cols * _WIDEST_CAST < nbytes

    def managed_group(self, func, group_size: int, group_name: Any) -> dist.ProcessGroup | None:
        """The collective's group if the mode manages it, else None (it passes
        through; what is in flight stays in flight)."""
        # NB: isinstance(x, ProcessGroup) is a Python __instancecheck__; funcol passes a name.
        group = c10d._resolve_process_group(group_name) if isinstance(group_name, str) else group_name
        if self.group is not None and group.group_name != self.group.group_name:
            self.trace.pass_through(func, group_str(group))
            return None
        found = self.unseen.check(group)
        if found:
            self.record_unseen(found)
        if group_size != group.size():
            raise ValueError(
                f"{func}: group_size={group_size} but {group_str(group)} has "
                f"{group.size()} ranks; pass the group's size"
            )
        return group

    def check_unseen(self) -> None:
        """Before eagertp communicates: what ran on the watched groups unseen
        since their counts were last known (Note [Collectives the mode did not
        see] in eagertp.unseen)."""
        if self.unseen.known:
            found = self.unseen.check_all()
            if found:
                self.record_unseen(found)

    def record_unseen(self, found: list[tuple[int, str]]) -> None:
        """explain()'s lines and the stats for communication the mode did not
        see (Note [Collectives the mode did not see] in eagertp.unseen)."""
        for n, line in found:
            self.trace.unseen.append(line)
            self.stats["unseen_operations"] += n

    def issuing_work(self) -> _IssuingWork:
        """``with engine.issuing_work():`` Note [Issuing work]."""
        return _IssuingWork(self)

    # -- completing pending work -------------------------------------------

    def run_plain(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """Run an op no handler fuses, after completing the pending work it
        reads (or all of it, if it writes an input of pending work)."""
        if self.store.items:
            facts = OP_FACTS.get(func._op) or op_facts(func)
            tensors = tensor_leaves(args, kwargs)
            first = self.store.touched(tensors)
            if first is not None:
                if facts.composite:
                    return self.decompose(func, args, kwargs)
                if facts.metadata_only:  # NB: a view of pending work stays pending (no row-wise op is one)
                    return func._op(*args, **kwargs)
                why = None
                if func._op in rowwise.ANY_RULE:  # NB: a row-wise op reads gathered rows, so pending ones
                    result, why = rowwise.defer(self, func, args, kwargs, tensors)
                    if why is None and result is not None:
                        return result
                    first = None  # NB: asked again: the attempt may have completed work
                self._complete_for(func, args, kwargs, facts, tensors, why, first)
            elif facts.written:  # NB: else it neither reads nor writes pending work (most ops)
                written = written_tensors(func, args, kwargs)
                if written:  # NB: it reads none, and completing work makes nothing pending
                    self.before_write(func, written, owners=False)
        return func._op(*args, **kwargs)  # NB: OpOverload.__call__ is a Python frame

    def decompose(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """Run a composite op as its decomposition, whose ops reach the mode.

        NB: composite ops (linear, matmul) reach the mode whole only where
        autograd is off (``inference_mode``: everywhere else autograd's key
        decomposes them first); their decomposition (view -> mm ->
        _unsafe_view) is what the handlers understand. The mode is off while
        it handles an op: re-entered here, so the decomposed ops come back."""
        assert self.mode is not None, f"eagertp: {func} dispatched outside the block"
        with self.mode:
            result = func.decompose(*args, **kwargs)
        if result is NotImplemented:  # no composite kernel: run it whole
            self.complete_for(func, args, kwargs)
            return func(*args, **kwargs)
        return result

    def complete_for(
        self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, not_rowwise: str | None = None
    ) -> None:
        """Complete what ``func`` needs: the pending items it reads (a view op
        reads nothing), or everything if it writes an input of pending work;
        first, if it writes the shard of gathers in flight, their sends.
        ``not_rowwise``: why the op, in the table of row-wise ops, does not
        run on the rows it reads (the reason says so)."""
        self._complete_for(func, args, kwargs, op_facts(func), tensor_leaves(args, kwargs), not_rowwise)

    def _complete_for(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        facts: OpFacts,
        tensors: list[torch.Tensor],
        not_rowwise: str | None,
        first: torch.Tensor | None = None,
    ) -> None:
        """``complete_for``, given the op's facts, its tensor arguments and,
        if the caller knows it, the first that is pending."""
        if facts.written:
            written = written_tensors(func, args, kwargs)
            if written:
                # NB: the owners of what it writes are among what it reads, below.
                self.before_write(func, written, owners=False)
                first = None  # NB: asked again: that completed work
        if first is None:
            first = self.store.touched(tensors)
        if first is not None and not facts.metadata_only:
            why = None if not_rowwise is None else f"read ${self.store.tid_of(first)}, not row by row: {not_rowwise}"
            self.complete_owners(tensors, func, why, first=first)

    # Note [Every write is seen]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Pending work reads its inputs, and a gather in flight writes its
    # placeholder, later than the program point that issued it. So before any
    # op writes memory (Invariant 9), by storage, which covers every view and
    # alias of it (Megatron's global buffer hands out views of one storage in
    # several shapes, and gathers into it layer after layer):
    #
    # - the pending items that read it complete (``PendingStore.readers``: the
    #   inputs of standalone products and of a gather's consumers);
    # - the pending item that owns it completes: a gather in flight into the
    #   program's own buffer, or a product's placeholder. A new collective into
    #   a buffer a gather in flight still fills waits its turn, in program
    #   order. Not where the op itself takes the product in (an all-reduce in
    #   place of a pending product fuses with it);
    # - gathers in flight that send from it stop sending first, and stay
    #   pending (Note [Sends from the shard]).
    #
    # Unrelated pending work stays pending. What writes: an op no handler takes
    # says so in its schema (in place, ``out=``, ``copy_``, ``set_``,
    # ``resize_``, ``_foreach_*_``) or is a c10d in-place collective, whose
    # schemas do not (``written_tensors``): ``complete_for``. The handlers that
    # write call ``before_write`` themselves: raw c10d's all-gather and
    # reduce-scatter outputs (``eagertp.collectives.c10d``), the all-reduce in
    # place (``eagertp.collectives.all_reduce``). A handler's path that issues
    # the collective as written goes through ``complete_for``. Every other
    # handler writes nothing: matmuls, funcol's out-of-place collectives,
    # views, ``cat``, ``add``, ``_to_copy`` return new tensors.
    # tests/test_buffer_reuse.py draws programs that reuse buffers so.

    def before_write(
        self, func: Any, written: Sequence[torch.Tensor], *, owners: bool = True, takes: torch.Tensor | None = None
    ) -> None:
        """Complete what must come before ``func`` writes ``written`` (Note
        [Every write is seen]): the pending work that reads them, and, with
        ``owners``, the pending items whose placeholders they are. ``takes``:
        the collective's input, which it fuses with the product that makes it,
        so that product stays pending (not computed as work in flight while
        they complete), unless it reads or fills what is written."""
        store = self.store
        if not store.items:
            return
        if store.sending:
            self.release_shards(func, written)
        readers = store.readers(written)
        filled = store.owners(written) if owners else []
        # NB: the collective's own product stays pending only if it neither
        # reads nor fills what is written: else it completes first, unfused.
        keep = [p for p in store.owners([takes]) if p not in readers and p not in filled] if takes is not None else []
        if readers or filled:
            found = {id(item) for item in (*readers, *filled)}
            items = [item for item in store.items if id(item) in found]
            keys = {storage_key(t) for t in written}
            what = [f"what ${tid} reads" for item in readers for tid in _reading(item, keys)]
            what += [f"${item.tid}'s buffer" for item in filled]
            reason = Reason("{} writes {}", func, " and ".join(what))
            if self.trace.recording:
                self.trace.event("wait: {}", reason)
            self.complete(items, reason, keep=keep)

    # Note [Sends from the shard]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The ring sends a gather's shard from the program's tensor itself, so the
    # first piece leaves at once; this rank's chunk of the result is copied
    # while it travels. (Copying first delayed the first send by about 0.3 ms
    # per 2 MiB under load, benchmarks/NOTES.md.) The program may still
    # overwrite the shard as soon as the gather is issued, so every op that
    # writes a tensor (in place, out=, an in-place collective) first waits for
    # the sends from the gathers in flight whose shard shares its storage
    # (``PendingStore.sending``), and only those: the gathers stay in flight
    # and their consumers pending. The trace says so ("wait: ... wrote the
    # shard of $i"). Writes no op shows the mode (another thread, .data under
    # no_dispatch) are the program's race, as they are with plain eager's async
    # collectives on NCCL.

    # Note [This rank's chunk, unread]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # This rank's chunk of a gathered tensor is a copy of its shard, made on
    # the caller's thread (gloo's own all-gather makes it on its worker
    # thread): about 0.5 ms per 2 MiB with the other core busy, 3% of a fused
    # call at N=256 (benchmarks/NOTES.md). Often nothing reads it: the program
    # dropped the gathered tensor once its matmuls were issued (`AG(x) @ w`,
    # backward's gradient gathers, which autograd releases once their node has
    # run). The ring therefore copies it when the gather is consumed, after the
    # consumer has read this rank's chunk from the shard itself, and only if
    # the engine says something may read it: unless the placeholder is
    # unreachable (``PendingGather.out_unreachable``: no Python reference but
    # the gather's own, no autograd holder, no weak reference, no tensor on
    # its storage made since the gather started), or verify compares it, or
    # it is a row-wise scale other consumers read. A write to the shard, or a
    # read of this rank's scale rows, copies it first (``release_shard``,
    # ``wait_chunk``). The test is conservative: any holder it cannot account
    # for means a copy. (The >2-rank ring on gloo still copies at the start:
    # its helper thread posts receives into the placeholder as it goes, so
    # the storage test could never pass there.)

    def release_shards(self, func: torch._ops.OpOverload, written: Sequence[torch.Tensor]) -> None:
        """Before ``func`` writes ``written``, the shard of gathers in flight
        among them: wait until they send from it no more, and leave them
        pending (Note [Sends from the shard])."""
        for t in written:
            for gather in list(self.store.sending_from(t)):
                self.trace.event("wait: {} wrote the shard of ${}: its sends complete first", func, gather.tid)
                with self.issuing_work():
                    gather.handle.release_shard()
                self.store.stop_sending(gather)

    def complete_owners(
        self, tensors: Sequence[torch.Tensor], func: Any, why: str | None = None, *, first: torch.Tensor | None = None
    ) -> None:
        """Complete the pending items that own any of ``tensors``, and only
        those; ``why`` says how ``func`` reads them (default: "read $id" of
        the first pending one, ``first`` if the caller knows it)."""
        owners = self.store.owners(tensors)
        if owners:
            if why is None:
                if len(owners) == 1 and not isinstance(owners[0], PendingGather):
                    tid = owners[0].tid  # NB: a product's placeholders have its id: the read of one, no lookup
                else:
                    tid = self.store.tid_of(self.store.touched(tensors) if first is None else first)
                reason = Reason("{} read ${}", func, tid)
            else:
                reason = Reason("{} {}", func, why)
            if self.trace.recording:
                self.trace.event("wait: {}", reason)
            self.complete(owners, reason)
            if self.store.items:
                self.complete_orphaned_weight_gradients(func)

    def complete_work_past(self, func: Any, mark: int) -> None:
        """Everything Note [Products past their collective] computes or drops
        early, before ``func``: the products recorded up to trace id ``mark``
        (-1: none), the weight gradients only pending work holds the inputs
        of, the absorbed products nothing can read."""
        # NB: on the hot path (every deferred matmul while work is pending):
        # the store's products listed once, nothing more when there are none.
        products = [p for p in self.store.items if not isinstance(p, PendingGather)]  # NB: _drop removes
        if not products:
            return
        past = []
        for product in products:
            if product.absorbed:
                if product.unobserved():
                    self._drop(product)
            elif product.tid <= mark:
                past.append(product)
        if past:
            self._complete_past(func, past)
        self.complete_orphaned_weight_gradients(func)

    def complete_before(self, func: Any, product: Product) -> None:
        """Compute the standalone products recorded before the pending ``product``
        that no collective took (Note [Products past their collective]): plain
        eager would have computed them, and freed their inputs, long ago."""
        if len(self.store.items) == 1:  # NB: the product alone: nothing before it
            return
        past = []
        for p in self.store.standalone(absorbed=False):  # NB: a loop: every fused reduce-scatter and all-reduce
            if p.tid < product.tid:
                past.append(p)
        if past:
            self._complete_past(func, past)

    def _complete_past(self, func: Any, past: list[Product]) -> None:
        reason = Reason("{}: ${} is past its collective", func, past[-1].tid)
        if self.trace.recording:
            self.trace.event("wait: {}", reason)
        self.complete(past, reason)

    def complete_orphaned_weight_gradients(self, func: Any) -> None:
        """Compute the pending weight gradients that read a storage nothing but
        pending work can reach (Note [Products past their collective])."""
        candidates, among = [], set()
        for p in self.store.items:  # NB: a loop: every deferred matmul while work is pending asks
            if not isinstance(p, PendingGather) and not p.absorbed and is_weight_gradient(p):
                keys = {storage_key(t) for t in p.inputs()}
                candidates.append((p, keys))
                among |= keys
        if not candidates:
            return
        orphans = orphaned_storages(self.store.items, among)
        ready = [p for p, keys in candidates if keys & orphans]
        if ready:
            reason = Reason("{}: ${} holds inputs nothing else can reach", func, ready[-1].tid)
            self.trace.event("wait: {}", reason)
            self.complete(ready, reason)

    def product_read(self, t: torch.Tensor) -> int | None:
        """The trace id of the standalone pending product ``t`` views, if any."""
        owner = self.store.owner(t)
        return None if owner is None or isinstance(owner, PendingGather) else owner.tid

    def _drop(self, product: Product) -> None:
        """Take out an absorbed product that nothing can read any more: a flush
        would skip it, and until then it holds its placeholders and inputs."""
        self.store.remove(product)
        self.trace.event("skip ${}: nothing can read it", product.tid)

    def flush(self, reason: str | Reason) -> None:
        """Complete every pending item, in record order."""
        if self.store.items:
            self.trace.event("flush: {}", reason)
            self.complete(list(self.store.items), reason)

    def complete(self, items: list[Pending], reason: str | Reason, *, keep: Sequence[Pending] = ()) -> None:
        """Complete ``items`` (record order): each gather with the consumers bound
        to it, each product computed (or skipped if nothing can read it).
        ``keep``: products not to compute as work in flight, although they are
        (the input of the collective that completes these items, which takes it)."""
        for item in items:
            if isinstance(item, PendingGather):
                with _IssuingWork(self):  # NB: issuing_work(), one frame shorter
                    failure = self._complete_items(self._with_work_in_flight(items, keep), items, reason)
                break
        else:
            # NB: the hot path, a read of products: nothing to order, and nothing
            # communicates (no watch of unseen communication, Note [Collectives
            # the mode did not see]): only placeholders filled below autograd,
            # as issuing_work() fills them.
            was_issuing, self.issuing = self.issuing, True
            try:
                with torch._C._AutoDispatchBelowADInplaceOrView():
                    failure = self._complete_items(items, items, reason)
            finally:
                self.issuing = was_issuing
        if failure is not None:
            raise failure

    def _complete_items(self, ordered: list[Pending], items: list[Pending], reason: str | Reason) -> BaseException | None:
        """``complete``'s work on ``ordered`` (``items`` and the work in flight
        before their gathers). Completes every item even if one fails, so that
        no placeholder is left unfilled and no transfer half-received; returns
        the first failure, for the caller to raise."""
        failure: BaseException | None = None
        for item in ordered:
            if item not in self.store.items:
                continue  # completed earlier in this call, as work in flight
            if isinstance(item, PendingGather) and item.scale_of and self._data_gathers(item, items):
                continue  # completed right after them (Note [Gathered row-wise scales])
            self.store.remove(item)
            try:
                if isinstance(item, PendingGather):
                    self._complete_gather(item, reason)
                elif item.absorbed and item.unobserved():
                    # Its fused consumer already produced what it needed
                    # and nothing else can read it: computing it is waste.
                    self.trace.event("skip ${}: nothing can read it", item.tid)
                else:
                    self.count_matmul_work()
                    item.issue_standalone()
            except BaseException as e:  # noqa: B036 - returned, raised by the caller
                failure = failure or e
        return failure

    def _with_work_in_flight(self, items: list[Pending], keep: Sequence[Pending] = ()) -> list[Pending]:
        """``items``, each gather preceded by every standalone product still
        pending and not absorbed but those in ``keep``: the transfer hides
        behind them (Note [Work issued while a gather is in flight])."""
        if len(self.store.items) == 1:  # NB: the item alone (a read of one gather): nothing in flight
            return items
        ordered: list[Pending] = []
        products = self.store.standalone(absorbed=False)
        for item in items:
            if products and isinstance(item, PendingGather) and item in self.store.items:
                ordered += [p for p in products if p not in keep and (p.tid > item.tid or is_weight_gradient(p))]
            ordered.append(item)
        return ordered

    def _complete_scales(self, scales: list[PendingGather], reason: str | Reason) -> None:
        for scale in scales:
            self.store.remove(scale)
            self._complete_gather(scale, reason)

    def _data_gathers(self, scale: PendingGather, items: list[Pending]) -> bool:
        """True if ``scale`` is the row-wise scale of consumers of a gather among
        ``items`` still pending: that gather completes it."""
        return any(any(self.store.owner(mm.out) is item for item in items) for mm in scale.scale_of)

    def _complete_gather(self, gather: PendingGather, reason: str | Reason) -> None:
        # Scale gathers in flight that the consumers read row by row: waited for
        # per chunk inside the plan, completed right after (Note [Gathered row-wise scales]).
        scales = gather.scale_gathers()
        plan = AllGatherMatmulPlan(gather, [g for g in scales if g in self.store.items] if scales else [])
        whole = plan.lands_whole()
        if whole:  # the whole matmuls read whole scales: complete them first
            self._complete_scales(plan.scales, reason)
            plan.scales = []
        if plan.fused:
            self.count_matmul_work(len(gather.consumers))
        # Note [This rank's chunk, unread]: not where other gathers' row-wise
        # steps, or results over the rows, read it after the consumers.
        own_chunk_unread = (
            not (whole or self.verify or gather.scale_of or gather.read_by or gather.wholes)
            and gather.out_unreachable()
        )
        try:
            if torch.autograd._profiler_enabled():
                # NB: a chain of row-wise steps says so (Note [Row-wise ops on gathered rows]).
                with profiler_range(f"eagertp::{plan.name}{'+rowwise' if gather.steps else ''}"):
                    plan.run(whole=whole, own_chunk_unread=own_chunk_unread)
            else:  # NB: the hot path: no profiler, no context manager
                plan.run(whole=whole, own_chunk_unread=own_chunk_unread)
        except BaseException:
            gather.completed = True
            self._complete_scales(plan.scales, reason)
            raise
        gather.completed = True
        for step in gather.wholes:  # Note [Row-wise ops on gathered rows] in eagertp.rowwise
            step.run()
        if gather.steps or gather.wholes:
            self.stats["rowwise_ops"] += len(gather.steps) + len(gather.wholes)
        self._account_gather(gather, plan, reason)
        if plan.scales:
            self._complete_scales(plan.scales, reason)
        if self.verify:  # NB: after the scales: plain eager's matmuls read them whole
            for what, got, want, exact in plan.checks():
                check_equal(what, got, want, plan.group, exact=exact)

    def _count_fused(self, gather: PendingGather, plan: AllGatherMatmulPlan) -> None:
        self.stats[plan.name] += 1
        self.stats["fused_matmuls"] += len(gather.consumers)

    def _account_gather(self, gather: PendingGather, plan: AllGatherMatmulPlan, reason: str | Reason) -> None:
        """Stats, explain() record and trace event of a completed gather."""
        overlapped = self.matmul_work - gather.work_at_start
        if gather.half_of_all_reduce or gather.produced:
            # Accounted for where it was issued (Note [Matmul + all-reduce] in
            # eagertp.collectives.all_reduce, Note [Matmul + all-gather] in
            # eagertp.collectives.all_gather); only its consumers are new.
            if plan.fused:
                self._count_fused(gather, plan)
                gather.record.then_fused_with = plan.fused_with()
            elif gather.read_by:  # its rows read chunk by chunk by another gather's steps
                gather.record.then_fused_with = [step.describe() for step in gather.read_by]
            if self.trace.recording:
                self.trace.event(*plan.trace_event(gather.backend))
            return
        if gather.scale_of:
            self.stats["fused_scale_gathers"] += 1
        if plan.fused:
            self._count_fused(gather, plan)
            self.trace.mark_fused(gather.record, plan.fused_with(), gather.backend, scale_of=plan.scale_of())
        elif gather.scale_of:
            self.trace.mark_fused(gather.record, [], gather.backend, scale_of=plan.scale_of())
        elif overlapped:
            self.stats["overlapped_all_gather"] += 1
            why = Reason("no matmul consumed it before {}; {} ran while it was in flight", reason, _matmuls(overlapped))
            self.trace.mark_unfused(gather.record, _and_made_first(why, gather), gather.backend)
        else:
            self.stats["unfused_all_gather"] += 1
            why = Reason("no matmul consumed it before {}, and none ran while it was in flight", reason)
            self.trace.mark_unfused(gather.record, _and_made_first(why, gather), gather.backend)
        if self.trace.recording:
            self.trace.event(*plan.trace_event(gather.backend))

    # -- all-gather --------------------------------------------------------

    def placeholder(self, like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer that the pending work fills before anything can read it; with
        ``poison=True`` it starts as NaN (integers: the dtype's max) so a bug that
        let an unfilled one escape shows up in the results."""
        # NB: no dtype argument where it is like's: one fewer to parse, about 10% of
        # the call (benchmarks/NOTES.md, "2026-12-04 at 83dc4f9"; one per deferred op).
        out = like.new_empty(shape) if dtype is None or dtype is like.dtype else like.new_empty(shape, dtype=dtype)
        if self.poison:
            out.fill_(float("nan") if out.is_floating_point() else torch.iinfo(out.dtype).max)
        return out

    def start_gather(
        self, shard: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Start the gather now and return its placeholder: ``out`` (contiguous,
        gathered shape), the caller's output buffer, or a new one. A shard that
        a pending product makes is made as it is sent, where the backend can
        (Note [Matmul + all-gather] in eagertp.collectives.all_gather)."""
        product = None
        if self.store.items and self.store.touched([shard]) is not None:
            self.unbind_consumer(shard, "all_gather_into_tensor")
            product = gathered_product(self.store.standalone_output(shard), shard)
            if product is None:
                self.complete_owners([shard], "all_gather_into_tensor")
        shard = shard.contiguous()
        placeholder = out is None  # else the caller's own buffer, the program's to read
        if placeholder:
            out = self.placeholder(shard, (shard.shape[0] * group.size(), *shard.shape[1:]))
        record = self.new_record("all_gather", shard, out, group)
        gather = PendingGather(shard, out, group, self.store.next_tid(), record, work_at_start=self.matmul_work)
        with _IssuingWork(self):  # NB: issuing_work(), one frame shorter
            if self.verify:
                # NB: before the backend is chosen: symm_mem's first use of a
                # group rendezvouses, a collective that mismatched ranks would hang in.
                check_ranks_agree(gather_signature(shard), group)
            backend, gather.backend = self.choose_backend(shard, group)
            record.backend = gather.backend
            why_not = None if product is None else backend.why_not_produce_all_gather(shard, group)
            if why_not is not None:
                gather.made_first = Reason("{} made its shard first: {}", product.describe(), why_not)
                self.complete_owners([shard], "all_gather_into_tensor", f"made ${product.tid} first: {why_not}")
                gather.work_at_start = self.matmul_work  # NB: it ran before the gather, not behind it
                product = None
            if product is None:
                gather.handle = backend.start_all_gather(shard, out, group)
            else:
                self._produce_gather(gather, product, backend)
            if self.verify:
                # Plain eager's result, gathered in program order on every rank
                # (after the start, which may make the shard), for the comparison
                # when the gather completes.
                self.gather_reference(gather)
        if placeholder:
            gather.storage_uses_at_start = storage_uses(out)  # Note [This rank's chunk, unread]
        self.add_gather(gather)
        return out

    def unbind_consumer(self, shard: torch.Tensor, func: Any) -> None:
        """If ``shard`` is the whole output of a matmul bound to a gather in
        flight (as A rows), and a collective or an epilogue is about to take
        it, take the matmul out of that gather and complete the gather: the
        matmul, now a standalone product of the completed tensor, is made as
        its collective needs it (an all-gather sending it, a reduce-scatter or
        all-reduce producing from it: Note [Matmul + all-gather] in
        eagertp.collectives.all_gather, Note [Matmul + all-reduce]), its scale
        kept with it (Note [Epilogues] in eagertp.deferred), as before it
        bound. A column-parallel matmul after a norm run row by row (Note
        [Row-wise ops on gathered rows] in eagertp.rowwise) whose output is
        gathered (HF's ``colwise_rep``, ``colwise_gather_output``); float8's
        input gradient scaled row-wise by an all-reduced amax, then reduced."""
        bound = self._bound_output(shard)
        if bound is None:
            return
        gather, mm = bound
        self.store.remove_consumer(gather, mm)
        view = mm.view
        mm.a = view.tensor.view(mm.gathered_dtype or view.tensor.dtype).reshape(mm.out.shape[0], -1)
        mm.operand, mm.view, mm.gathered_dtype = None, None, None
        self.complete_owners([mm.a], func, f"takes ${mm.tid} whole: ${view.tid} completes first")
        self.store.add_product(mm)
        if self.trace.recording:
            self.trace.event("${}: {} unbound: {} takes it whole", mm.tid, mm.describe(), func)

    def _bound_output(self, t: torch.Tensor) -> tuple[PendingGather, PendingMatmul] | None:
        """The gather in flight and the matmul bound to it as A rows whose
        whole output ``t`` is, if it is one that ``unbind_consumer`` can unbind."""
        if not self.store.items:
            return None
        gather = self.store.owner(t)
        if not isinstance(gather, PendingGather):
            return None
        mm = gather.consumer_writing(t)
        if (
            mm is None
            or mm.operand is not Operand.ROWS
            or mm.scale_gather is not None
            or not t.is_contiguous()
            or t.storage_offset() != mm.out.storage_offset()
            or t.numel() != mm.out.numel()
        ):
            return None
        return gather, mm

    def _produce_gather(self, gather: PendingGather, product: Product, backend: Backend) -> None:
        """Start ``gather`` with its shard made by ``product`` as it is sent
        (Note [Matmul + all-gather] in eagertp.collectives.all_gather), and
        account for it as fused."""
        self.complete_before("all_gather_into_tensor", product)
        # NB: made straight into this rank's chunk of the result and sent from
        # there: no copy. The product's own output stays pending, computed only
        # if something reads it (as after a fused reduce-scatter).
        gather.shard = gather.out.view(gather.group.size(), *gather.shard.shape)[gather.group.rank()]
        product.absorbed = True
        self.count_matmul_work()
        with profiler_range("eagertp::matmul_all_gather"):
            gather.handle = backend.produce_all_gather(
                shard_producer(product, gather.shard), gather.shard, gather.out, gather.group
            )
        if self.verify:
            want = torch.empty_like(product.out)
            product.compute_all(want)
            got = gather.shard.view(want.shape)
            check_equal(f"{product.describe()} before all_gather", got, want, gather.group, exact=False)
        gather.produced = True
        self.stats["matmul_all_gather"] += 1
        self.trace.mark_fused(gather.record, [product.describe()], gather.backend)
        self.trace.event("matmul_all_gather(${}) [{}]", product.tid, gather.backend)

    def choose_backend(self, t: torch.Tensor, group: dist.ProcessGroup) -> tuple[Backend, str]:
        """The backend for a collective on ``t``, and its label for explain()
        (with the note of why ``auto`` did not pick symm_mem, if any)."""
        backend, note = self.backend.for_collective(t, group)
        return backend, backend.name if note is None else f"{backend.name}; {note}"

    def gather_reference(self, gather: PendingGather) -> None:
        """Plain eager's gather of ``gather.shard``, for ``verify=True`` to compare
        with when the gather completes."""
        gather.reference = torch.empty_like(gather.out)
        all_gather_consume(ReferenceBackend(), gather.shard, None, gather.reference, gather.group)

    def add_gather(self, gather: PendingGather) -> None:
        """Hold a started gather in the pending store, traced, until a read or flush completes it."""
        self.store.add_gather(gather)
        record = gather.record
        if self.trace.recording:
            self.trace.event("${}: {} = all_gather({}, {})", gather.tid, record.dst, record.src, record.group)

    # -- matmuls -----------------------------------------------------------

    def run_matmul(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """A matmul run at once (not deferred): counted as work that overlaps
        the gathers in flight."""
        self.count_matmul_work()
        return func(*args, **kwargs)

    def count_matmul_work(self, n: int = 1) -> None:
        """``n`` matmuls are about to run while the gathers in the store are in
        flight: counted (explain() says a gather overlapped them), and each of
        those gathers watched, so that its consumers can tell whether it has
        landed by then (Note [Landed gathers]). The gather half of an
        all-reduce only once a matmul consumes it: in TP code an elementwise
        op reads the reduced tensor first (the residual add), and a watch
        costs a thread."""
        self.matmul_work += n
        for item in self.store.items:
            if isinstance(item, PendingGather) and (item.consumers or not item.half_of_all_reduce):
                assert item.handle is not None, f"all_gather ${item.tid} is pending but was never started"
                item.handle.watch()

    def defer_matmul(
        self,
        func: torch._ops.OpOverload,
        args: tuple,
        kwargs: dict,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None = None,
        scaled: Scaled | None = None,
    ) -> torch.Tensor:
        """Defer a matmul: as a consumer of the gather in flight it reads, or
        standalone (a reduce-scatter may follow: Note [Deferral boundary])."""
        if not self.store.items and a.dim() == 2 and b.dim() == 2:
            # NB: the hot path of small matmuls.
            if self.never_fused(a.shape[0], b.shape[1], a.device.type):
                return self.run_matmul(func, args, kwargs)
        out_dtype, rejected = matmul_out_dtype(a, b, bias, scaled)
        if out_dtype is None:
            # Plain eager raises its own error, or (FP8 shapes the meta kernel's
            # stricter rules reject) runs it: unfused, and explain() says why.
            if self.store.items:
                tensors = tensor_leaves(args, kwargs)
                self.complete_owners(tensors, func, f"reads it with operands that do not defer ({rejected})")
                self.complete_for(func, args, kwargs)
            return self.run_matmul(func, args, kwargs)
        gather, view, operand, scale_gather = None, None, None, None
        if self.store.items:
            self.complete_work_past(func, self.before_collective)
        if self.store.items:  # NB: again: what the call above completed may have emptied it
            gather, view, operand, scale_gather, why_not = match_gather_operand(self.store, a, b, bias, scaled)
            if why_not is not None:
                self.complete_owners(tensor_leaves(args, kwargs), func, why_not)
            elif gather is None:
                self.complete_for(func, args, kwargs)
        mm = PendingMatmul(
            func,
            None if operand in (Operand.ROWS, Operand.ROWS_T, Operand.COLS) else a,
            None if operand is Operand.B_ROWS else b,
            self.placeholder(a, (a.shape[0], b.shape[1]), out_dtype),
            self.store.next_tid(),
            bias,
            beta=kwargs.get("beta", 1),
            alpha=kwargs.get("alpha", 1),
            operand=operand,
            view=view,
            scaled=scaled,
            gathered_dtype=None if view is None or operand is Operand.B_ROWS else a.dtype,
            scale_gather=scale_gather,
        )
        if gather is None:
            self.store.add_product(mm)
        else:
            self.store.add_consumer(gather, mm)
        if scale_gather is not None:
            scale_gather.scale_of.append(mm)
        if self.trace.recording:  # Note [The ordered trace when asked] in eagertp.trace
            self.trace.events.append(mm.trace_event())  # NB: what Trace.event records, one frame shorter
        return mm.out

    def defer_cast(self, gather: PendingGather, source: GatheredView, dtype: torch.dtype) -> torch.Tensor:
        view = GatheredView(
            self.placeholder(source.tensor, source.tensor.shape, dtype), source.dim, source.world,
            self.store.next_tid(), cast=True,
        )
        self.store.add_gathered_view(gather, view)
        if self.trace.recording:
            self.trace.event("${}: {} = ${}.to({})", view.tid, Meta.of(view.tensor), source.tid, dtype_str(dtype))
        return view.tensor

    def defer_product_cast(self, source: Product, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Defer ``t.to(dtype)`` of a whole pending product (``t`` views its
        output): a reduce-scatter of the cast can still produce chunk by chunk."""
        cast = PendingCast(source, self.placeholder(source.out, source.out.shape, dtype), self.store.next_tid())
        source.absorbed = True
        self.store.add_product(cast)
        if self.trace.recording:
            self.trace.event("${}: {} = ${}.to({})", cast.tid, Meta.of(cast.out), source.tid, dtype_str(dtype))
        return cast.out.view(t.shape)

    def defer_pointwise(
        self, source: Product, op: Callable[..., torch.Tensor], operand: torch.Tensor | float, dtype: torch.dtype
    ) -> torch.Tensor:
        """Defer ``op(source.out, operand)`` of a whole pending product (Note
        [Epilogues] in eagertp.deferred): a collective of the result can still
        produce chunk by chunk."""
        out = self.placeholder(source.out, source.out.shape, dtype)
        pointwise = PendingPointwise(source, out, self.store.next_tid(), op=op, operand=operand)
        source.absorbed = True
        self.store.add_product(pointwise)
        if self.trace.recording:
            self.trace.event("${}: {} = ${} {} {}", pointwise.tid, Meta.of(out), source.tid,
                             "*" if op is torch.mul else "+", operand_str(operand))
        return out

    def defer_chunk_cat(self, tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
        """Defer ``cat(x.chunk(W, i), dim)`` of a pending ``x``, the reshuffle funcol
        emits around collectives on dims > 0, or return None if that is not it:

        - ``cat(ag.chunk(W), d)``: the all-gather seen along dim ``d`` (a new
          gathered view, filled chunk by chunk when the gather completes);
        - ``cat(y.chunk(W, d), 0)`` of a matmul output ``y``: the input of a
          reduce-scatter along dim ``d``, which can then produce chunk by chunk.
        """
        owner = self.store.owner(tensors[0]) if tensors else None
        if isinstance(owner, PendingGather) and dim == 0 and owner.view_of(tensors[0]) is None:
            # A gather consumer's output, reshuffled for a reduce-scatter along dim > 0.
            mm = owner.consumer_writing(tensors[0])
            key = storage_key(tensors[0])
            if mm is not None and len(tensors) > 1 and all(storage_key(t) == key for t in tensors):
                self.unbind_consumer(mm.out, "cat")
                owner = self.store.owner(tensors[0])
        if owner is None:
            return None
        for t in tensors:  # NB: a loop: every cat while work is pending
            if self.store.owner(t) is not owner:
                return None
        world = len(tensors)
        if isinstance(owner, PendingGather):
            dim = dim % owner.shard.dim()
            if world != owner.group.size() or dim == 0 or not same_views(tensors, owner.out.chunk(world)):
                return None
            shape = list(owner.shard.shape)
            shape[dim] *= world
            view = GatheredView(self.placeholder(owner.shard, shape), dim, world, self.store.next_tid())
            self.store.add_gathered_view(owner, view)
            if self.trace.recording:
                self.trace.event("${}: {} = cat(${}.chunk({}), {})", view.tid, Meta.of(view.tensor), owner.tid, world, dim)
            return view.tensor
        if dim != 0:
            return None
        mm = owner
        for split_dim in range(1, tensors[0].dim()):
            shape = list(tensors[0].shape)
            shape[split_dim] *= world
            if math.prod(shape) != mm.out.numel() or shape[-1] != mm.out.shape[1]:
                continue
            if same_views(tensors, mm.out.view(shape).chunk(world, split_dim)):
                cat_shape = (world * tensors[0].shape[0], *tensors[0].shape[1:])
                sv = ScatterView(self.placeholder(mm.out, cat_shape), torch.Size(shape), split_dim, world)
                self.store.add_scatter_view(mm, sv)
                if self.trace.recording:
                    self.trace.event(
                        "${}': {} = cat(${}.chunk({}, {}), 0)", mm.tid, Meta.of(sv.tensor), mm.tid, world, split_dim
                    )
                return sv.tensor
        return None

    def defer_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Defer ``x + y`` of two whole pending products (autograd accumulating an
        input gradient): a reduce-scatter of the sum can then produce each chunk
        as a sum of matmul rows. A term bound to a gather in flight as its rows
        (float8's row-wise input gradients, each scaled by the rows of its own
        amax all-reduce's gather half) is unbound first: the sum is read now,
        which would complete its gather anyway. None if that is not it."""
        whole = [self.store.standalone_output(t) for t in (x, y)]
        if all((found is not None and found[1] is None) or self._bound_output(t) is not None for t, found in zip((x, y), whole)):
            for t in (x, y):
                self.unbind_consumer(t, "aten.add.Tensor")
        found_x, found_y = self.store.standalone_output(x), self.store.standalone_output(y)
        if found_x is None or found_y is None or found_x[1] is not None or found_y[1] is not None:
            return None
        (px, _), (py, _) = found_x, found_y
        if px is py or x.shape != y.shape or x.dtype != y.dtype or px.out.shape != py.out.shape:
            return None
        terms = [t for p in (px, py) for t in (p.terms if isinstance(p, PendingSum) else [p])]
        px.absorbed = py.absorbed = True
        total = PendingSum(terms, self.placeholder(px.out, px.out.shape), self.store.next_tid())
        self.store.add_product(total)
        if self.trace.recording:
            self.trace.event(total.render())
        return total.out.view(x.shape)

    # -- collectives issued as written -------------------------------------

    def issue_as_is(
        self,
        func,
        args: tuple,
        kwargs: dict,
        kind: str,
        src: torch.Tensor,
        group: dist.ProcessGroup,
        reason: Text,
        signature: str,
        *,
        inputs: Sequence[torch.Tensor] = (),
    ) -> Any:
        """Run a collective exactly as the program issued it, now (after
        completing the pending work it reads), and record why it was not fused.
        ``signature`` is what ``verify=True`` compares across ranks first, as
        for a plan. ``inputs``: every input of a list or coalesced form (``src``
        is the first), each shown in explain(), as each of its outputs is."""
        if self.store.items:
            read = self.product_read(src)
            self.complete_for(func, args, kwargs)
            self.complete_work_past(func, -1 if read is None else read - 1)
        if self.verify:
            with self.issuing_work():
                check_ranks_agree(signature, group)
        result = func(*args, **kwargs)
        self.unseen.refresh()  # NB: the group counted it
        # raw c10d: (output, work), its all-reduce ([tensor], work), its list forms' outputs Tensor[][].
        outputs = tensors_in(result[0] if isinstance(result, tuple) else result)
        sources = list(inputs) or [src]
        # NB: marks no product past its collective: one issued as written
        # took none (Note [Products past their collective]). A coalesced form
        # returns a Work: its tensors are written in place.
        record = self.trace.new_collective(
            kind, src=metas_of(sources), dst=metas_of(outputs or sources), group=group
        )
        self.stats[f"unfused_{kind.split('(')[0]}"] += 1
        self.trace.mark_unfused(record, reason)
        self.trace.event("{} = {}({}, {}) [as written]", record.dst, kind, record.src, record.group)
        return result

    def new_record(
        self, kind: str, src: torch.Tensor, dst: torch.Tensor, group: dist.ProcessGroup, *, marks_past: bool = True
    ) -> CollectiveRecord:
        """The explain() record of a collective eagertp runs, with its tensors
        and group shapes (Note [Formatted when read]); also where the products
        recorded so far are marked past their collective (Note [Products past
        their collective]), unless ``marks_past`` is False. One issued as
        written records in ``issue_as_is`` and marks none."""
        if marks_past:
            self.before_collective = self.store.last_tid
        return self.trace.new_collective(kind, src=Meta.of(src), dst=Meta.of(dst), group=group)


# Note [Issuing work]
# ~~~~~~~~~~~~~~~~~~~
# ``with engine.issuing_work():`` ops issued inside pass through the mode, and
# fill placeholders below autograd: tensors autograd saved for backward are
# these same storages, and their version counters must not move. The
# outermost one also reads the watched groups' operation counts before and
# after (Note [Collectives the mode did not see] in eagertp.unseen).


class _IssuingWork:
    """``Engine.issuing_work()``: Note [Issuing work]. NB: a class, not a
    generator under ``contextlib.contextmanager``: entered twice or more per
    fused call, where the generator's machinery cost about 1.5 us each
    (benchmarks/NOTES.md, 2026-12-02 at 5ce2715)."""

    __slots__ = ("engine", "was_issuing", "below_autograd")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        engine = self.engine
        if not engine.issuing and engine.unseen.known:  # Note [Collectives the mode did not see]
            engine.check_unseen()
        self.below_autograd = torch._C._AutoDispatchBelowADInplaceOrView()
        self.below_autograd.__enter__()
        self.was_issuing, engine.issuing = engine.issuing, True

    def __exit__(self, *exc) -> None:
        try:
            self.below_autograd.__exit__(*exc)
        finally:
            engine = self.engine
            engine.issuing = self.was_issuing
            if not engine.issuing and engine.unseen.known:
                engine.unseen.refresh()


def _reading(item: Pending, keys: set[int]) -> list[int]:
    """The trace ids of the matmuls of ``item`` (a gather's consumers) that read
    any of the storages ``keys``."""
    if not isinstance(item, PendingGather):
        return [item.tid]
    return [mm.tid for mm in item.consumers if any(storage_key(t) in keys for t in mm.inputs())]


def _and_made_first(why: Reason, gather: PendingGather) -> Reason:
    """An unfused gather's reason, with why its product did not make its shard
    as it was sent, if one could have (Note [Matmul + all-gather])."""
    return why if gather.made_first is None else Reason("{}; {}", why, gather.made_first)


def _matmuls(n: int) -> str:
    return f"{n} matmul{'s' if n != 1 else ''}"


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A named range in profiler traces; nothing (not even two dispatched ops)
    when no profiler runs."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


