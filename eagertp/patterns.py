"""Patterns: turn one ready piece of pending work into a plan for a backend.

A plan is what a flush hands a backend: the buffers, the group, and the
per-chunk callable (a *consumer* of each gathered chunk, or a *producer* of each
chunk to reduce-scatter). Every plan also keeps the unfused program it replaces
as real code (``reference``), which ``verify=True`` and the tests compare against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from eagertp._format import group_str, tensor_str
from eagertp.backends import Backend
from eagertp.backends.base import ChunkConsumer, ChunkProducer
from eagertp.backends.reference import ReferenceBackend
from eagertp.deferred import Operand, PendingGather, PendingMatmul
from eagertp.trace import CollectiveRecord

aten = torch.ops.aten


@dataclasses.dataclass(eq=False)
class AllGatherMatmulPlan:
    """Fuse the pattern::

        ag = all_gather_into_tensor(shard, group)     # gather dim 0
        G = ag.view(W*r, C)                           # r rows per rank
        out_j = mm(G, B_j) | mm(G.t(), H_j) | mm(H_j, G)   (or addmm, any number)

    into one micro-pipelined call whose consumer runs, for the chunk of rank i,
    each matmul's share of the work (Note [Matmul operands of a gather]),
    writing into the placeholders. With no consumers this is the gather alone,
    issued with the same messages.
    """

    gather: PendingGather
    kind = "all_gather"

    @property
    def fused(self) -> bool:
        return bool(self.gather.consumers)

    @property
    def name(self) -> str:
        return "all_gather_matmul" if self.fused else "all_gather"

    @property
    def record(self) -> CollectiveRecord:
        return self.gather.record

    @property
    def group(self) -> dist.ProcessGroup:
        return self.gather.group

    def fused_with(self) -> list[str]:
        return [mm.describe() for mm in self.gather.consumers]

    def run(self, backend: Backend) -> None:
        g = self.gather
        backend.all_gather_consume(g.shard, self.consumer(), g.out, g.group)

    def checks(self) -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
        """(what, got, plain eager, exact?) for every tensor this plan wrote."""
        g = self.gather
        ag_ref, mm_refs = self.reference()
        what = f"all_gather {tensor_str(g.shard)} -> {tensor_str(g.out)} on {group_str(g.group)}"
        checks = [(what, g.out, ag_ref, True)]
        for mm, ref in zip(g.consumers, mm_refs):
            checks.append((f"{mm.op} of {what} with B {_b_str(mm)}", mm.out, ref, False))
        return checks

    def consumer(self) -> ChunkConsumer | None:
        if not self.fused:
            return None
        world = self.gather.group.size()
        steps = [_chunk_step(mm, world) for mm in self.gather.consumers]

        def consume(chunk: torch.Tensor, src: int) -> None:
            for step in steps:
                step(chunk, src)

        return consume

    def render(self) -> str:
        outs = ", ".join(f"${mm.tid}" for mm in self.gather.consumers)
        arrow = f" -> {outs}" if outs else ""
        return f"{self.name}(${self.gather.tid}{arrow})"

    def reference(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Plain eager: the collective, then every consumer on the whole tensor."""
        g = self.gather
        ag = torch.empty_like(g.out)
        ReferenceBackend().all_gather_consume(g.shard, None, ag, g.group)
        results = []
        for mm in g.consumers:
            a, b = _whole_operands(mm, ag, g.group.size())
            results.append(torch.empty_like(mm.out))
            mm.compute(a, b, results[-1])
        return ag, results


