"""Deferred work: pending all-gathers and matmuls.

Note [Deferral boundary]
~~~~~~~~~~~~~~~~~~~~~~~~
Communication starts where the program issues it; only the matmuls wait.

A managed all-gather starts moving data at once (``Backend.start_all_gather``)
and hands the program a placeholder (``torch.empty`` of the gathered shape)
that the transfer fills; a deferred matmul hands it a placeholder for its
output. A tensor is *pending* when its storage is a placeholder's storage: the
placeholder itself, and any view of it (views share storage, so
``view``/``t``/``split``/``_unsafe_view`` outputs stay pending with no
bookkeeping). A matmul that reads a gather in flight binds to it as a
*consumer*; an op that reads any other pending tensor completes the item that
owns it, and only that one, so no program ever observes an unfilled
placeholder::

    program:  ag1 = AG(x)  z = a @ b  q = ag1 @ wq  k = ag1 @ wk  attn(q, k)   ag2 = AG(y) ...
    comm:     [==== ag1's chunks in flight ====]                              [== ag2 ==
    compute:               [ a @ b ]                                [q, k on chunk 0][chunk 1][attn]
                                                  (bound, deferred) ^ attn reads q: ag1 completes

Several gathers may be in flight; they start in program order on every rank
(Invariant 3) and each one's messages depend only on its shapes and group, so
a rank that completes them in another order, or reads one early, still
exchanges the same messages as its peers (Invariant 2). A reduce-scatter runs
where the program issues it, fused with the pending product that makes its
input. Mutating an input of pending work, ``flush()`` and leaving the block
complete everything, in record order.

Every ``mm``/``addmm``/``_scaled_mm`` is deferred: a reduce-scatter may follow.
Except, while nothing is pending, a matmul whose output is too small for the
size rule (Note [Size rule]) to fuse any reduce-scatter of it, even as float32
and on a group of one: it runs at once, as in plain eager, since deferring it
could only cost (~30 us of Python per matmul).
A product whose fused consumer already took what it needed (a reduce-scatter's
producer, a longer sum) stays pending as *absorbed*: computed in full if the
program reads it, skipped at a flush when nothing can reach it (``unobserved``).

Pending entries are keyed by storage identity (``StorageImpl`` address). The
store holds the placeholders, so their storages stay alive and a key cannot be
reused while it is pending; completing an item drops its entries.

Note [Work issued while a gather is in flight]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Plain eager computes a matmul where the program issues it, so an async
all-gather issued before it hides behind it (a prefetch). eagertp defers that
matmul (a reduce-scatter may follow), so completing a gather first computes
the standalone products recorded after the gather started, then waits for the
chunks: the transfer still hides behind them::

    program:  ag = AG(x)   z = a @ b   y = ag @ w   read(y)
    plain:    [== AG ==]   [ a @ b ]   wait [ ag @ w ]
    eagertp:  [== AG ==]   (deferred)  (bound)  [ a @ b ][ y: chunk 0 ][ chunk 1 ]
                                                ^ read(y): z first, then the gather

Weight gradients recorded before the gather started and still pending are
computed there too: nothing has read them since, no collective takes them, and
the program's end would compute them with no transfer left to hide. (Other
products recorded before it stay pending: a collective may still take them,
as when float8 training's small amax all-reduces, whose gather halves the next
op reads, come between a layer's input gradients and their reduce-scatter.) In TP without sequence parallel that is a
backward step's weight gradients, and the all-gather half of the input
gradient's all-reduce, read at once by the next op, hides behind them::

    program:  dW = g.t() @ x   dX = all_reduce(g @ w)   read(dX)   ...   end
    eagertp:  (deferred)       [ RS half ][== AG half ==]
                                          [ dW ] wait [ read ]

A product that a later reduce-scatter would have taken loses that fusion (it
is computed whole and reduce-scattered as written); in TP code a product feeds
its reduce-scatter at once, before anything reads a gather. Absorbed products
(a fused collective produced what it needed; Note [Deferral boundary]) stay
pending: computed only if read.

Note [Products past their collective]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pending product holds its inputs, which plain eager would free once the
matmul ran: in a backward step, the weight gradients (dW = g.t() @ x) hold
the gradients and activations that autograd has released. In TP code a
product feeds its collective at once (or through a cast or a sum of products,
which absorbs it), so pending work is computed early, in program order, at
three points:

- a collective that reads product $p: the non-absorbed products recorded
  before $p (their collective would have come first);
- the next matmul deferred after a collective on a managed group that read a
  pending product: the non-absorbed products recorded before that collective
  (one that reads none, such as float8 training's amax all-reduces between a
  layer's backward matmuls, marks none past);
- at a deferred matmul, a chain's first row-wise op (Note [Memory of a
  chain] in eagertp.rowwise), a read that completes pending work, or a
  collective: weight gradients (``is_weight_gradient``) that read a storage
  nothing but pending work can reach (``orphaned_storages``); at a deferred
  matmul also the absorbed products nothing can read (dropped, as a flush
  skips them).

A product whose collective comes later anyway (reversed order, or after
another collective and a matmul) is computed whole and its collective issued
as written: slower, never different.

Note [Overlap accounting]
~~~~~~~~~~~~~~~~~~~~~~~~~
A gather with matmul consumers is fused. One without any still overlapped
work if matmuls ran while it was in flight (a prefetch: plain eager's async
all-gather hides behind them, and so does eagertp's); the mode counts matmul
work (the matmuls it runs and those it defers and computes) and compares at
completion. Only a gather that overlapped nothing counts as unfused.

Note [Matmul operands of a gather]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Let ``L`` be a gathered tensor (``cat`` of the ``W`` shards along ``dim``) and
``G = L.view(M, C)`` its rows. Rank ``i``'s chunk supplies the rows ``R_i`` of
``G`` whose index along ``dim`` lies in rank ``i``'s block (a contiguous block
of rows when ``dim`` is 0), or, when ``dim`` is the last dim, the columns
``C_i``. A matmul can meet ``G`` in four ways, and each splits into per-chunk
work that can start as soon as that chunk has arrived::

    ROWS     mm(G, B)      out[R_i]  = G[R_i] @ B            (forward; dgrad)
    ROWS_T   mm(G.t(), H)  out      += G[R_i].t() @ H[R_i]    (wgrad: contraction
    B_ROWS   mm(H, G)      out      += H[:, R_i] @ G[R_i]      over the gathered rows)
    COLS     mm(G, B)      out      += G[:, C_i] @ B[C_i]     (gathered along the last dim)

ROWS writes disjoint rows, so it equals plain eager bitwise whenever the
per-row products do. The accumulating forms add ``W`` partial products, in
chunk arrival order: exact on integer-valued inputs, and within the tolerance
of a chunked reduction otherwise.

Note [Gathered row-wise scales]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FP8 with row-wise scaling and sequence parallelism quantizes each rank's shard
before the all-gather, so the program gathers two tensors, the FP8 data (as
``uint8``) and its per-row scales, and multiplies both gathered: the shape of
torch's ``fused_all_gather_scaled_matmul(A_shard, Bs, A_scale, ...)``, which
gathers ``A_scale`` with ``A_shard`` (its unfused fallback: the data's gather,
then the scale's)::

    ag  = all_gather(x_fp8.view(uint8))      # G_data: [M/W, K] -> [M, K]
    s   = all_gather(x_scale)                # G_scale: [M/W, 1] -> [M, 1] (either order)
    y_j = _scaled_mm(ag.view(fp8), w_j, s, scale_b_j, ...)    # any number (Q, K, V)

A ``_scaled_mm`` whose A rows come from gather G_data and whose ``scale_a`` is
the whole of another gather in flight, G_scale, on the same group, with
``scale_a``'s rows split by rank as A's are (same gather dim, same rows per
rank), binds to G_data as a consumer with G_scale as its ``scale_gather``.
Both gathers started at their program points with their own messages
(Invariant 2 holds as for any two gathers). When G_data completes, its
consumer waits, before rank ``i``'s first piece, for rank ``i``'s chunk of
G_scale (``GatherHandle.wait_chunk``), then runs each chunk's ``_scaled_mm``
on that chunk's data rows and scale rows (``select`` picks them); G_scale
completes right after (its chunks have all landed). So each chunk's matmul
runs as both of its pieces arrive, whichever gather was issued first: on one
channel per peer (gloo's pair, symm_mem's comm stream) the later gather's
chunk lands just behind the earlier one's, and waiting for the whole scale
gather first would, when the scale is issued second, wait for all of the data.

On symm_mem this is the same code: the two gathers' pulls are on the comm
stream from their program points, and ``wait_chunk`` makes the current stream
wait for the scale chunk's event before the data chunk's consumer. torch's
multi-gather primitive (``_pipelined_multi_all_gather_and_consume``) gives the
same per-chunk dependency, but wants both shards and the consumer in one call;
the gathers start at two program points before any matmul shows the pairing,
which is why eagertp enqueues gathers itself (Note [Gathers in flight on the
comm stream]), so the primitive would add nothing.

Not paired, and completed as any gather is: a scale read by something else
before the matmul (its gather completes then; the matmul still fuses, its
scale now whole), a scale whose rows per rank do not follow A's, or on
another group (the matmul's reason in explain()), a scale under the size rule
(issued as written; the matmul fuses as with any whole scale), and chains (a
gathered scale whose gather has scale gathers of its own, or a data gather
that is itself some matmul's scale). A flush completes a scale gather with
its data gather, whichever came first; one that a read completes before its
data gather is waited for whole, and its record still names the fused call it
feeds.

The reduce-scatter side needs nothing new: no recipe gathers a scale there.
torch's ``fused_scaled_matmul_reduce_scatter`` (and Inductor's
micro_pipeline_tp pass that emits it) takes A and its row-wise ``A_scale``
local to the rank, and so does eagertp's producer: ``scale_a`` [M, 1] is
selected with A's rows per chunk, ``scale_b`` [1, N] with B's columns when
scattering the last dim (tests/test_scaled.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import math
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from eagertp._compat import storage_id
from eagertp._format import dtype_str, tensor_str
from eagertp.backends.base import GatherHandle, piece_dim
from eagertp.trace import CollectiveRecord, Event, Lazy, Meta, Text

if TYPE_CHECKING:
    from eagertp.rowwise import RowwiseStep, WholeStep


# The identity of a tensor's storage (its StorageImpl's address, as
# ``t.untyped_storage()._cdata``), from C: no Python frame and no storage
# object per call (the store's maps ask it about 1,200 times a plain-TP step).
storage_key: Callable[[torch.Tensor], int] = storage_id


class Operand(enum.Enum):
    """How a matmul reads a pending gather (Note [Matmul operands of a gather])."""

    ROWS = "A"
    ROWS_T = "A.t()"
    B_ROWS = "B"
    COLS = "A, gathered columns"


# select(t): the rows of t [M, X] that one chunk (or piece) of a reduce-scatter needs.
RowSelect = Callable[[torch.Tensor], torch.Tensor]


def all_rows(t: torch.Tensor) -> torch.Tensor:
    """The RowSelect that picks every row."""
    return t


# Note [Runs as one view]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Row-wise steps read and write every operand piece by piece, as runs of rows
# (``GatheredView.runs_of``), and so do the matmuls of a reduce-scatter along a
# dim > 0 (``ReduceScatterPlan.producer``). A reshape to the view's dims, a
# narrow to the rank's block, a narrow to the piece's rows and a reshape to
# runs is four views: about 32k instructions below autograd, where one
# ``as_strided`` costs 7.5k
# (benchmarks/results/call_instructions_2cpu_2026-12-04_ec3a99e.md). On a
# contiguous tensor the same elements are that one view: runs of ``length``
# rows, ``stride`` rows apart, from row ``start`` of the tensor seen as rows
# ``[M, X]`` (``rows_as_runs``), numbers that depend on the view's shape and
# the piece only, counted in rows so that every operand (whatever its last dim
# X) shares them. With ``L`` the view's leading dims, ``inner(d) =
# prod(L[d+1:])`` rows per index of dim d, rank ``src``'s block of ``block``
# indices along the gather dim and the piece's rows ``r0:r1`` along the
# shard's piece dim:
#
#     stride = L[dim] * inner(dim)
#     start  = src * block * inner(dim) + r0 * inner(piece_dim)
#     piece_dim >= dim: prod(L[:dim]) runs of (r1 - r0) * inner(piece_dim) rows
#     piece_dim <  dim: (r1 - r0) * prod(L[piece_dim+1:dim]) runs of block * inner(dim)
#
# (the dims of a shard before its piece dim have size 1: ``piece_dim`` in
# eagertp.backends.base). Non-contiguous tensors keep the four views.


def rows_as_runs(t: torch.Tensor, rows: int, count: int, length: int, stride: int, start: int) -> torch.Tensor | None:
    """``t`` seen as ``rows`` rows ``[rows, X]``: ``count`` runs of ``length``
    rows, ``stride`` rows apart, from row ``start``, as one view ``[count,
    length, X]`` (Note [Runs as one view]); None unless ``t`` is contiguous
    and holds that many rows (the caller takes its views one by one)."""
    x = t.shape[-1]
    if not t.is_contiguous() or t.numel() != rows * x:
        return None
    return t.as_strided((count, length, x), (stride * x, x, 1), t.storage_offset() + start * x)


@dataclasses.dataclass(frozen=True)
class _RunGeometry:
    """What ``runs_of`` needs of a view's shape, in rows (Note [Runs as one view])."""

    rows: int  # prod(L): the rows of the view, and of every tensor whose rows follow it
    lead: int  # prod(L[:dim]): runs of a whole block
    stride: int  # rows from one run to the next
    block_rows: int  # rows of one rank's block in a run: block * inner(dim)
    piece_rows: int  # rows per index of the piece dim: inner(piece_dim)
    piece_before_dim: bool
    between: int  # prod(L[piece_dim+1:dim]): runs per index of the piece dim, when it comes first

    @staticmethod
    def of(view: GatheredView) -> _RunGeometry:
        lead_dims = view.tensor.shape[:-1]
        dim, pdim = view.dim, view.piece_dim
        if not (dim < len(lead_dims) and pdim < len(lead_dims)):
            return _NOT_ROWS
        inner_dim = math.prod(lead_dims[dim + 1 :])
        return _RunGeometry(
            rows=math.prod(lead_dims),
            lead=math.prod(lead_dims[:dim]),
            stride=lead_dims[dim] * inner_dim,
            block_rows=view.block * inner_dim,
            piece_rows=math.prod(lead_dims[pdim + 1 :]),
            piece_before_dim=pdim < dim,
            between=math.prod(lead_dims[pdim + 1 : dim]),
        )


