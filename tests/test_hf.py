"""HuggingFace transformers' own tensor parallelism as a client.

A tiny random Llama (2 layers, hidden 64) is saved locally and loaded back with
``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``:
transformers shards it with its model's own plan (colwise q/k/v/gate/up,
rowwise o/down, a vocab-sharded embedding, a colwise lm_head gathered before the
loss) and runs TP without sequence parallel, i.e. on all-reduces. One forward +
backward under ``EagerMicroPipeline`` must equal plain eager, and every
all-reduce of a matmul output must be fused.

Wiring: transformers builds its device mesh with ``init_device_mesh`` over the
*whole* default process group and requires the mesh to cover it
(``initialize_distributed_mesh``: "The parallel mesh requires N processes, but
world_size is M"). It does not init a group when one exists, so it takes the
pool's default gloo group as is: the test runs on all of the pool's ranks.
"""

from __future__ import annotations

import collections
import contextlib
import os

import torch
from helpers import OpCounter
from multirank import WORLD

from eagertp import EagerMicroPipeline

_GRADS = [  # a few parameters' gradients, compared as full tensors
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "lm_head.weight",
]


def _hf_worker(rank, group, path):
    import torch.distributed as dist

    os.environ["HF_HUB_OFFLINE"] = "1"  # never reach for the hub
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    if rank == 0:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=128,
            max_position_embeddings=64,
        )
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier(group)
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size(group)), dtype=torch.float32
    )
    assert all(type(p).__name__ == "DTensor" for n, p in model.named_parameters() if n.endswith("proj.weight"))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))  # 16 rows: split over 4 ranks

    def step(ctx):
        model.zero_grad()
        with ctx:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        params = dict(model.named_parameters())
        grads = [params[n].grad for n in _GRADS]
        return [out.logits.detach(), out.loss.detach(), *grads]

    def full(tensors):  # outside the counters: full_tensor() all-gathers
        return [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]

    eager_counter = OpCounter()
    with eager_counter:
        expected = step(contextlib.nullcontext())
    expected = full(expected)
    counter, pipe = OpCounter(), EagerMicroPipeline()
    with counter:
        got = step(pipe)
    got = full(got)
    close = []
    for g, e in zip(got, expected):
        try:
            torch.testing.assert_close(g, e)
            close.append(True)
        except AssertionError as err:
            close.append(str(err))
    return {
        "close": close,
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
        "eager_collectives": dict(collections.Counter(eager_counter.collectives)),
        "collectives": dict(collections.Counter(counter.collectives)),
    }


def test_hf_transformers_tp_plan_llama_fuses_every_matmul_all_reduce(pool, tmp_path):
    try:
        results = pool.run(_hf_worker, WORLD, str(tmp_path))
    finally:
        # NB: transformers stays imported in the workers (its lazy modules, its
        # threads): later tests that count live objects get fresh ones.
        pool.restart()
    for r in results:
        assert all(c is True for c in r["close"]), r["close"]  # logits, loss, gradients
        # Plain eager: 16 all-reduces (explain() names each one's input). 15 reduce a matmul output: forward, each
        # layer's rowwise o_proj and down_proj (4); backward, the input gradient
        # of each colwise linear, q/k/v/gate/up in both layers and lm_head (11).
        # One does not: the vocab-sharded embedding's forward (masked lookups
        # summed over ranks). And lm_head's output is all-gathered for the loss.
        assert r["eager_collectives"] == {"all_reduce": 16, "all_gather_into_tensor": 1}, r
        # Every matmul all-reduce fused; the other two unfused, each with its
        # reason, on the ring too (a peer could have fused its own: Invariant 2).
        assert r["stats"] == {"matmul_all_reduce": 15, "unfused_all_reduce": 1, "unfused_all_gather": 1}, r
        assert "all_reduce" not in r["collectives"] and "all_gather_into_tensor" not in r["collectives"], r
        assert r["collectives"]["send"] > 0, r
        lines = r["explain"].splitlines()
        assert sum("fused with mm" in line for line in lines) == 15, r["explain"]
        unfused = [line for line in lines if "fused with" not in line]
        assert len(unfused) == 2, r["explain"]
        assert "all_reduce(sum) #0 f32[2, 8, 64]" in unfused[0], unfused
        assert unfused[0].endswith("not fused [ring]: its input is not the pending output of a matmul"), unfused
        assert unfused[1].startswith("all_gather #0 f32[2, 8, 32] -> f32[8, 8, 32]"), unfused
        assert "not fused [ring]: no matmul consumed it before aten._log_softmax.default" in unfused[1], unfused
