"""Activation checkpointing of a TP + SP transformer block, in all its forms.

Two of the demo's ``TransformerBlock``s, each made tensor + sequence parallel by
``parallelize_module(block, mesh, tensor_parallel_plan())`` on 2 gloo ranks and
each wrapped in ``torch.utils.checkpoint.checkpoint`` (per block, as torchtitan
does): reentrant, non-reentrant (torchtitan's default), and selective
activation checkpointing (SAC) with a policy that saves the collectives or one
that recomputes everything.

Each form is run twice from the same weights and input: plain eager, then
inside ``EagerMicroPipeline``. Per phase (the forward; the backward, recomputation
included) the test asserts:

- loss and every gradient equal plain eager's (same checkpointing, no eagertp);
- plain eager issued the collectives counted in ``_EXPECTED`` (what the
  checkpoint form recomputes), so a torch that recomputes differently fails
  here and not as a fusion failure;
- no all-gather was left without overlap (``unfused_all_gather == 0``) and every
  all-gather and reduce-scatter of the phase fused with its matmuls; an op
  counter outside the mode saw no plain all-gather or reduce-scatter.

Where the recomputation issues collectives while a backward all-gather is in
flight (non-reentrant, SAC recomputing the gathers), or reads deferred
recomputed matmuls while it is (SAC saving the collectives), eagertp's earlier
design (one pending collective, flushed by the next collective or by any read)
forced that backward gather out unfused, one per block. (Reentrant
checkpointing fused everything then too: its recomputation finishes before the
block's backward issues its first collective.)
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from helpers import OpCounter, PlainCollectives, collectives_seen
from symm_mem_emulation import BOTH_BACKENDS, assert_moved_by, run_on

from eagertp import EagerMicroPipeline

FORMS = ["reentrant", "non_reentrant", "sac_save_collectives", "sac_recompute_all"]

LAYERS = 2

# Collectives plain eager issues per phase for ONE checkpointed block, as
# (all-gathers, reduce-scatters); the model has LAYERS of them. Counted with
# OpCounter on torch 2.13; why:
#
# - forward, every form: the attention's and the MLP's input gathered from the
#   sequence shards (PrepareModuleInput, Shard(1) -> Replicate), and wo's and
#   w2's outputs reduce-scattered back (RowwiseParallel, Partial -> Shard(1)).
# - backward without recomputation mirrors the forward: each reduce-scatter's
#   gradient is an all-gather (feeding dgrad and wgrad of w2, then of wo), each
#   all-gather's gradient a reduce-scatter (input gradients of w1, then of
#   q/k/v summed): 2 + 2. Recomputation adds:
#   - reentrant: the whole forward again, before the block's backward starts
#     (CheckpointFunction.backward recomputes, then runs the inner backward): +2, +2.
#   - non-reentrant, and SAC recomputing everything: recomputation starts when
#     w2's matmul backward unpacks its saved input, i.e. *after* the backward
#     all-gather of the block's output gradient was issued, and it stops early
#     (torch's default `set_checkpoint_early_stop(True)`) once w2's matmul has
#     saved its inputs, before w2's reduce-scatter: +2, +1.
#   - SAC saving the collectives (MUST_SAVE all-gather, reduce-scatter, wait):
#     the recomputation replays their saved outputs and issues none: +0, +0;
#     it recomputes the q/k/v matmuls (deferred by eagertp) and attention
#     reads them while the backward all-gather is in flight.
_EXPECTED = {
    "reentrant": {"forward": (2, 2), "backward": (4, 4)},
    "non_reentrant": {"forward": (2, 2), "backward": (4, 3)},
    "sac_save_collectives": {"forward": (2, 2), "backward": (2, 2)},
    "sac_recompute_all": {"forward": (2, 2), "backward": (4, 3)},
}

# Counter keys of a phase: the outer OpCounter's plain collectives, then pipe.stats.
_PLAIN_AG, _PLAIN_RS = "plain_all_gather", "plain_reduce_scatter"


def _save_collectives(ctx, op, *args, **kwargs):
    """SAC policy: keep the collectives' outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    c = torch.ops._c10d_functional
    if op in (c.all_gather_into_tensor.default, c.reduce_scatter_tensor.default, c.wait_tensor.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all(ctx, op, *args, **kwargs):
    """SAC policy: recompute every op, the collectives included."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(form: str, block):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if form == "reentrant":
        return lambda x: checkpoint(block, x, use_reentrant=True)
    if form == "non_reentrant":
        return lambda x: checkpoint(block, x, use_reentrant=False)
    policy = {"sac_save_collectives": _save_collectives, "sac_recompute_all": _recompute_all}[form]
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return lambda x: checkpoint(block, x, use_reentrant=False, context_fn=context_fn)


def _counts(counter: OpCounter, pipe: EagerMicroPipeline | None) -> collections.Counter:
    return collections.Counter(
        {
            _PLAIN_AG: counter.unfused_all_gathers,
            _PLAIN_RS: counter.unfused_reduce_scatters,
            **(pipe.stats if pipe is not None else {}),
        }
    )


def _checkpointed_block_worker(rank, group, form):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from eagertp.demo import TransformerBlock, tensor_parallel_plan

    mesh = DeviceMesh.from_group(group, "cpu")
    x_local = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).chunk(group.size(), 1)[rank]

    def step(pipe: EagerMicroPipeline | None):
        torch.manual_seed(0)  # the same weights in both runs
        blocks = [parallelize_module(TransformerBlock(16, 4), mesh, tensor_parallel_plan()) for _ in range(LAYERS)]
        fns = [_checkpointed(form, block) for block in blocks]
        # NB: reentrant checkpoint returns no gradients unless an input requires grad.
        x = x_local.clone().requires_grad_()
        counter, block = OpCounter(), pipe if pipe is not None else PlainCollectives()
        with counter, block:
            h = x
            for fn in fns:
                h = fn(h)  # RowwiseParallel hands back local tensors (sequence shards)
            loss = h.pow(2).mean()
            after_forward = _counts(counter, pipe)
            loss.backward()
        # NB: after leaving the block, which issues anything still pending.
        after_backward = _counts(counter, pipe)
        phases = {"forward": dict(after_forward), "backward": dict(after_backward - after_forward)}
        grads = {f"{i}.{name}": p.grad.full_tensor() for i, b in enumerate(blocks) for name, p in b.named_parameters()}
        grads["input"] = x.grad
        return loss.detach(), grads, phases, counter.p2p, collectives_seen(block)

    expected_loss, expected_grads, plain_phases, _, plain_seen = step(None)
    pipe = EagerMicroPipeline()
    loss, grads, phases, p2p, seen = step(pipe)
    return {
        "collectives_seen": (plain_seen, seen),
        "loss": (expected_loss, loss),
        "grads_differ": [
            name for name, g in grads.items() if not torch.allclose(g, expected_grads[name], rtol=1e-4, atol=1e-6)
        ],
        "plain_phases": plain_phases,
        "phases": phases,
        "p2p_ops": p2p,
        "explain": pipe.explain(),
    }


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_checkpointed_tp_block_leaves_no_all_gather_without_overlap(pool, form, backend):
    for r in run_on(backend, pool, _checkpointed_block_worker, 2, form):
        expected_loss, loss = r["loss"]
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        assert not r["grads_differ"], f"gradients differ from plain eager: {r['grads_differ']}"
        plain_seen, seen = r["collectives_seen"]  # no invisible collective
        assert plain_seen == seen > 0, r["collectives_seen"]
        assert_moved_by(backend, r)
        for phase, (gathers, scatters) in _EXPECTED[form].items():
            gathers, scatters = LAYERS * gathers, LAYERS * scatters
            plain = r["plain_phases"][phase]
            assert (plain.get(_PLAIN_AG, 0), plain.get(_PLAIN_RS, 0)) == (gathers, scatters), (
                f"{form}, {phase}: plain eager issued {plain}, the test expects {gathers} all-gathers "
                f"and {scatters} reduce-scatters ({LAYERS} x _EXPECTED)"
            )
            stats = r["phases"][phase]
            where = f"{form}, {phase}: {stats}\n{r['explain']}"
            assert stats.get(_PLAIN_AG, 0) == 0 and stats.get(_PLAIN_RS, 0) == 0, where
            assert stats.get("unfused_all_gather", 0) == 0, where
            assert stats.get("unfused_reduce_scatter", 0) == 0, where
            assert stats.get("all_gather_matmul", 0) >= gathers, where
            assert stats.get("matmul_reduce_scatter", 0) >= scatters, where