# A gather along its last dim: no runs of rows (``runs_of`` takes the four views).
_NOT_ROWS = _RunGeometry(rows=0, lead=0, stride=0, block_rows=0, piece_rows=0, piece_before_dim=False, between=0)


@dataclasses.dataclass(eq=False)
class GatheredView:
    """A pending gather as the program sees it: ``tensor`` is ``cat`` of the W
    shards along ``dim``. Dim 0 is the all-gather output itself; funcol builds
    the others with ``cat(ag.chunk(W), dim)``, which the mode defers too. A
    ``cast`` view holds the gathered data converted to its own dtype (autocast's
    ``_to_copy`` before a linear), filled piece by piece like the others."""

    tensor: torch.Tensor  # placeholder
    dim: int
    world: int
    tid: int
    cast: bool = False
    # Made by a row-wise step from the gather's rows (Note [Row-wise ops on
    # gathered rows] in eagertp.rowwise): written by the step, not filled.
    derived: bool = False
    # The dim of one rank's shard (and of this view) that pieces split, and
    # the shard's size along it: the rows the pieces' ``rows`` count.
    piece_dim: int = dataclasses.field(init=False, repr=False)
    shard_rows: int = dataclasses.field(init=False, repr=False)
    block: int = dataclasses.field(init=False, repr=False)  # size of one rank's block along ``dim``
    _runs: _RunGeometry | None = dataclasses.field(init=False, repr=False, default=None)  # once runs_of asks

    def __post_init__(self) -> None:
        shard_shape = list(self.tensor.shape)
        shard_shape[self.dim] //= self.world
        self.piece_dim = piece_dim(shard_shape)
        self.shard_rows = shard_shape[self.piece_dim]
        self.block = shard_shape[self.dim]

    def observed(self) -> bool:
        """False if nothing but this view can reach its placeholder (the
        program dropped the cat funcol made, as a matmul's operand only): then
        filling it would be a copy nobody can see."""
        return not _held_by_item_only(self.tensor)

    def fill(self, piece: torch.Tensor, src: int, rows: slice) -> None:
        """Copy (or cast) rows ``rows`` of rank ``src``'s shard into place (the
        all-gather output itself: the ring already put them there)."""
        if self.dim or self.cast:
            self.piece_of(src, rows).copy_(piece)

    def piece_of(self, src: int, rows: slice) -> torch.Tensor:
        """Where rows ``rows`` of rank ``src``'s shard sit in this view."""
        return self.block_of(self.tensor, src, rows)

    def block_of(self, t: torch.Tensor, src: int, rows: slice | None = None) -> torch.Tensor:
        """Rank ``src``'s block of ``t`` (shaped as this view but for its last
        dim), or the rows ``rows`` of it: a view."""
        block = t.narrow(self.dim, src * self.block, self.block)
        return block if rows is None else block.narrow(self.piece_dim, rows.start, rows.stop - rows.start)

    def data(self, piece: torch.Tensor, src: int, rows: slice) -> torch.Tensor:
        """This view's data for a piece a backend delivered (after ``fill``)."""
        return self.piece_of(src, rows) if self.cast or self.derived else piece

    def rows_of(self, t: torch.Tensor, src: int, rows: slice | None = None) -> torch.Tensor:
        """The rows of ``t`` [M, X] (whose rows follow this view's) that rows
        ``rows`` of rank ``src``'s shard make: all of ``R_src`` when ``rows`` is
        None. With dim 0 they are contiguous; else a strided copy."""
        if self.dim == 0:
            per_rank = t.shape[0] // self.world
            start, stop = src * per_rank, (src + 1) * per_rank
            if rows is not None:  # aligned(): whole rows of t per shard row
                per_shard_row = per_rank // self.shard_rows
                start, stop = start + rows.start * per_shard_row, start + rows.stop * per_shard_row
            return t[start:stop]
        return self.runs_of(t, src, rows).reshape(-1, t.shape[-1])

    def runs_of(self, t: torch.Tensor, src: int, rows: slice | None = None) -> torch.Tensor:
        """``rows_of`` as runs of contiguous rows, a view ``[runs, rows per run,
        X]``: along dim d > 0 one run per index of the dims before d."""
        # NB: the hot path (every row-wise step, each operand and piece): one
        # view, not four (Note [Runs as one view]).
        runs = self._runs
        if runs is None:
            runs = self._runs = _RunGeometry.of(self)
        if runs is not _NOT_ROWS:
            if rows is None:
                count, length, start = runs.lead, runs.block_rows, src * runs.block_rows
            else:
                start = src * runs.block_rows + rows.start * runs.piece_rows
                if runs.piece_before_dim:
                    count, length = (rows.stop - rows.start) * runs.between, runs.block_rows
                else:
                    count, length = runs.lead, (rows.stop - rows.start) * runs.piece_rows
            found = rows_as_runs(t, runs.rows, count, length, runs.stride, start)
            if found is not None:
                return found
        block = self.block_of(t.reshape(*self.tensor.shape[:-1], t.shape[-1]), src, rows)  # NB: says what is wrong
        return block.reshape(math.prod(block.shape[: self.dim]), -1, t.shape[-1])

    def aligned(self, t: torch.Tensor) -> bool:
        """True if every shard row makes whole rows of ``t`` (a row view of this
        gathered tensor), so pieces of a shard map to row ranges of ``t``."""
        return self.dim != 0 or (t.shape[0] // self.world) % self.shard_rows == 0

    def is_rows(self, g: torch.Tensor) -> bool:
        """True if ``g`` is this view seen as rows ``[M, C]`` that split by rank."""
        if not self._is_whole_2d(g):
            return False
        if self.dim == 0:
            shard_numel = self.tensor.numel() // self.world
            return shard_numel % g.shape[1] == 0
        return self.dim < self.tensor.dim() - 1 and g.shape[1] == self.tensor.shape[-1]

    def is_cols(self, g: torch.Tensor) -> bool:
        """True if ``g`` is this view, gathered along its last dim, seen as ``[M, W*c]``."""
        return (
            0 < self.dim == self.tensor.dim() - 1
            and self._is_whole_2d(g)
            and g.shape[1] == self.tensor.shape[-1]
        )

    def _is_whole_2d(self, g: torch.Tensor) -> bool:
        return (
            g.dim() == 2
            and g.numel() > 0
            and g.is_contiguous()
            and g.storage_offset() == self.tensor.storage_offset()
            and g.numel() == self.tensor.numel()
        )


@dataclasses.dataclass(eq=False)
class ScatterView:
    """``tensor = cat(out.view(shape).chunk(W, dim), 0)`` of a pending matmul
    output: what funcol feeds a reduce-scatter along ``dim`` > 0."""

    tensor: torch.Tensor  # placeholder
    shape: torch.Size  # the matmul output as the program saw it, [..., N]
    dim: int
    world: int

    def fill(self, mm_out: torch.Tensor) -> None:
        torch.cat(mm_out.view(*self.shape).chunk(self.world, self.dim), 0, out=self.tensor)  # NB: sizes apart


class _Standalone:
    """What a standalone matmul and a sum of matmuls share: issued on their own
    at a flush, or skipped when nothing can read them."""

    __slots__ = ()

    def issue_standalone(self) -> None:
        self.compute_all(self.out)
        for sv in self.scatter_views:
            sv.fill(self.out)

    def compute_row_range(self, start: int, stop: int, out: torch.Tensor) -> None:
        """``out = self[start:stop]``: a range of this product's rows."""
        self.compute_rows(lambda t: t[start:stop], out)

    def unobserved(self) -> bool:
        """True if nothing but this pending item can reach its placeholders.
        Then computing it would be work that nobody can observe."""
        if not _held_by_item_only(self.out):
            return False
        for sv in self.scatter_views:  # NB: a loop, not all(): most have none
            if not _held_by_item_only(sv.tensor):
                return False
        return True


@dataclasses.dataclass(eq=False, slots=True)
class Scaled:
    """The FP8 part of ``aten._scaled_mm(A, B, scale_a, scale_b, bias,
    scale_result, out_dtype, use_fast_accum)``. ``scale_a`` is tensor-wise (one
    element) or row-wise ([M, 1]: selected with A's rows)."""

    scale_a: torch.Tensor
    scale_b: torch.Tensor
    scale_result: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None
    use_fast_accum: bool = False

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.scale_a, self.scale_b, self.scale_result) if t is not None]


