"""The deferral engine: gathers in flight, pending matmuls, and what completes them.

``Engine`` holds one ``EagerMicroPipeline``'s state (the pending store, the
trace, the counters, the backend choice) and the operations the op handlers
call, in three parts, each in its own module:

- completion and scheduling, here: what a read needs (``run_plain``,
  ``complete_for``, ``complete_owners``), what must come before a write
  (``before_write``), the products past their collective, ``flush``, and a
  gather completed with its consumers (``AllGatherMatmulPlan``);
- making pending work (``eagertp.deferring``): start a gather, defer a matmul
  as a gather's consumer or standalone, defer an epilogue, cast or sum of a
  product;
- accounting (``eagertp.accounting``): stats, explain()'s records, the
  collectives issued as written.

Note [Deferral boundary] in ``eagertp.deferred`` says when each happens. The
handlers (``eagertp.collectives``, ``eagertp.matmuls``) turn ops into these
calls; the reduce-scatter and all-reduce families run their fused collectives
in their own modules with the engine's small surface for them
(``backend.for_collective``, ``add_gather``, ``gather_reference``,
``issue_as_is``, ``new_record``, ``eagertp.issuing``). The public class
(``eagertp.pipeline``) owns the engine; the engine imports no family.

What the engine reads, split by concern: ``eagertp.op_facts`` (what an op
writes and reads, from its schema), ``eagertp.operands`` (which gather in
flight a matmul consumes, and how), ``eagertp.verify`` (``verify=True``'s
checks), ``eagertp.deferred`` (the pending records and their store).
"""
from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from eagertp import rowwise
from eagertp._format import group_str
from eagertp.accounting import Accounting
from eagertp.backends import BackendChoice
from eagertp.deferred import (
    Pending,
    PendingGather,
    PendingMatmul,
    PendingStore,
    Product,
    is_weight_gradient,
    orphaned_storages,
    storage_key,
    tensor_leaves,
)
from eagertp.deferring import Deferring
from eagertp.issuing import IssuingWork, profiler_range
from eagertp.op_facts import OP_FACTS, OpFacts, op_facts, written_tensors
from eagertp.patterns import AllGatherMatmulPlan
from eagertp.trace import Reason, Trace
from eagertp.unseen import Unseen
from eagertp.verify import check_equal

log = logging.getLogger(__name__)


