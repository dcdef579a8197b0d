"""Megatron-core's own tensor-parallel layers as a client (tests/megatron_cpu.py
runs them on CPU): ColumnParallelLinear -> gelu -> RowParallelLinear, a
TransformerLayer, and a GPTModel with its output layer tied to the embedding
(Megatron's default) or not, with and without sequence parallelism, forward
and backward under ``EagerMicroPipeline``.

Megatron issues raw c10d collectives: all-reduces without sequence
parallelism; with it, gathers into one global buffer that every layer reuses
(forward, and again in backward, asynchronously while the input gradient is
computed) and reduce-scatters. Each case checks plain eager's answer, that
every collective next to a matmul fused and the others say why, and that
explain() has a line for every collective plain eager issued.
"""

from __future__ import annotations

import pytest
import torch
from helpers import OpCounter

from eagertp import EagerMicroPipeline

_NOT_A_PRODUCT = "its input is not the pending output of a matmul"

# Per case and sequence parallelism: the stats, and the collectives issued as
# written with their reasons (count, explain() line head, reason).
_EXPECTED = {
    # Without SP the row-parallel output is all-reduced (forward), and the
    # column-parallel input gradient (backward, async_op=True). The test's loss
    # reads the output after ops that run row by row on its gather half.
    ("mlp", False): ({"matmul_all_reduce": 2, "rowwise_ops": 2}, []),
    # fc1's input gathered in forward and again in backward (into the global
    # buffer, for the weight gradient); fc2's output gradient gathered for its
    # input and weight gradients; a reduce-scatter each way.
    ("mlp", True): ({"all_gather_matmul": 3, "fused_matmuls": 4, "matmul_reduce_scatter": 2}, []),
    # The residual add and the pre-MLP norm run row by row on the attention
    # all-reduce's gather half, fc1 binding through them; in backward the
    # norm's backward and the residual's sum on fc1's input-gradient
    # all-reduce, the attention projection's gradients binding to them. The
    # norms' gradients become .grad without a copy_ (Note [Results over the
    # rows, taken by autograd] in eagertp.rowwise).
    ("layer", False): ({"matmul_all_reduce": 4, "rowwise_ops": 12, "all_gather_matmul": 2, "fused_matmuls": 3}, []),
    ("layer", True): ({"all_gather_matmul": 6, "fused_matmuls": 8, "matmul_reduce_scatter": 4}, []),
    # Two layers' worth, and the output layer's (column-parallel) input
    # gradient. Not matmul collectives: the vocab-parallel embedding's sum of
    # masked lookups, and the vocab-parallel cross-entropy's max and two sums.
    ("gpt", False): (
        {"matmul_all_reduce": 9, "unfused_all_reduce": 4, "rowwise_ops": 32, "all_gather_matmul": 8,
         "fused_matmuls": 12},
        [(1, "all_reduce(max) #0", _NOT_A_PRODUCT), (3, "all_reduce(sum) #", _NOT_A_PRODUCT)],
    ),
    # With SP the output layer's input is gathered too (fused each way), and
    # backward gathers the embedding's gradient for embedding_dense_backward.
    ("gpt", True): (
        {"all_gather_matmul": 14, "fused_matmuls": 18, "matmul_reduce_scatter": 9, "unfused_all_reduce": 4,
         "unfused_all_gather": 1, "rowwise_ops": 2},
        [(1, "all_reduce(max) #0", _NOT_A_PRODUCT), (3, "all_reduce(sum) #", _NOT_A_PRODUCT),
         (1, "all_gather #14", "no matmul consumed it before aten.embedding_dense_backward.default")],
    ),
}
KINDS = ["mlp", "layer", "gpt_tied", "gpt_untied"]