# Note [Epilogues]
# ~~~~~~~~~~~~~~~~
# float8 training with row-wise scales multiplies a matmul's output in place
# by the product of its scales (torchao's ``output *= a_inv_scale *
# b_inv_scale``), and may add a bias in place: had that op read the pending
# product, the product would be computed whole and its reduce-scatter or
# all-reduce issued unfused. A ``mul`` or ``add`` of a standalone pending
# product's whole output by a tensor that broadcasts to it (a scalar, per-row
# [M, 1], per-column [1, N], or [M, N]) or by a number stays part of the
# product instead: each chunk the product makes (every row of it, or some
# columns) is multiplied or added by the same elements of the operand, as
# plain eager does to the whole output. In place on a matmul, right after its
# matmul (``Epilogue``); out of place, on any product, into a new placeholder
# of the op's result type (``PendingPointwise``, the source kept pending for
# other readers, as a cast keeps it). Elementwise on the same values: bitwise
# plain eager's. The operand is an input of the pending product (a write to it
# completes the product first: Note [Every write is seen] in eagertp.engine).
#
# A matmul bound to a gather in flight as its rows (a row-wise float8 input
# gradient: the gathered output gradient, quantized row by row, times the
# weight) keeps an in-place epilogue the same way, applied to the rows each
# piece makes right after the matmul of those rows. Its operand may then also
# be rows that the gather's row-wise steps make (``a_inv_scale * b_inv_scale``
# is such rows: Note [Row-wise ops on gathered rows] in eagertp.rowwise): the
# steps of a piece run before its matmuls, so the piece's rows of it are made.