@dataclasses.dataclass(eq=False)
class ReduceScatterPlan:
    """``out = reduce_scatter_tensor(inp, reduce_op, group)`` (scatter dim 0),
    where ``inp`` is either a tensor or the output of a deferred matmul.

    Fused, it replaces::

        C = mm(A, B)                                  # or addmm(bias, A, B)
        out = reduce_scatter_tensor(C, op, group)     # rank i keeps rows i*m:(i+1)*m

    with a producer that computes only the rows of chunk ``c`` when the ring
    needs them, ``C[c*m:(c+1)*m] = A[c*m:(c+1)*m] @ B``, so the matmul of one
    chunk overlaps the transfer of the previous partial sum and the full ``C``
    is never materialised.
    """

    out: torch.Tensor  # [M / W, ...]
    reduce_op: str
    group: dist.ProcessGroup
    record: CollectiveRecord
    inp: torch.Tensor | None = None  # unfused: the tensor to reduce-scatter
    matmul: PendingMatmul | None = None  # fused: the producer's matmul
    kind = "reduce_scatter"

    @property
    def fused(self) -> bool:
        return self.matmul is not None

    def fused_with(self) -> list[str]:
        assert self.matmul is not None, "an unfused reduce-scatter fused with nothing"
        return [self.matmul.describe()]

    def run(self, backend: Backend) -> None:
        backend.produce_reduce_scatter(self.producer(), self.out, self.group, self.reduce_op)

    def checks(self) -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
        what = f"reduce_scatter({self.reduce_op}) -> {tensor_str(self.out)} on {group_str(self.group)}"
        if self.matmul is not None:
            what = f"{self.matmul.op} with B {_b_str(self.matmul)} then {what}"
        return [(what, self.out, self.reference(), self.matmul is None)]

    @property
    def name(self) -> str:
        return "matmul_reduce_scatter" if self.fused else "reduce_scatter"

    def producer(self) -> ChunkProducer:
        if self.matmul is None:
            assert self.inp is not None, "a reduce-scatter plan needs an input or a matmul"
            return _copy_chunks(self.inp.view(self.group.size(), *self.out.shape))
        mm = self.matmul
        m, n = self.out.numel() // mm.out.shape[1], mm.out.shape[1]
        bias = None if mm.bias is None else mm.bias.expand(mm.out.shape)

        def produce(c: int, buf: torch.Tensor) -> None:
            rows = slice(c * m, (c + 1) * m)
            out = buf.view(m, n)
            if bias is None:
                torch.mm(mm.a[rows], mm.b, out=out)
            else:
                torch.addmm(bias[rows], mm.a[rows], mm.b, beta=mm.beta, alpha=mm.alpha, out=out)

        return produce

    def render(self) -> str:
        src = f"${self.matmul.tid}" if self.matmul is not None else tensor_str(self.inp)
        return f"{self.name}({self.reduce_op}, {src})"

    def reference(self) -> torch.Tensor:
        """Plain eager: the whole matmul, then the collective."""
        if self.matmul is None:
            full = self.inp
        else:
            mm = self.matmul
            full = torch.empty_like(mm.out)
            mm.compute(mm.a, mm.b, full)
        out = torch.empty_like(self.out)
        chunks = full.reshape(self.group.size(), *self.out.shape)
        ReferenceBackend().produce_reduce_scatter(_copy_chunks(chunks), out, self.group, self.reduce_op)
        return out


Plan = AllGatherMatmulPlan | ReduceScatterPlan


def _copy_chunks(chunks: torch.Tensor) -> ChunkProducer:
    """The producer of an unfused reduce-scatter: chunk c is a slice of the input."""

    def copy_chunk(c: int, buf: torch.Tensor) -> None:
        buf.copy_(chunks[c])

    return copy_chunk


def _b_str(mm: PendingMatmul) -> str:
    return "gathered" if mm.b is None else tensor_str(mm.b)


def _chunk_step(mm: PendingMatmul, world: int) -> Callable[[torch.Tensor, int], None]:
    """The part of ``mm`` that rank ``src``'s chunk enables, as a callable."""
    if mm.operand is Operand.ROWS:
        m, n = mm.out.shape
        rows = m // world
        out = mm.out.view(world, rows, n)  # out[i]: rows computed from rank i's chunk
        k = mm.b.shape[0]
        bias = None if mm.bias is None else mm.bias.expand(m, n)  # as addmm broadcasts

        def rows_step(chunk: torch.Tensor, src: int) -> None:
            g = chunk.view(rows, k)
            if bias is None:
                torch.mm(g, mm.b, out=out[src])
            else:
                torch.addmm(
                    bias[src * rows : (src + 1) * rows], g, mm.b, beta=mm.beta, alpha=mm.alpha, out=out[src]
                )

        return rows_step

    # Contraction over the gathered rows: sum of one partial product per chunk.
    if mm.operand is Operand.ROWS_T:
        rows = mm.b.shape[0] // world

        def factors(chunk: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
            return chunk.view(rows, -1).t(), mm.b[src * rows : (src + 1) * rows]

    else:
        assert mm.operand is Operand.B_ROWS, f"unknown operand {mm.operand}"
        rows = mm.a.shape[1] // world

        def factors(chunk: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
            return mm.a[:, src * rows : (src + 1) * rows], chunk.view(rows, -1)

    arrived = 0

    def accumulate_step(chunk: torch.Tensor, src: int) -> None:
        nonlocal arrived
        x, y = factors(chunk, src)
        if arrived == 0:
            mm.compute(x, y, mm.out)  # applies the bias and beta once
        else:
            mm.out.addmm_(x, y, alpha=mm.alpha)
        arrived += 1

    return accumulate_step


def _whole_operands(mm: PendingMatmul, ag: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    if mm.operand is Operand.ROWS:
        return ag.view(mm.out.shape[0], -1), mm.b
    if mm.operand is Operand.ROWS_T:
        return ag.view(mm.b.shape[0], -1).t(), mm.b
    return mm.a, ag.view(mm.a.shape[1], -1)