def _megatron_worker(rank, group, kind, sequence_parallel):
    import megatron_cpu

    with megatron_cpu.megatron_on_cpu(group):
        model = megatron_cpu.build(kind, sequence_parallel, group.size())
        with OpCounter() as counter:
            expected = megatron_cpu.forward_backward(kind, model, sequence_parallel, group)
        with EagerMicroPipeline(trace=True) as pipe:
            got = megatron_cpu.forward_backward(kind, model, sequence_parallel, group)
    return {
        "close": [torch.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(got, expected)],
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
        "trace": pipe.debug_string(),
        "plain_collectives": counter.collectives,
        "records": len(pipe._engine.trace.collectives),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no SP", "SP"])
@pytest.mark.parametrize("kind", KINDS)
def test_megatron_core_layers_fuse_every_matmul_collective(pool, kind, sequence_parallel, world):
    stats, unfused = _EXPECTED[(kind.split("_")[0], sequence_parallel)]
    for r in pool.run(_megatron_worker, world, kind, sequence_parallel):
        assert all(r["close"]), r["close"]
        assert r["stats"] == stats, r
        # No invisible collective: a line in explain() for each plain eager issued.
        assert r["records"] == len(r["plain_collectives"]) > 0, (r["plain_collectives"], r["explain"])
        lines = r["explain"].splitlines()
        not_fused = [line for line in lines if "not fused" in line]
        assert len(not_fused) == sum(n for n, _, _ in unfused), r["explain"]
        for n, head, why in unfused:
            assert sum(line.startswith(head) and why in line for line in not_fused) == n, (head, r["explain"])


def test_megatron_backward_gather_stays_in_flight_behind_the_input_gradient(pool):
    """ColumnParallelLinear's SP backward gathers its input again, into the
    global buffer with ``async_op=True``, computes the input gradient, then
    waits: the gather is in flight while the input gradient is made and
    reduce-scattered, and the weight gradient then consumes it."""
    for r in pool.run(_megatron_worker, 2, "mlp", True):
        trace = r["trace"].splitlines()
        start = next(i for i, line in enumerate(trace) if line.startswith("$6: f32[16, 2, 64] = all_gather("))
        dgrad = trace.index("matmul_reduce_scatter(sum, $7) [ring]")
        wgrad = trace.index("all_gather_matmul($6 -> $8) [ring]")
        assert start < dgrad < wgrad, r["trace"]
        assert "$8: f32[128, 64] = mm(f32[128, 32], $6)" in trace, r["trace"]


def _training_worker(rank, group, steps=2):
    """Megatron's GPTModel (tied, SP) trained with SGD: after each backward
    the sequence-parallel norms' gradients are all-reduced over TP, as
    Megatron's finalize_model_grads does, inside the block."""
    import megatron_cpu
    import torch.distributed as dist

    def train(use_eagertp):
        model = megatron_cpu.build("gpt_tied", True, group.size())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, stats = [], []
        pipe = EagerMicroPipeline() if use_eagertp else OpCounter()  # one for the loop
        for _ in range(steps):
            with pipe:
                loss = megatron_cpu.forward_backward("gpt_tied", model, True, group)[0]
                for p in model.parameters():
                    if getattr(p, "sequence_parallel", False):
                        dist.all_reduce(p.grad, group=group)
            opt.step()
            losses.append(loss)
            stats.append(dict(pipe.stats) if use_eagertp else {})
        return losses, [p.detach().clone() for p in model.parameters()], stats

    with megatron_cpu.megatron_on_cpu(group):
        plain = train(False)
        fused = train(True)
    return {
        "losses": (plain[0], fused[0]),
        "params_close": [torch.allclose(f, p, rtol=1e-5, atol=1e-6) for f, p in zip(fused[1], plain[1])],
        "stats": fused[2],
    }


def test_megatron_gpt_trains_as_in_plain_eager(pool):
    for r in pool.run(_training_worker, 2):
        torch.testing.assert_close(r["losses"][1], r["losses"][0], rtol=1e-5, atol=1e-6)
        assert all(r["params_close"]), r["params_close"]
        # Each step's: _EXPECTED's, and the gradients of the parameters
        # Megatron marks sequence_parallel, the five norms' weights and biases
        # and the four row-parallel biases (1-d: issued as written, with the
        # reason). One pipeline for the loop, yet nothing runs at once in its
        # second step (Note [Deferrals that gained nothing]): each of
        # Megatron's matmuls feeds a collective, or is read only after one that
        # Megatron issues first (its weight gradients, behind the input
        # gradient's collective), so none was read whole for nothing.
        stats = dict(_EXPECTED[("gpt", True)][0])
        stats["unfused_all_reduce"] += 2 * 5 + 4
        assert r["stats"] == [stats, stats], r


def _global_buffer_worker(rank, group):
    """Megatron's own gather and reduce-scatter into its global buffer
    (``use_global_buffer=True``, as its MoE token dispatcher calls them): the
    reduce-scatter writes the buffer that the gather in flight fills and a
    pending matmul reads, so that work completes first (Note [Every write is
    seen] in eagertp.engine); both still fuse."""
    import megatron_cpu
    from helpers import integer_tensor
    from megatron.core.tensor_parallel import mappings

    world = group.size()
    x = integer_tensor((4, 8), torch.float32, seed=rank)
    w, v = integer_tensor((8, 6), torch.float32, seed=3), integer_tensor((8, 8), torch.float32, seed=4)
    h = integer_tensor((4 * world, 8), torch.float32, seed=5 + rank)

    def program():
        gathered = mappings.gather_from_sequence_parallel_region(x, group=group, use_global_buffer=True)
        y = gathered @ w  # pending on the gather in flight
        scattered = mappings.reduce_scatter_to_sequence_parallel_region(h @ v, group=group, use_global_buffer=True)
        return y.clone(), scattered.clone()

    with megatron_cpu.megatron_on_cpu(group):
        expected = program()
        with OpCounter() as counter, EagerMicroPipeline(trace=True) as pipe:
            got = program()
    return {
        "equal": [torch.equal(g, e) for g, e in zip(got, expected)],
        "stats": dict(pipe.stats),
        "plain_collectives": counter.collectives,
        "waits": [e for e in pipe.debug_string().splitlines() if e.startswith("wait")],
    }


def test_megatron_reduce_scatter_into_the_global_buffer_a_gather_fills(pool):
    for r in pool.run(_global_buffer_worker, 2):
        assert all(r["equal"]), r
        assert r["stats"] == {"all_gather_matmul": 1, "fused_matmuls": 1, "matmul_reduce_scatter": 1}, r
        assert not any(c.startswith(("_allgather", "_reduce_scatter")) for c in r["plain_collectives"]), r
        assert r["waits"] == ["wait: c10d._reduce_scatter_base_.default writes $0's buffer"], r