@dataclasses.dataclass(eq=False, slots=True)
class Epilogue:
    """``out.<op>_(operand)`` on a pending matmul's output (Note [Epilogues])."""

    op: Callable[[torch.Tensor, torch.Tensor | float], torch.Tensor]  # torch.Tensor.mul_ or add_
    operand: torch.Tensor | float

    def apply(self, out: torch.Tensor, shape: torch.Size, select: RowSelect | None, cols: slice | None = None) -> None:
        """Apply to ``out``, the rows ``select`` picks (and the columns
        ``cols``) of the product's whole output of ``shape``."""
        self.op(out, _operand_for(self.operand, shape, select, cols))


@dataclasses.dataclass(eq=False, slots=True)
class PendingMatmul(_Standalone):
    """``out = addmm(bias, a, b, beta=beta, alpha=alpha)``, or ``mm(a, b)`` when
    ``bias`` is None, not yet computed.

    For a consumer of a pending gather, ``operand`` says where the gathered
    ``view`` enters and that operand (``a`` or ``b``) is None; a standalone
    matmul has both, and may have ``scatter_views`` waiting on its output.
    """

    op: torch._ops.OpOverload
    a: torch.Tensor | None
    b: torch.Tensor | None
    out: torch.Tensor  # placeholder [M, N]
    tid: int
    bias: torch.Tensor | None = None
    beta: float = 1
    alpha: float = 1
    operand: Operand | None = None
    view: GatheredView | None = None
    scatter_views: list[ScatterView] = dataclasses.field(default_factory=list)
    # A term of a pending sum: once the sum is produced, nothing may read it.
    absorbed: bool = False
    scaled: Scaled | None = None  # aten._scaled_mm (FP8)
    # The dtype the matmul reads the gathered operand as: float8 training gathers
    # uint8 and views the result back (a type-erased all-gather).
    gathered_dtype: torch.dtype | None = None
    # The gather in flight whose placeholder is the row-wise ``scale_a``
    # (Note [Gathered row-wise scales]).
    scale_gather: PendingGather | None = None
    # In-place elementwise ops on the whole output, in order (Note [Epilogues]).
    epilogues: list[Epilogue] = dataclasses.field(default_factory=list)
    # A standalone matmul's place among the block's matmuls, and the collectives
    # issued before it was deferred (Note [Deferrals that gained nothing] in
    # eagertp.deferring); -1: not remembered.
    ordinal: int = -1
    issued_at: int = 0

    @property
    def name(self) -> str:
        return self.op.__name__.split(".")[0]

    def describe(self) -> Lazy:
        """``mm (gathered cols) -> $3``, formatted when read (Note [Formatted when read])."""
        return Lazy(_describe_matmul, self.op, self.operand, self.tid)

    def trace_event(self) -> Event:
        """The ``Trace`` event ``(render, args)``: no tensors kept, formatted later.
        Operands are gathered-view ids (ints) or shapes; all share ``out``'s dtype."""
        g = None if self.view is None else self.view.tid
        a = g if self.a is None else self.a.shape
        b = g if self.b is None else self.b.shape
        bias = None if self.bias is None else self.bias.shape
        in_dtype = (self.b if self.b is not None else self.a).dtype
        return _render_matmul, (
            self.tid, in_dtype, self.out.dtype, self.out.shape, self.op, a, b, bias, self.operand is Operand.ROWS_T,
        )

    def compute(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        select: RowSelect | None = None,
        *,
        scale_a: torch.Tensor | None = None,
    ) -> None:
        """Plain eager on ``a`` and ``b``, into ``out``. ``a`` may be some rows of
        the matmul's A, picked by ``select``, which then picks the same rows of
        everything indexed by A's rows (addmm's broadcast bias, a row-wise
        ``scale_a``, unless given: a gathered scale's rows read where they
        landed, Note [Gathered row-wise scales]). A 3-d ``a`` is runs of rows
        (``[runs, rows, K]``, ``out`` likewise): one matmul per run."""
        if a.dim() == 3:
            for i in range(a.shape[0]):
                run = None if select is None else (lambda t, i=i: select(t)[i])
                self.compute(a[i], b, out[i], run, scale_a=None if scale_a is None else scale_a[i])
            return
        if self.scaled is not None:
            sc = self.scaled
            if scale_a is None:
                scale_a = sc.scale_a if select is None or sc.scale_a.numel() == 1 else select(sc.scale_a)
            torch._scaled_mm(
                a, b, _aligned(scale_a), sc.scale_b, bias=self.bias, scale_result=sc.scale_result,
                out_dtype=sc.out_dtype, use_fast_accum=sc.use_fast_accum, out=out,
            )
        elif self.bias is None:
            torch.mm(a, b, out=out)
        else:
            bias = self.bias if select is None else select(self.bias.expand(*self.out.shape))
            torch.addmm(bias, a, b, beta=self.beta, alpha=self.alpha, out=out)
        for epilogue in self.epilogues:
            epilogue.apply(out, self.out.shape, select)

    def compute_rows(self, select: RowSelect, out: torch.Tensor) -> None:
        """``out = select(self)``: the selected rows of this standalone matmul."""
        assert self.a is not None and self.b is not None, "a gather consumer has no rows of its own"
        self.compute(select(self.a), self.b, out, select)

    def compute_row_range(self, start: int, stop: int, out: torch.Tensor) -> None:
        """``out = self[start:stop]``: ``compute_rows`` of a range of rows, with
        no selector (NB: every piece of a fused reduce-scatter along dim 0)."""
        assert self.a is not None and self.b is not None, "a gather consumer has no rows of its own"
        a = self.a[start:stop]
        if self.bias is None and self.scaled is None and not self.epilogues:
            torch.mm(a, self.b, out=out)  # NB: compute()'s plain case, one frame shorter
        else:
            self.compute(a, self.b, out, lambda t: t[start:stop])

    def compute_cols(self, cols: slice, out: torch.Tensor, select: RowSelect = all_rows) -> None:
        """``out = select(self)[:, cols]``: some output columns (B's columns, and
        the bias's and a row-wise ``scale_b``'s with them) of the rows ``select``
        picks (A's rows, and a row-wise ``scale_a``'s and the bias's with them)."""
        assert self.a is not None and self.b is not None, "a gather consumer has no columns of its own"
        a, b = select(self.a), self.b[:, cols]
        if self.scaled is not None:
            sc = self.scaled
            scale_a = sc.scale_a if sc.scale_a.numel() == 1 else select(sc.scale_a)
            scale_b = sc.scale_b if sc.scale_b.numel() == 1 else sc.scale_b[:, cols]
            torch._scaled_mm(
                a, b, _aligned(scale_a), _aligned(scale_b), bias=None if self.bias is None else self.bias[cols],
                scale_result=sc.scale_result, out_dtype=sc.out_dtype, use_fast_accum=sc.use_fast_accum, out=out,
            )
        elif self.bias is None:
            torch.mm(a, b, out=out)
        else:
            bias = select(self.bias.expand(*self.out.shape))[:, cols]
            torch.addmm(bias, a, b, beta=self.beta, alpha=self.alpha, out=out)
        for epilogue in self.epilogues:
            epilogue.apply(out, self.out.shape, select, cols)

    def compute_all(self, out: torch.Tensor) -> None:
        assert self.a is not None and self.b is not None, "a gather consumer is issued by its gather"
        self.compute(self.a, self.b, out)

    def issue_standalone(self) -> None:
        # NB: _Standalone's, one frame shorter: every read of a deferred matmul.
        assert self.a is not None and self.b is not None, "a gather consumer is issued by its gather"
        if self.bias is None and self.scaled is None and not self.epilogues:
            torch.mm(self.a, self.b, out=self.out)  # NB: compute()'s, one frame shorter: most reads
        else:
            self.compute(self.a, self.b, self.out)
        for sv in self.scatter_views:
            sv.fill(self.out)

    def inputs(self) -> list[torch.Tensor]:
        # NB: on the hot path (every deferred matmul, twice): no comprehensions.
        tensors = []
        for t in (self.a, self.b, self.bias):
            if t is not None:
                tensors.append(t)
        if self.scaled is not None:
            tensors += self.scaled.tensors()
        for e in self.epilogues:
            if isinstance(e.operand, torch.Tensor):
                tensors.append(e.operand)
        return tensors


