"""Hand-written point-to-point schedules of overlap.py's forms: no eagertp.

What the best a programmer can do on 2 ranks with ``isend``/``irecv`` and
``mm(out=)``, each form in ``pieces`` pieces per chunk, so that the matmul of
one piece overlaps the transfer of the next. ``overlap.py`` times every piece
count in its round-robin and reports the fastest as the hand schedule a fused
op should match. A schedule's buffers are made when it is built;
``overlap.py`` also times each one built anew at every call, allocating them
as the program it replaces allocates its results. Only 2 ranks: with more, the best schedule is a
ring of its own, and these stay out of the table.

The schedules, as seen by rank r with peer q (``P[c]``: this rank's
contribution to chunk c of the product; ``j``: a piece)::

    all_gather_matmul:   post recv(q's shard, by piece), send(own shard)
                         y[r] = own @ b;  for j: wait piece j, y[q][j] = piece @ b
    all_gather_matmul_k: the same with column blocks: y = own @ b[r rows], then
                         y[j] += piece @ b[q rows], row piece by row piece
    matmul_reduce_scatter:
                         post recv(partial of chunk r, by piece)
                         for j: P[q][j] = a[q rows j] @ b; send it
                         out = P[r];  for j: wait, out[j] += recv[j]
    matmul_all_reduce:   the reduce-scatter's schedule, but each reduced piece
                         of chunk r goes to q as soon as it is added, and q's
                         reduced pieces land in y[q]: the two halves interleave
    all_gather_indep_matmul:
                         post the gather, z = a2 @ b2, then all_gather_matmul's
                         consumer
    matmul_all_gather:   post recv(q's product, by piece)
                         for j: y[r][j] = a[j] @ b; send it
                         wait

Every message of a schedule is posted in the same order on both ranks, with
the default tag, so the pieces match in order. A schedule's call returns its
result (``call_instructions.py`` reads it as the program reads the op's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

PIECES = (1, 2, 4, 8)


class P2P(NamedTuple):
    """How a schedule posts its messages to the peer: ``isend(t, peer)`` and
    ``irecv(t, peer)``, each returning its ``Work``."""

    isend: Callable[[torch.Tensor, int], dist.Work]
    irecv: Callable[[torch.Tensor, int], dist.Work]

    @staticmethod
    def on(group: dist.ProcessGroup) -> P2P:
        """The process group's own ``send``/``recv``, as eagertp's ring posts:
        none of torch.distributed's Python around each message (the host
        cost of the schedule itself, ``call_instructions.py``)."""
        return P2P(lambda t, peer: group.send([t], peer, 0), lambda t, peer: group.recv([t], peer, 0))


# torch.distributed's isend/irecv on the default group: what a program writes.
DIST = P2P(lambda t, peer: dist.isend(t, dst=peer), lambda t, peer: dist.irecv(t, src=peer))


def _split(n: int, pieces: int) -> list[slice]:
    bounds = [i * n // pieces for i in range(pieces + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def all_gather_matmul(
    shard: torch.Tensor,
    b: torch.Tensor,
    pieces: int,
    independent: Callable[[], None] | None = None,
    p2p: P2P = DIST,
) -> Callable[[], torch.Tensor]:
    """``y = all_gather(shard) @ b``, gather dim 0; ``independent`` runs
    between posting the gather and consuming it."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    m = shard.shape[0]
    gathered = shard.new_empty(2, *shard.shape)
    y = shard.new_empty(2, m, b.shape[1])
    rows = _split(m, pieces)

    def run() -> torch.Tensor:
        recvs = [p2p.irecv(gathered[peer][r], peer) for r in rows]
        sends = [p2p.isend(shard[r], peer) for r in rows]
        if independent is not None:
            independent()
        torch.mm(shard, b, out=y[rank])
        for r, work in zip(rows, recvs):
            work.wait()
            torch.mm(gathered[peer][r], b, out=y[peer][r])
        _wait(sends)
        return y.view(2 * m, -1)

    return run