class Engine(Deferring, Accounting):
    """Pending work of one ``EagerMicroPipeline`` and the operations on it:
    completion and scheduling here, making pending work in ``Deferring``,
    counting and recording in ``Accounting``."""

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
        # device -> the smallest matmul output (bytes) a fused collective
        # could take; read per block (MIN_FUSE_BYTES may change between blocks).
        self._deferral_bytes: dict[torch.device, int] = {}
        # The latest trace id recorded before the latest collective on a managed
        # group: products up to it are past their collective (Note [Products past their collective]).
        self.before_collective = -1
        # Communication on managed groups the mode did not see (Note [Collectives
        # the mode did not see] in eagertp.unseen).
        self.unseen = Unseen()
        # Note [Deferrals that gained nothing] in eagertp.deferring: the
        # matmuls the block before read whole, by their place among its
        # matmuls -> (op, A's shape, B's shape); those of this block; this
        # block's matmuls so far; the stats the block before ended with
        # (None: nothing to compare with).
        self.read_whole: dict[int, tuple] = {}
        self.read_whole_now: dict[int, tuple] = {}
        self.matmul_ordinal = 0
        self._stats_before: dict[str, int] | None = None
        # This block's matmuls run at once: output storage -> (place, that storage).
        self.ran_at_once: dict[int, tuple[int, weakref.ref]] = {}

    def reset(self) -> None:
        self.stats.clear()
        self.trace = Trace(max_records=self.max_records, events=self.trace.recording)
        self.store.reset()
        self.matmul_work = 0
        self._deferral_bytes.clear()
        self.before_collective = -1
        self.unseen.reset()
        self.read_whole_now = {}
        self.ran_at_once = {}
        self.matmul_ordinal = 0

    def end_block(self, completed: bool) -> None:
        """What the next block runs at once (Note [Deferrals that gained nothing]
        in eagertp.deferring): this block's matmuls read whole, unless it ended
        by an exception, or ran matmuls at once and fused otherwise than the
        block before."""
        stats = dict(self.stats)
        ran = stats.pop("matmuls_run_at_once", 0)
        learned = completed
        if ran and stats != self._stats_before:
            log.debug(
                "eagertp: this block ran %d matmuls at once and fused otherwise than the block before "
                "(%s, then %s): the next block defers every matmul", ran, self._stats_before, stats,
            )
            learned = False
        self.read_whole = self.read_whole_now if learned else {}  # NB: reset() gives the next block a new one
        self._stats_before = stats if completed else None

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

    def issuing_work(self) -> IssuingWork:
        """``with engine.issuing_work():`` Note [Issuing work]."""
        return IssuingWork(self)

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
                if first is not None and not facts.written:  # NB: _complete_for's read, one frame shorter
                    self.complete_owners(tensors, func, first=first)
                else:
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
        if not owners:
            return
        if why is None and len(owners) == 1 and not isinstance(owners[0], PendingGather):
            # NB: the hot path, a read of one pending product (its placeholders
            # have its id), whose completion reads no reason.
            if self.trace.recording:
                self.trace.event("wait: {}", Reason("{} read ${}", func, owners[0].tid))
            self._complete_products(owners)
        else:
            if why is None:
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
        products = []
        for p in self.store.items:  # NB: a list (_drop removes), by a loop: no comprehension's frame
            if not isinstance(p, PendingGather):
                products.append(p)
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
            if self.trace.recording:
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
        if self.trace.recording:  # NB: on the hot path (every fused collective's product, dropped)
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
                with IssuingWork(self):  # NB: issuing_work(), one frame shorter
                    # NB: the item alone (a read of one gather): nothing in flight, no frame to say so.
                    ordered = items if len(self.store.items) == 1 else self._with_work_in_flight(items, keep)
                    self._complete_items(ordered, items, reason)
                return
        self._complete_products(items)

    def _complete_products(self, items: list[Product]) -> None:
        """``complete`` of products alone, the hot path (a read of products):
        nothing to order, and nothing communicates (no watch of unseen
        communication, Note [Collectives the mode did not see]): only
        placeholders filled below autograd, as issuing_work() fills them. A
        product's completion reads no reason (a gather's records it)."""
        was_issuing, self.issuing = self.issuing, True
        try:
            with torch._C._AutoDispatchBelowADInplaceOrView():
                self._complete_items(items, items, "")
        finally:
            self.issuing = was_issuing

    def _complete_items(self, ordered: list[Pending], items: list[Pending], reason: str | Reason) -> None:
        """``complete``'s work on ``ordered`` (``items`` and the work in flight
        before their gathers). Completes every item even if one fails, so that
        no placeholder is left unfilled and no transfer half-received, then
        raises the first failure."""
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
                    if self.trace.recording:
                        self.trace.event("skip ${}: nothing can read it", item.tid)
                else:
                    if self.store.items:
                        self.count_matmul_work()
                    else:  # NB: no gather in flight to watch: count_matmul_work's count, one frame shorter
                        self.matmul_work += 1
                    item.issue_standalone()
                    if (
                        type(item) is PendingMatmul and item.ordinal >= 0 and item.issued_at == self.trace.issued
                        and not item.absorbed
                    ):  # read whole, nothing issued since its deferral: Note [Deferrals that gained nothing]
                        self.read_whole_now[item.ordinal] = (item.op, item.a.shape, item.b.shape)
            except BaseException as e:  # noqa: B036 - raised once every item is complete
                failure = failure or e
        if failure is not None:
            try:
                raise failure
            finally:
                # NB: its traceback holds this frame: a frame that still held
                # it would keep the block's pending work, tensors and mode in a
                # reference cycle (Note [Freed without the garbage collector]
                # in eagertp.deferred), as concurrent.futures' Future does.
                failure = None

    def _with_work_in_flight(self, items: list[Pending], keep: Sequence[Pending] = ()) -> list[Pending]:
        """``items``, each gather preceded by every standalone product still
        pending and not absorbed but those in ``keep``: the transfer hides
        behind them (Note [Work issued while a gather is in flight])."""
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
            gather.unlink()
            self._complete_scales(plan.scales, reason)
            raise
        gather.completed = True
        for step in gather.wholes:  # Note [Row-wise ops on gathered rows] in eagertp.rowwise
            step.run()
        if gather.steps or gather.wholes:
            self.stats["rowwise_ops"] += len(gather.steps) + len(gather.wholes)
        self._account_gather(gather, plan, reason)
        gather.unlink()  # Note [Freed without the garbage collector] in eagertp.deferred
        if plan.scales:
            self._complete_scales(plan.scales, reason)
        if self.verify:  # NB: after the scales: plain eager's matmuls read them whole
            for what, got, want, exact in plan.checks():
                check_equal(what, got, want, plan.group, exact=exact)


def _reading(item: Pending, keys: set[int]) -> list[int]:
    """The trace ids of the matmuls of ``item`` (a gather's consumers) that read
    any of the storages ``keys``."""
    if not isinstance(item, PendingGather):
        return [item.tid]
    return [mm.tid for mm in item.consumers if any(storage_key(t) in keys for t in mm.inputs())]