@dataclasses.dataclass(eq=False)
class PendingSum(_Standalone):
    """``out = terms[0].out + terms[1].out + ...`` of standalone pending matmuls,
    not yet computed: autograd's accumulation of an input gradient that several
    matmuls produced (dX = dQ @ Wq + dK @ Wk + dV @ Wv). The terms stay pending
    items of their own; one whose output nobody can reach is never computed."""

    terms: list[PendingMatmul | PendingCast]
    out: torch.Tensor  # placeholder [M, N]
    tid: int
    scatter_views: list[ScatterView] = dataclasses.field(default_factory=list)
    absorbed: bool = False  # a partial sum that a longer sum took over

    @property
    def name(self) -> str:
        return " + ".join(t.name for t in self.terms)

    def describe(self) -> str:
        return f"{self.name} -> ${self.tid}"

    def render(self) -> str:
        return f"${self.tid}: {tensor_str(self.out)} = " + " + ".join(f"${t.tid}" for t in self.terms)

    def compute_rows(self, select: RowSelect, out: torch.Tensor) -> None:
        self._sum(lambda term, part: term.compute_rows(select, part), out)

    def compute_cols(self, cols: slice, out: torch.Tensor, select: RowSelect = all_rows) -> None:
        self._sum(lambda term, part: term.compute_cols(cols, part, select), out)

    def _sum(self, compute: Callable[[PendingMatmul, torch.Tensor], None], out: torch.Tensor) -> None:
        # Left to right, each product rounded on its own, as plain eager adds them.
        compute(self.terms[0], out)
        for term in self.terms[1:]:
            part = torch.empty_like(out)
            compute(term, part)
            out.add_(part)

    def compute_all(self, out: torch.Tensor) -> None:
        self.compute_rows(all_rows, out)

    def inputs(self) -> list[torch.Tensor]:
        return [t for term in self.terms for t in term.inputs()]


@dataclasses.dataclass(eq=False)
class PendingCast(_Standalone):
    """``out = source.out.to(out.dtype)`` of a standalone pending product, not
    yet computed: autocast casting a gradient before its reduce-scatter. The
    source stays pending (absorbed) for any other reader."""

    source: PendingMatmul | PendingSum | PendingCast
    out: torch.Tensor  # placeholder, source.out's shape
    tid: int
    scatter_views: list[ScatterView] = dataclasses.field(default_factory=list)
    absorbed: bool = False

    @property
    def name(self) -> str:
        return f"({self.source.name}).to({dtype_str(self.out.dtype)})"

    def describe(self) -> str:
        return f"{self.name} -> ${self.tid}"

    def compute_rows(self, select: RowSelect, out: torch.Tensor) -> None:
        self._cast(lambda part: self.source.compute_rows(select, part), out)

    def compute_cols(self, cols: slice, out: torch.Tensor, select: RowSelect = all_rows) -> None:
        self._cast(lambda part: self.source.compute_cols(cols, part, select), out)

    def _cast(self, compute: Callable[[torch.Tensor], None], out: torch.Tensor) -> None:
        # In the source's dtype first, then cast: as plain eager rounds it.
        part = torch.empty_like(out, dtype=self.source.out.dtype)
        compute(part)
        out.copy_(part)

    def compute_all(self, out: torch.Tensor) -> None:
        self.compute_rows(all_rows, out)

    def inputs(self) -> list[torch.Tensor]:
        return self.source.inputs()


@dataclasses.dataclass(eq=False)
class PendingPointwise(PendingCast):
    """``out = op(source.out, operand)`` of a standalone pending product, not
    yet computed: a scale multiply or a bias add out of place (Note
    [Epilogues]), in ``out``'s dtype (the op's result type). The source stays
    pending (absorbed) for any other reader."""

    op: Callable[..., torch.Tensor] = torch.mul  # torch.mul or torch.add, with out=
    operand: torch.Tensor | float = 1

    @property
    def name(self) -> str:
        return f"{self.source.name} {'*' if self.op is torch.mul else '+'} {operand_str(self.operand)}"

    def compute_rows(self, select: RowSelect, out: torch.Tensor) -> None:
        part = torch.empty_like(out, dtype=self.source.out.dtype)
        self.source.compute_rows(select, part)
        self.op(part, _operand_for(self.operand, self.out.shape, select), out=out)

    def compute_cols(self, cols: slice, out: torch.Tensor, select: RowSelect = all_rows) -> None:
        part = torch.empty_like(out, dtype=self.source.out.dtype)
        self.source.compute_cols(cols, part, select)
        self.op(part, _operand_for(self.operand, self.out.shape, select, cols), out=out)

    def inputs(self) -> list[torch.Tensor]:
        return self.source.inputs() + ([self.operand] if isinstance(self.operand, torch.Tensor) else [])