def all_gather_matmul_k(
    shard: torch.Tensor, b: torch.Tensor, pieces: int, p2p: P2P = DIST
) -> Callable[[], torch.Tensor]:
    """``y = all_gather(shard, dim=1) @ b``: column blocks of A, partial products summed."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    m, k = shard.shape
    received = torch.empty_like(shard)
    y = shard.new_empty(m, b.shape[1])
    rows = _split(m, pieces)
    b_own, b_peer = b[rank * k : (rank + 1) * k], b[peer * k : (peer + 1) * k]

    def run() -> torch.Tensor:
        recvs = [p2p.irecv(received[r], peer) for r in rows]
        sends = [p2p.isend(shard[r], peer) for r in rows]
        torch.mm(shard, b_own, out=y)
        for r, work in zip(rows, recvs):
            work.wait()
            y[r].addmm_(received[r], b_peer)
        _wait(sends)
        return y

    return run


def matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, pieces: int, p2p: P2P = DIST
) -> Callable[[], torch.Tensor]:
    """``out = reduce_scatter(a @ b)``: the peer's chunk first, in pieces, each sent as computed."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    m = a.shape[0] // 2
    own, theirs = a[rank * m : (rank + 1) * m], a[peer * m : (peer + 1) * m]
    send_buf, recv_buf, out = (a.new_empty(m, b.shape[1]) for _ in range(3))
    rows = _split(m, pieces)

    def run() -> torch.Tensor:
        recvs = [p2p.irecv(recv_buf[r], peer) for r in rows]
        sends = []
        for r in rows:
            torch.mm(theirs[r], b, out=send_buf[r])
            sends.append(p2p.isend(send_buf[r], peer))
        torch.mm(own, b, out=out)
        for r, work in zip(rows, recvs):
            work.wait()
            out[r].add_(recv_buf[r])
        _wait(sends)
        return out

    return run


def matmul_all_reduce(
    a: torch.Tensor, b: torch.Tensor, pieces: int, p2p: P2P = DIST
) -> Callable[[], torch.Tensor]:
    """``y = all_reduce(a @ b)``: the reduce-scatter's schedule, each reduced
    piece sent on as soon as it is final."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    m = a.shape[0] // 2
    own, theirs = a[rank * m : (rank + 1) * m], a[peer * m : (peer + 1) * m]
    y = a.new_empty(2, m, b.shape[1])
    send_buf, recv_buf = (a.new_empty(m, b.shape[1]) for _ in range(2))
    rows = _split(m, pieces)

    def run() -> torch.Tensor:
        partials = [p2p.irecv(recv_buf[r], peer) for r in rows]
        reduced = [p2p.irecv(y[peer][r], peer) for r in rows]
        sends = []
        for r in rows:
            torch.mm(theirs[r], b, out=send_buf[r])
            sends.append(p2p.isend(send_buf[r], peer))
        for r, work in zip(rows, partials):
            torch.mm(own[r], b, out=y[rank][r])
            work.wait()
            y[rank][r].add_(recv_buf[r])
            sends.append(p2p.isend(y[rank][r], peer))
        _wait(reduced)
        _wait(sends)
        return y.view(2 * m, -1)

    return run


def matmul_all_gather(
    a: torch.Tensor, b: torch.Tensor, pieces: int, p2p: P2P = DIST
) -> Callable[[], torch.Tensor]:
    """``y = all_gather(a @ b)``: this rank's product made in pieces, each sent as made."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    m = a.shape[0]
    y = a.new_empty(2, m, b.shape[1])
    rows = _split(m, pieces)

    def run() -> torch.Tensor:
        recvs = [p2p.irecv(y[peer][r], peer) for r in rows]
        sends = []
        for r in rows:
            torch.mm(a[r], b, out=y[rank][r])
            sends.append(p2p.isend(y[rank][r], peer))
        _wait(recvs)
        _wait(sends)
        return y.view(2 * m, -1)

    return run


def all_gather_indep_matmul(
    shard: torch.Tensor, b: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor, pieces: int
) -> Callable[[], torch.Tensor]:
    """The prefetch form: the gather posted, the independent matmul, then the consumer by piece."""
    z = a2.new_empty(a2.shape[0], b2.shape[1])
    return all_gather_matmul(shard, b, pieces, independent=lambda: torch.mm(a2, b2, out=z))


def exchange(tensors: list[torch.Tensor]) -> Callable[[], None]:
    """The fastest way measured to move the form's bytes: each tensor sent to
    the peer while the peer's arrives, one after another (the all-reduce moves
    two halves), and nothing else."""
    peer = 1 - dist.get_rank()
    received = [torch.empty_like(t) for t in tensors]

    def run() -> None:
        for t, into in zip(tensors, received):
            recv = dist.irecv(into, src=peer)
            send = dist.isend(t, dst=peer)
            recv.wait()
            send.wait()

    return run