def _operand_for(
    operand: torch.Tensor | float, shape: torch.Size, select: RowSelect | None, cols: slice | None = None
) -> torch.Tensor | float:
    """The elements of ``operand`` (broadcast to a product's whole output of
    ``shape``) that the rows ``select`` picks, and the columns ``cols``."""
    if not isinstance(operand, torch.Tensor) or not operand.dim() or (select is None and cols is None):
        return operand
    operand = operand.expand(shape)
    if select is not None:
        operand = select(operand)
    return operand if cols is None else operand[..., cols]


def operand_str(operand: torch.Tensor | float) -> str:
    return tensor_str(operand) if isinstance(operand, torch.Tensor) else repr(operand)


Product = PendingMatmul | PendingSum | PendingCast


def _aligned(scale: torch.Tensor) -> torch.Tensor:
    """``scale``, copied where it starts off a 16-byte boundary: cuBLAS's
    row-wise FP8 kernel requires aligned scales, and a chunk's rows of an
    ``[M, 1]`` float32 scale start at ``4 * rows`` bytes (torch's fused scaled
    matmuls clone such slices too). A few bytes per chunk; done on every device
    so that the CPU tests see the same calls."""
    return scale.clone() if scale.data_ptr() % 16 else scale


def _describe_matmul(op: torch._ops.OpOverload, operand: Operand | None, tid: int) -> str:
    via = "" if operand in (None, Operand.ROWS) else f" (gathered {operand.value})"
    return f"{op.__name__.split('.')[0]}{via} -> ${tid}"


def _render_matmul(
    tid: int,
    in_dtype: torch.dtype,
    out_dtype: torch.dtype,
    out: torch.Size,
    op: torch._ops.OpOverload,
    a: int | torch.Size,
    b: int | torch.Size,
    bias: torch.Size | None,
    a_t: bool,
) -> str:
    """``$3: f32[8, 6] = addmm(f32[6], $0, f32[16, 6])``: ints are gathered views."""

    def operand(x: int | torch.Size, dtype: torch.dtype) -> str:
        return f"${x}" if isinstance(x, int) else tensor_str(Meta(dtype, x))

    operands = [operand(a, in_dtype) + (".t()" if a_t else ""), operand(b, in_dtype)]
    if bias is not None:
        operands.insert(0, operand(bias, out_dtype))
    return f"${tid}: {operand(out, out_dtype)} = {op.__name__.split('.')[0]}({', '.join(operands)})"


def _python_refs(t: torch.Tensor) -> int:
    """References to ``t`` seen from inside a function called with it."""
    return sys.getrefcount(t)


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.out = t


# What sys.getrefcount(t) reads inside a function called as f(item.out) when
# only the item holds the tensor, measured the same way so that interpreter
# details cancel out.
_holder = _Holder(torch.empty(0))
_ONLY_HELD = _python_refs(_holder.out)
del _holder


def _held_by_item_only(t: torch.Tensor, *, attributes: int = 1, storage_users: int = 2) -> bool:
    """True if nothing but the pending item whose attribute ``t`` is (called as
    ``_held_by_item_only(item.attr)``) can reach it: no other Python reference
    (``attributes``: how many of the item's attributes hold ``t``), no C++
    holder (autograd), no other tensor on its storage (``storage_users``, as
    ``storage_uses`` counts them: by default ``t`` and the call's storage
    object), no weak reference (which could bring it back)."""
    return (
        sys.getrefcount(t) <= _ONLY_HELD + attributes - 1  # NB: called as _python_refs is: see _ONLY_HELD
        and t._use_count() == 1
        and storage_uses(t) == storage_users
        and not weakref.getweakrefcount(t)
    )


def storage_uses(t: torch.Tensor) -> int:
    """Tensors (and storage objects) on ``t``'s storage, counting the Python
    storage object this call makes."""
    # NB: through a Python storage object, which the storage keeps once made:
    # the count includes exactly one, whichever call made it.
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _matmul_leaves(items: Iterable[Pending]) -> list[PendingMatmul]:
    """The matmuls behind ``items`` (a sum's terms, a cast's source, a gather's
    consumers), each once."""
    found: dict[int, PendingMatmul] = {}
    stack: list = list(items)
    while stack:
        item = stack.pop()
        if isinstance(item, PendingMatmul):
            found.setdefault(id(item), item)
        elif isinstance(item, PendingSum):
            stack += item.terms
        elif isinstance(item, PendingCast):
            stack.append(item.source)
        else:
            stack += item.consumers
    return list(found.values())


def _refs(tensors: dict[int, torch.Tensor]) -> dict[int, int]:
    """sys.getrefcount of each of ``tensors``, seen from here."""
    return {key: sys.getrefcount(t) for key, t in tensors.items()}


# What _refs reads for a tensor that only its dict holds.
_REFS_BASE = _refs({0: torch.empty(0)})[0]
# ... and for a view's base that only its dict and its views hold. NB: one more:
# a TensorImpl that another C++ owner shares (the view's) keeps a reference to
# its Python object (torch 2.11-2.13), so a base never reads _REFS_BASE.
_view = torch.empty(2)[:1]
_REFS_VIEWED_BASE = _refs({0: _view._base})[0]
del _view


def orphaned_storages(items: Iterable[Pending], among: set[int]) -> set[int]:
    """The storages of ``among`` that nothing but the inputs of ``items`` can
    reach (Note [Products past their collective]): no other Python reference
    to those tensors or their view bases, no C++ holder (autograd), no other
    view."""
    tensors: dict[int, torch.Tensor] = {}
    uses: dict[int, int] = {}
    for mm in _matmul_leaves(items):
        for t in (mm.a, mm.b, mm.bias):
            # NB: only the tensors on those storages: the others' counts decide nothing.
            if t is not None and storage_key(t) in among:
                tensors[id(t)] = t
                uses[id(t)] = uses.get(id(t), 0) + 1
    if not tensors:
        return set()
    refs = _refs(tensors)
    per_storage: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
    for key, t in tensors.items():
        held = refs[key] == _REFS_BASE + uses[key] and t._use_count() == 1 and not weakref.getweakrefcount(t)
        per_storage[storage_key(t)].append(t if held else None)
    orphans: set[int] = set()
    for key, held in per_storage.items():
        if any(t is None for t in held):
            continue
        bases = {id(t._base): t._base for t in held if t._base is not None}
        views = collections.Counter(id(t._base) for t in held if t._base is not None)
        base_refs = _refs(bases)
        if any(
            base_refs[i] != _REFS_VIEWED_BASE or b._use_count() != 1 + views[i] or weakref.getweakrefcount(b)
            for i, b in bases.items()
        ):
            continue
        # NB: untyped_storage() makes a Python storage object: one more use.
        if torch._C._storage_Use_Count(held[0].untyped_storage()._cdata) == len(held) + len(bases) + 1:
            orphans.add(key)
    return orphans


# Note [Freed without the garbage collector]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Pending work links to other pending work both ways in two places: a gather
# lists the row-wise steps of other gathers that read its rows (``read_by``),
# whose operands name it (``RowOperand.other``: DTensor's backward adding q's,
# k's and v's all-reduced input gradients); and a scale gather lists the
# consumers whose row-wise scale_a it is (``scale_of``), which name it
# (``PendingMatmul.scale_gather``: float8's row-wise recipe). Each is a
# reference cycle, and a cycle is freed only when Python's garbage collector
# next looks at it: with it went the gathers' placeholders, the all-reduce's
# result and the ring's buffers, activation-sized tensors held past the step
# (for as long as the collector's older generations wait, once a collection
# saw them alive). So a gather completed and accounted forgets those links
# (``unlink``), and everything eagertp makes for a call is freed by reference
# counting when the program drops it. tests/test_memory_cycles.py checks the
# demo's steps, gathered row-wise scales and the fused forms for cyclic
# garbage, tests/test_hf.py HuggingFace's Llama without sequence parallel,
# tests/test_fuzz.py every program it draws.


@dataclasses.dataclass(eq=False)
class PendingGather:
    """``out = all_gather_into_tensor(shard, group)``, in flight: the backend
    started moving it where the program issued it (``handle``), and matmuls on
    ``out`` bind to it as ``consumers`` until something reads it."""

    shard: torch.Tensor  # contiguous
    out: torch.Tensor  # placeholder [W * shard.shape[0], *shard.shape[1:]]
    group: dist.ProcessGroup
    tid: int
    record: CollectiveRecord
    consumers: list[PendingMatmul] = dataclasses.field(default_factory=list)
    views: list[GatheredView] = dataclasses.field(default_factory=list)
    handle: GatherHandle | None = None  # None until started
    backend: str = ""  # the backend's name as explain() shows it
    # verify=True: plain eager's gathered tensor, made when the gather started.
    reference: torch.Tensor | None = None
    # Matmul work the mode had seen run when the gather started: what ran while
    # it was in flight is the difference at completion (Note [Overlap accounting]).
    work_at_start: int = 0
    # Consumers of other gathers whose row-wise scale_a this gather's placeholder
    # is (Note [Gathered row-wise scales]).
    scale_of: list[PendingMatmul] = dataclasses.field(default_factory=list)
    # The all-gather half of a fused all-reduce: ``record`` is the all-reduce's
    # (Note [Matmul + all-reduce] in eagertp.collectives.all_reduce).
    half_of_all_reduce: bool = False
    # Its shard was made as it was sent, by the product it gathers (Note
    # [Matmul + all-gather] in eagertp.collectives.all_gather): accounted for
    # where it was issued.
    produced: bool = False
    # Why the pending product that made its shard ran whole before the gather
    # started instead (explain() adds it if the gather stays unfused).
    made_first: Text | None = None
    # Tensors on ``out``'s storage once the gather started (the placeholder
    # and the backend's views of it); None: not counted (Note [This rank's
    # chunk, unread] in eagertp.engine).
    storage_uses_at_start: int | None = None
    # Row-wise ops on its rows, in program order, and the results of ops
    # that reduce over them (Note [Row-wise ops on gathered rows] in
    # eagertp.rowwise); the steps of other gathers that read its rows.
    steps: list[RowwiseStep] = dataclasses.field(default_factory=list)
    wholes: list[WholeStep] = dataclasses.field(default_factory=list)
    read_by: list[RowwiseStep] = dataclasses.field(default_factory=list)
    completed: bool = False

    def __post_init__(self) -> None:
        self.views.append(GatheredView(self.out, 0, self.group.size(), self.tid))

    def shard_in_out(self) -> bool:
        """True if the shard is rows of ``out`` itself (an all-reduce's gather
        half, a product made in this rank's chunk), not a tensor of the
        program's: nothing can write it before the gather completes."""
        return storage_key(self.shard) == storage_key(self.out)

    def unlink(self) -> None:
        """Forget the pending work of other gathers that links back to this one,
        once completed and accounted (Note [Freed without the garbage collector])."""
        self.read_by = []
        self.scale_of = []

    def consumer_writing(self, t: torch.Tensor) -> PendingMatmul | None:
        """The consumer whose output placeholder ``t`` views, if any."""
        key = storage_key(t)
        return next((mm for mm in self.consumers if storage_key(mm.out) == key), None)

    def view_of(self, t: torch.Tensor) -> GatheredView | None:
        key = storage_key(t)
        for v in self.views:  # NB: a loop: every matmul on a gather asks
            if storage_key(v.tensor) == key:
                return v
        return None

    def placeholders(self) -> list[torch.Tensor]:
        found = []
        for v in self.views:  # NB: a loop, not a comprehension's frame: every completion asks
            found.append(v.tensor)
        for mm in self.consumers:
            found.append(mm.out)
        for w in self.wholes:
            found += w.placeholders()
        return found

    def out_unreachable(self) -> bool:
        """True if nothing but this gather can reach ``out``'s data: no other
        Python reference to it, no C++ holder (autograd), no weak reference,
        and no tensor on its storage that was not there when it started (a view
        the program kept, in inference mode too, where views hold no base)."""
        # NB: two attributes hold it (``out`` and ``views[0].tensor``); the
        # backend's views share its storage, counted when the gather started.
        return self.storage_uses_at_start is not None and _held_by_item_only(
            self.out, attributes=2, storage_users=self.storage_uses_at_start
        )

    def scale_gathers(self) -> list[PendingGather]:
        """The gathers whose rows this one's consumers take as ``scale_a``."""
        found: dict[int, PendingGather] = {}
        for mm in self.consumers:
            if mm.scale_gather is not None:
                found.setdefault(id(mm.scale_gather), mm.scale_gather)
        return list(found.values())

    def inputs(self) -> list[torch.Tensor]:
        # NB: not the shard: a write to it waits for the sends that read it
        # and leaves the gather pending (Note [Sends from the shard] in eagertp.engine).
        tensors = []
        for mm in self.consumers:
            tensors += mm.inputs()
        if self.steps or self.wholes:
            tensors += [t for step in (*self.steps, *self.wholes) for t in step.inputs()]
        return tensors


Pending = PendingGather | Product


def is_weight_gradient(product: Product) -> bool:
    """``g.t() @ x``: A is a transposed contiguous tensor, the contraction runs
    over tokens, as autograd's weight gradient of a linear layer."""
    a = getattr(product, "a", None)
    return a is not None and a.dim() == 2 and not a.is_contiguous() and a.t().is_contiguous()


class PendingStore:
    """Pending work in record order (gathers in flight and standalone products),
    which storages it owns and which it will read."""

    def __init__(self) -> None:
        self.items: list[Pending] = []
        self._owner: dict[int, Pending] = {}  # placeholder storage -> item
        # storage -> how many times pending work reads it. NB: a dict, not a
        # Counter, whose ``__missing__`` and ``__delitem__`` are Python frames.
        self._inputs: dict[int, int] = {}
        # shard storage -> the program's gathers in flight that may still send
        # from it (Note [Sends from the shard] in eagertp.engine)
        self.sending: dict[int, list[PendingGather]] = {}
        self._ids = itertools.count()
        self.last_tid = -1  # the latest id handed out

    def __bool__(self) -> bool:
        return bool(self.items)

    def next_tid(self) -> int:
        self.last_tid = next(self._ids)
        return self.last_tid

    def add_gather(self, gather: PendingGather) -> None:
        key = storage_key(gather.out)
        # NB: a gather into the program's own buffer: what filled it before
        # completed first (Note [Every write is seen] in eagertp.engine).
        assert key not in self._owner, f"all_gather ${gather.tid} into a buffer ${self._owner[key].tid} still fills"
        self.items.append(gather)
        self._owner[key] = gather
        if not gather.shard_in_out():
            self.sending.setdefault(storage_key(gather.shard), []).append(gather)

    def add_gathered_view(self, gather: PendingGather, view: GatheredView) -> None:
        gather.views.append(view)
        self._owner[storage_key(view.tensor)] = gather

    def add_scatter_view(self, product: Product, view: ScatterView) -> None:
        product.scatter_views.append(view)
        self._owner[storage_key(view.tensor)] = product

    def add_product(self, product: Product) -> None:
        """A standalone matmul or sum (again, after a fused reduce-scatter took it out)."""
        # NB: on the hot path (every deferred matmul): plain loops, no generators.
        self.items.append(product)
        owner = self._owner
        owner[storage_key(product.out)] = product
        for sv in product.scatter_views:
            owner[storage_key(sv.tensor)] = product
        self._read(product.inputs())

    def add_epilogue(self, product: PendingMatmul, epilogue: Epilogue) -> None:
        """An in-place op on ``product``'s output, kept with it (Note [Epilogues])."""
        product.epilogues.append(epilogue)
        if isinstance(epilogue.operand, torch.Tensor):
            self._read([epilogue.operand])

    def add_rowwise(
        self, gather: PendingGather, step: RowwiseStep | None, views: list[GatheredView], whole: WholeStep | None
    ) -> None:
        """A row-wise op on ``gather``'s rows, its derived views, and its results
        over the rows (Note [Row-wise ops on gathered rows] in eagertp.rowwise)."""
        for view in views:
            self.add_gathered_view(gather, view)
        added = []
        if step is not None:
            gather.steps.append(step)
            added += step.inputs()
            for op in step.operands:
                if op.other is not None:
                    op.other.read_by.append(step)
        if whole is not None:
            gather.wholes.append(whole)
            added += whole.inputs()
            for t in whole.placeholders():
                self._owner[storage_key(t)] = gather
        self._read(added)

    def remove_consumer(self, gather: PendingGather, mm: PendingMatmul) -> None:
        """Unbind ``mm`` from ``gather`` (``add_consumer`` undone)."""
        gather.consumers.remove(mm)
        del self._owner[storage_key(mm.out)]
        self._release(mm.inputs())

    def add_consumer(self, gather: PendingGather, mm: PendingMatmul) -> None:
        gather.consumers.append(mm)
        self._owner[storage_key(mm.out)] = gather
        self._read(mm.inputs())

    def remove(self, item: Pending) -> None:
        """Take an item out: it is being issued (or its fused consumer issues it)."""
        self.items.remove(item)
        owner = self._owner
        if isinstance(item, PendingGather):
            for t in item.placeholders():
                del owner[storage_key(t)]
            if not item.shard_in_out():
                self.stop_sending(item)
        else:  # NB: the hot path: every product read, or taken by its collective
            del owner[storage_key(item.out)]
            for sv in item.scatter_views:
                del owner[storage_key(sv.tensor)]
        self._release(item.inputs())

    def _read(self, tensors: Iterable[torch.Tensor]) -> None:
        """Pending work reads ``tensors`` (once more each)."""
        inputs = self._inputs
        for t in tensors:
            key = storage_key(t)
            inputs[key] = inputs.get(key, 0) + 1

    def _release(self, tensors: Iterable[torch.Tensor]) -> None:
        """Pending work reads ``tensors`` no more."""
        inputs = self._inputs
        for t in tensors:
            key = storage_key(t)
            n = inputs[key] - 1
            if n:
                inputs[key] = n
            else:
                del inputs[key]

    def standalone(self, *, absorbed: bool) -> list[Product]:
        """The pending products that are not a gather's consumers, absorbed
        (a fused collective produced what it needed) or not, in record order."""
        found = []
        for p in self.items:  # NB: a loop: asked at every fused collective and completion of a gather
            if not isinstance(p, PendingGather) and p.absorbed == absorbed:
                found.append(p)
        return found

    def owner(self, t: torch.Tensor) -> Pending | None:
        return self._owner.get(storage_key(t))

    def sending_from(self, t: torch.Tensor) -> list[PendingGather]:
        """The gathers in flight that may still send from ``t``'s storage."""
        return self.sending.get(storage_key(t), [])

    def stop_sending(self, gather: PendingGather) -> None:
        """``gather`` reads its shard no more: released, or completed."""
        key = storage_key(gather.shard)
        gathers = self.sending.get(key, [])
        if gather in gathers:
            gathers.remove(gather)
            if not gathers:
                del self.sending[key]

    def owners(self, tensors: Iterable[torch.Tensor]) -> list[Pending]:
        """The pending items that own any of ``tensors``, in record order."""
        # NB: on the hot path (every read of pending work): loops, usually of one.
        owner, found = self._owner, []
        for t in tensors:
            item = owner.get(storage_key(t))
            if item is not None and item not in found:  # NB: eq=False items: identity
                found.append(item)
        if len(found) > 1:
            found.sort(key=self.items.index)
        return found

    def gathered_view_of(self, t: torch.Tensor) -> tuple[PendingGather, GatheredView] | None:
        """The pending gather and its view that ``t`` views, if any."""
        item = self._owner.get(storage_key(t))
        if isinstance(item, PendingGather):
            view = item.view_of(t)
            if view is not None:
                return item, view
        return None

    def standalone_output(self, t: torch.Tensor) -> tuple[Product, ScatterView | None] | None:
        """The standalone pending product whose whole output (or whole scatter
        view) ``t`` is, if any."""
        key = storage_key(t)
        product = self._owner.get(key)
        if isinstance(product, PendingGather) or product is None or not t.is_contiguous():
            return None
        whole = product.out
        if storage_key(whole) == key:  # NB: the hot path (a product's own output)
            return (product, None) if _same_extent(t, whole) else None
        for sv in product.scatter_views:
            if storage_key(sv.tensor) == key and _same_extent(t, sv.tensor):
                return product, sv
        return None

    def tid_of(self, t: torch.Tensor) -> int:
        """The trace id of the placeholder ``t`` views."""
        key = storage_key(t)
        item = self._owner[key]
        if not isinstance(item, PendingGather):
            return item.tid  # its output and its scatter views share its id
        view = item.view_of(t)  # NB: a read of a gather's view is on the hot path
        if view is not None:
            return view.tid
        for mm in item.consumers:
            if storage_key(mm.out) == key:
                return mm.tid
        return next(w.tid for w in item.wholes for p in w.placeholders() if storage_key(p) == key)

    def touched(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """The first of ``tensors`` that is pending, if any."""
        owner = self._owner
        for t in tensors:  # NB: on the hot path: a loop, not a generator
            if storage_key(t) in owner:
                return t
        return None

    def readers(self, tensors: Iterable[torch.Tensor]) -> list[Pending]:
        """The pending items whose work reads the storage of any of ``tensors``
        (a gather's: its consumers'), in record order."""
        # NB: a loop: every write while work is pending.
        inputs, keys = self._inputs, set()
        for t in tensors:
            key = storage_key(t)
            if key in inputs:
                keys.add(key)
        if not keys:
            return []
        return [item for item in self.items if any(storage_key(t) in keys for t in item.inputs())]

    def reset(self) -> None:
        assert not self.items, "reset with pending work would lose collectives"
        assert not self.sending, f"gathers completed but still sending from their shards: {self.sending}"
        self._ids = itertools.count()
        self.last_tid = -1


def _same_extent(t: torch.Tensor, whole: torch.Tensor) -> bool:
    """``t`` (contiguous, on ``whole``'s storage) covers exactly ``whole``'s elements."""
    return t.storage_offset() == whole.storage_offset() and t.numel() == whole.numel()


def tensor_leaves(args: tuple, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The tensors among an op's arguments, in order. NB: on the hot path; ATen
    arguments nest one level at most (``cat``'s list, ``_foreach_*``'s lists)."""
    found: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for t in a:  # NB: a loop, not a generator's frame
                if isinstance(t, torch.Tensor):
                    found.append(t)
    return found


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x``, through lists, tuples and dicts nested to any
    depth (raw c10d's list forms take ``Tensor[][]``). Off the hot path."""
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
