"""HuggingFace transformers' own tensor parallelism as a client.

Tiny random models (2 layers, hidden 64) are saved locally and loaded back with
``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``:
transformers shards each with its family's own plan and runs TP without
sequence parallel, i.e. on all-reduces. Llama: colwise q/k/v/gate/up, rowwise
o/down, a vocab-sharded embedding, a colwise lm_head gathered before the loss.
Qwen3, Mixtral and Phi-3 add what other plans do: all-reduced norm-weight
gradients, MoE experts, products all-gathered along the last dim; Gemma-2,
Cohere, OLMo-2 and Nemotron what other models do between the same
collectives: other norms in other places, attention and MLP in parallel,
q/k norms over gathered products (``_OTHER_PLANS``). One forward + backward
under ``EagerMicroPipeline`` must equal plain eager (logits, loss, every
gradient), every all-reduce of a matmul output must be fused, and every other
collective unfused with its reason; families run again with every shard in
pieces, on a batch of two and on a batch of one, must also make each of their
products all-gathered as they send it (Note [Matmul + all-gather]). Every
family's greedy ``generate`` under ``inference_mode`` (TP inference) gives
plain eager's tokens. And Llama, in the stacks HF users run it in: two steps
in one pipeline, HF's own gradient checkpointing, HF's FSDP2 x TP
(``fsdp_size=2, tp_size=2``), and the plan override docs/tuning.md shows
(one all-reduce per attention and MLP; on Mixtral, per attention): plain
eager's gradients, every matmul all-reduce fused.

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

import pytest
import torch
from expecttest import assert_expected_inline
from helpers import OpCounter, PlainCollectives, explained_collectives, explained_kind, left_in_cycles
from multirank import WORLD

from eagertp import EagerMicroPipeline

# torch 2.11's DTensor scales Gemma's embedding (by sqrt(hidden)) before its
# all-reduce, 2.12 on after it: one row-wise op fewer per forward on the
# all-reduce's gather half there.
_GEMMA_SCALE_BEFORE_ALL_REDUCE = int(torch.__version__ < "2.12")

# Families also run with every shard in pieces (Note [Pieces]): their gathers
# of matmul outputs then make the product as they send it, and every
# all-reduce runs its piecewise pipeline.
_IN_PIECES = ("llama", "qwen3", "mixtral", "phi3", "olmo2")

# family -> its config beyond the shared tiny shape (4 heads and 4 KV heads:
# split over the pool's 4 ranks). What each plan adds: _OTHER_PLANS.
_FAMILIES = {
    "llama": {},
    "qwen3": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "phi3": {},
    "gemma2": {},
    "cohere": {},
    "olmo2": {},
    "nemotron": {},
}


def _save_tiny(family: str, path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        family,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=64,
        # NB: some families' default pad token (phi3: 32000) is past this vocabulary
        **({} if family == "llama" else {"pad_token_id": 0}),
        **_FAMILIES[family],
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _hf_worker(rank, group, path, families):
    import torch.distributed as dist

    os.environ["HF_HUB_OFFLINE"] = "1"  # never reach for the hub
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    reports = {}
    for family in families:
        if rank == 0:
            _save_tiny(family, os.path.join(path, family))
        dist.barrier(group)
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(path, family),
            distributed_config=DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size(group)),
            dtype=torch.float32,
        )
        projections = [(n, type(p).__name__) for n, p in model.named_parameters() if n.endswith("proj.weight")]
        assert projections and all(kind == "DTensor" for _, kind in projections), (family, projections)
        reports[family] = _compare_step(model)
        reports[f"{family} generate"] = _compare_generate(model)
        if family == "llama":
            pipe = EagerMicroPipeline()  # one for two steps, as a training loop keeps it
            reports["llama twice"] = [_compare_step(model, pipe=pipe) for _ in range(2)]
            # Nothing of eagertp's left in reference cycles (tests/test_memory_cycles.py): HF's
            # plan adds q's, k's and v's all-reduced input gradients row by row. Objects of
            # eagertp's only: the step also runs HF's code in plain eager, whose cycles are its own.
            reports["llama left in cycles"] = left_in_cycles(
                lambda: _compare_step(model, pipe=pipe), tensors=False
            )[1]
            model.train()  # HF checkpoints its layers in training only
            for reentrant in (False, True):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
                reports[f"llama checkpointed reentrant={reentrant}"] = _compare_step(model)
            model.gradient_checkpointing_disable()
            model.eval()
            # HF's own 2-D parallelism: FSDP2 over 2 replicas of 2-rank TP
            assert dist.get_world_size(group) == 4, "fsdp_size=2 x tp_size=2 takes the pool's 4 ranks"
            reports["llama fsdp x tp"] = _compare_step(AutoModelForCausalLM.from_pretrained(
                os.path.join(path, family),
                distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
                dtype=torch.float32,
            ))
            # The docs' override of HF's plan: one all-reduce per region
            region = _docs_example("hf_one_all_reduce_per_region")
            region.register()
            reports["llama one all-reduce per region"] = _compare_step(AutoModelForCausalLM.from_pretrained(
                os.path.join(path, family),
                distributed_config=DistributedConfig(
                    tp_plan=region.ONE_ALL_REDUCE_PER_REGION, tp_size=dist.get_world_size(group)
                ),
                dtype=torch.float32,
            ))
        if family == "mixtral":
            # The override's attention rule alone: its mlp is the experts' block
            region = _docs_example("hf_one_all_reduce_per_region")
            region.register()
            attention_only = {k: v for k, v in region.ONE_ALL_REDUCE_PER_REGION.items() if k.endswith("self_attn")}
            reports["mixtral one all-reduce per attention"] = _compare_step(AutoModelForCausalLM.from_pretrained(
                os.path.join(path, family),
                distributed_config=DistributedConfig(tp_plan=attention_only, tp_size=dist.get_world_size(group)),
                dtype=torch.float32,
            ))
        if family in _IN_PIECES:
            reports[f"{family} in pieces"] = _compare_step(model, in_pieces=True)
            reports[f"{family} batch of one in pieces"] = _compare_step(model, in_pieces=True, batch=1)
    return reports


def _docs_example(name: str):
    """The module ``docs/_examples/<name>.py``, as the docs show it."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "_examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_docs_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compare_step(model, in_pieces: bool = False, batch: int = 2, pipe: EagerMicroPipeline | None = None) -> dict:
    """One forward + backward, plain eager then under EagerMicroPipeline
    (``pipe``, or a new one): are the logits, the loss and every gradient
    close, and what ran."""
    # 16 rows (split over 4 ranks), as 2 sequences of 8 or one of 16
    ids = torch.randint(0, 128, (batch, 16 // batch), generator=torch.Generator().manual_seed(1))

    def step(ctx):
        model.zero_grad()
        with ctx:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return {"logits": out.logits.detach(), "loss": out.loss.detach(), **grads}

    def local(tensors):
        # NB: each rank compares its own shards, and their placements: no
        # full_tensor(), which on torch 2.11 cannot gather the _StridedShard
        # placements transformers' plan makes (a ValueError in plain eager).
        return {n: (t.to_local(), t.placements) if hasattr(t, "to_local") else (t, None) for n, t in tensors.items()}

    # NB: not an OpCounter: a mode that runs a subclass's op whole does not see
    # the collectives DTensor issues inside its own dispatch (Gemma-2's).
    eager_counter = PlainCollectives()
    with eager_counter:
        expected = local(step(contextlib.nullcontext()))
    counter, pipe = OpCounter(), pipe or EagerMicroPipeline()
    with counter, _small_pieces() if in_pieces else contextlib.nullcontext():
        got = local(step(pipe))
    mismatches = {}
    for name, (e, placements) in expected.items():
        g, got_placements = got.get(name, (None, None))
        try:
            torch.testing.assert_close(g, e)
            assert got_placements == placements, f"placements {got_placements}, plain eager's {placements}"
        except AssertionError as err:  # also a gradient missing under eagertp (None)
            mismatches[name] = str(err)
    return {
        "compared": sorted(expected),
        "mismatches": mismatches,
        "stats": dict(pipe.stats),
        "explain": pipe.explain(),
        "eager_collectives": dict(collections.Counter(eager_counter.collectives)),
        "collectives": dict(collections.Counter(counter.collectives)),
        "explained": explained_collectives(pipe),
    }


def _compare_generate(model) -> dict:
    """Greedy ``generate`` under ``inference_mode``, plain eager then under
    EagerMicroPipeline: the same tokens, and what fused (TP inference)."""
    # 4 sequences, so that each decode step's [4, 1, 64] rows split over 4 ranks
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
        pipe = EagerMicroPipeline()
        with pipe:
            got = model.generate(ids, max_new_tokens=4, do_sample=False)
    return {"same_tokens": torch.equal(got, expected), "new_tokens": got.shape[1] - ids.shape[1],
            "stats": dict(pipe.stats), "explain": pipe.explain(), "summary": pipe.explain(summary=True)}


@contextlib.contextmanager
def _small_pieces():
    """As helpers.with_small_pieces: every shard in up to 4 pieces, so that
    the tiny models' gathers of products are made as they are sent."""
    from eagertp.backends import ring

    saved = dict(ring.PIECES)
    ring.PIECES.update({kind: (4, 1) for kind in ring.PIECES})
    try:
        yield
    finally:
        ring.PIECES.update(saved)


@pytest.fixture(scope="module")
def hf_reports(pool, tmp_path_factory):
    """Every family's report from every rank, from one run of the pool."""
    try:
        results = pool.run(_hf_worker, WORLD, str(tmp_path_factory.mktemp("hf")), list(_FAMILIES))
    finally:
        # NB: transformers stays imported in the workers (its lazy modules, its
        # threads): later tests that count live objects get fresh ones.
        pool.restart()
    return {family: [r[family] for r in results] for family in results[0]}


def _check_common(reports, family: str) -> None:
    """Same answers, every gradient present; the deferred collectives issued
    as ring messages, never as the program wrote them."""
    for r in reports:
        assert not r["mismatches"], (family, r["mismatches"])
        assert len(r["compared"]) > 10, (family, r["compared"])  # logits, loss and the gradients
        assert "all_reduce" not in r["collectives"] and "all_gather_into_tensor" not in r["collectives"], (family, r)
        assert r["collectives"]["send"] > 0, (family, r)
        # No invisible collective: explain() accounts for each that plain eager issued.
        eager = sum(n for name, n in r["eager_collectives"].items() if explained_kind(name))
        assert r["explained"] == eager > 0, (family, r["eager_collectives"], r["explain"])


def test_hf_transformers_tp_plan_llama_fuses_every_matmul_all_reduce(hf_reports):
    results = hf_reports["llama"]
    _check_common(results, "llama")
    for r in results:
        # Plain eager: 16 all-reduces (explain() names each one's input). 15 reduce a matmul output: forward, each
        # layer's rowwise o_proj and down_proj (4); backward, the input gradient
        # of each colwise linear, q/k/v/gate/up in both layers and lm_head (11).
        # One does not: the vocab-sharded embedding's forward (masked lookups
        # summed over ranks). And lm_head's output is all-gathered for the loss.
        assert r["eager_collectives"] == {"all_reduce": 16, "all_gather_into_tensor": 1}, r
        # Every matmul all-reduce fused; the other two unfused, each with its
        # reason, on the ring too (a peer could have fused its own: Invariant 2).
        # The norms between them run row by row on the all-reduces' gather
        # halves, and the next layer's matmuls bind through them: forward,
        # the embedding's and each layer's (4 of 5; the last feeds lm_head,
        # whose output is gathered, made as it is sent); backward, each
        # layer's norms' backward (4) (Note [Row-wise ops on gathered rows]).
        assert r["stats"] == {
            "matmul_all_reduce": 15, "unfused_all_reduce": 1, "unfused_all_gather": 1, "rowwise_ops": 99, "all_gather_matmul": 8, "fused_matmuls": 16,
        }, r
        lines = r["explain"].splitlines()
        assert sum(": fused with mm" in line for line in lines) == 15, r["explain"]
        unfused = [line for line in lines if ": not fused" in line]
        assert len(unfused) == 2, r["explain"]
        # Each layer's q, k and v input gradients, and gate's and up's, all-reduced
        # apart and then added: the hint (Note [Sums of all-reduced tensors]).
        assert lines[-1].startswith("hint: 10 all-reduces were added to each other, in 4 sums "), lines[-1]
        assert "would issue 6 fewer" in lines[-1], lines[-1]
        assert "all_reduce(sum) #0 f32[2, 8, 64]" in unfused[0], unfused
        # Its gather half in flight: the first layer's norm runs row by row on it, q, k, v bind.
        assert unfused[0].endswith(
            "not fused [ring]: its input is not the pending output of a matmul; its all-gather half fused with "
            "pow, mean, add, rsqrt, mul, mul (row by row) -> mm -> $13, mm -> $14, mm -> $15"
        ), unfused
        assert unfused[1].startswith("all_gather #0 f32[2, 8, 32] -> f32[8, 8, 32]"), unfused
        assert "not fused [ring]: no matmul consumed it before aten._log_softmax.default" in unfused[1], unfused


@pytest.mark.parametrize(
    "report, family, eager, fused, sums",
    [
        # Llama: q, k, v and gate, up summed first: 10 all-reduces a step, not 16.
        ("llama one all-reduce per region", "llama", {"all_reduce": 10, "all_gather_into_tensor": 1}, 9,
         {"mm + mm + mm": 2, "mm + mm": 2}),
        # Mixtral, the attention's rule alone (its mlp is the experts' block): 6, not 10,
        # and the experts' 6 sums, as before.
        ("mixtral one all-reduce per attention", "mixtral",
         {"all_reduce": 6, "allreduce_": 6, "all_gather_into_tensor": 1}, 5, {"mm + mm + mm": 2, "mm + mm": 0}),
    ],
    ids=["llama", "mixtral_attention"],
)
def test_hf_plan_override_all_reduces_once_per_region(hf_reports, report, family, eager, fused, sums):
    """The plan override docs/tuning.md shows for HF
    (``docs/_examples/hf_one_all_reduce_per_region.py``): each layer's
    attention (and MLP) take their input once, so their linears' input
    gradients are summed before one all-reduce each. Every all-reduce of a
    matmul output fuses, with all of its region's matmuls; plain eager's
    answers under the same plan; no hint left."""
    results = hf_reports[report]
    _check_common(results, family)
    for r in results:
        assert r["eager_collectives"] == eager, r
        # The rest (the embedding's, the experts' sums) unfused, with their reasons.
        assert r["stats"]["matmul_all_reduce"] == fused, r
        assert r["stats"]["unfused_all_reduce"] == sum(eager.values()) - 1 - fused, r
        lines = r["explain"].splitlines()
        for terms, n in sums.items():
            assert sum(f": fused with {terms} ->" in line for line in lines) == n, (terms, r["explain"])
        assert not any(line.startswith("hint: ") for line in lines), r["explain"]


# family -> its stats for 4 forwards of ``generate`` (the prompt's, then one per
# new token): each forward's rowwise all-reduces of matmul outputs fused
# (o_proj and down_proj in 2 layers; Mixtral's experts sum by index_add, so
# only o_proj), and unfused with their reasons the embedding's all-reduce,
# Mixtral's expert sums, lm_head's gather of the last position's logits (read
# whole by the sampler) and Phi-3's gathers of its packed qkv and gate_up
# products (at these sizes each shard travels in one piece: made first).
_GENERATE_STATS = {
    "llama": {"matmul_all_reduce": 16, "unfused_all_reduce": 4, "unfused_all_gather": 4, "rowwise_ops": 136, "all_gather_matmul": 16, "fused_matmuls": 32},
    "qwen3": {"matmul_all_reduce": 16, "unfused_all_reduce": 4, "unfused_all_gather": 4, "rowwise_ops": 136, "all_gather_matmul": 16, "fused_matmuls": 16},
    "mixtral": {"matmul_all_reduce": 8, "unfused_all_reduce": 12, "unfused_all_gather": 4, "rowwise_ops": 136, "all_gather_matmul": 16, "fused_matmuls": 32},
    # Its packed qkv and gate_up products are gathered: made as they are sent, not bound.
    "phi3": {"matmul_all_reduce": 16, "unfused_all_reduce": 4, "unfused_all_gather": 20, "rowwise_ops": 152},
    # Its soft-capped logits: the last position's gathered for the sampler's division.
    "gemma2": {"matmul_all_reduce": 16, "unfused_all_reduce": 4, "unfused_all_gather": 4,
               "rowwise_ops": 236 - 4 * _GEMMA_SCALE_BEFORE_ALL_REDUCE, "all_gather_matmul": 16, "fused_matmuls": 32},
    "cohere": {"matmul_all_reduce": 16, "unfused_all_reduce": 4, "unfused_all_gather": 4, "rowwise_ops": 124, "all_gather_matmul": 8, "fused_matmuls": 24},
    # Its q and k products gathered for their norms, in every forward (4 + 24).
    "olmo2": {"matmul_all_reduce": 16, "unfused_all_reduce": 4, "unfused_all_gather": 28, "rowwise_ops": 136, "all_gather_matmul": 8, "fused_matmuls": 8},
    "nemotron": {"matmul_all_reduce": 16, "unfused_all_reduce": 4, "unfused_all_gather": 4, "rowwise_ops": 36, "all_gather_matmul": 16, "fused_matmuls": 32},
}


@pytest.mark.parametrize("family", list(_GENERATE_STATS))
def test_hf_generate_under_inference_mode_fuses_every_matmul_all_reduce(hf_reports, family):
    """TP inference as HF runs it: greedy ``generate`` under ``inference_mode``
    gives plain eager's tokens, and every all-reduce of a matmul output in
    every forward fuses (``_GENERATE_STATS``)."""
    stats = _GENERATE_STATS[family]
    for r in hf_reports[f"{family} generate"]:
        assert r["same_tokens"] and r["new_tokens"] == 4, r
        assert r["stats"] == stats, r
        lines = r["explain"].splitlines()
        assert sum(": fused with mm" in line for line in lines) == stats["matmul_all_reduce"], r["explain"]
        unfused = [line for line in lines if ": not fused" in line]
        assert len(unfused) == stats["unfused_all_reduce"] + stats["unfused_all_gather"], r["explain"]
        reduces = [line for line in unfused if line.startswith("all_reduce")]
        assert all(": not fused [ring]: its input is not the pending output of a matmul" in line for line in reduces), reduces
    if family == "llama":  # explain(summary=True): what a whole generate did, a line per outcome
        assert_expected_inline(hf_reports["llama generate"][0]["summary"], """\
24 collectives on managed groups: 16 fused, 8 not fused
     4 x all_reduce(sum) not fused [ring]: its input is not the pending output of a matmul
    16 x all_reduce(sum) fused [ring]
     4 x all_gather not fused [ring]: no matmul consumed it before aten._to_copy.default read $…, and none ran while it was in flight; mm -> $… made its shard first: f32[4, 1, 32] travels in one piece (Note [Pieces]): nothing to overlap its making with""")


def test_hf_llama_steps_with_one_pipeline_run_at_once_what_the_step_before_read_whole(hf_reports):
    """Two steps in one pipeline: the second runs at once the matmuls the first
    deferred and read whole with no collective issued since (Note [Deferrals
    that gained nothing]) and fuses as the first did; both are plain eager's."""
    for first, second in hf_reports["llama twice"]:
        _check_common([first, second], "llama")
        assert "matmuls_run_at_once" not in first["stats"], first["stats"]
        assert second["stats"].pop("matmuls_run_at_once", 0) > 0, second["stats"]
        assert first["stats"] == second["stats"], (first["stats"], second["stats"])


def test_hf_llama_step_leaves_nothing_in_reference_cycles(hf_reports):
    """A third step in the same pipeline (plain eager's, then eagertp's) leaves
    no object of eagertp's in a reference cycle, which only the garbage
    collector would free, with whatever tensors it holds (Note [Freed without
    the garbage collector])."""
    for left in hf_reports["llama left in cycles"]:
        assert left == {}, left


def test_hf_fsdp_and_tp_fuses_the_tp_all_reduces(hf_reports):
    """``DistributedConfig(tp_size=2, fsdp_size=2)``: HF shards the TP model
    with FSDP2 over the other mesh dim. Every TP matmul all-reduce fuses
    (Llama's 15). FSDP's collectives on the other dim read no matmul output
    and feed no matmul: its 7 parameter all-gathers (4 in forward, unfused with
    the reason; 3 in backward, its prefetches, overlapped the matmuls that ran
    while they were in flight) and 4 gradient reduce-scatters. The embedding's
    all-reduce and lm_head's gather as in the TP-only run. Loss, logits and
    every gradient are plain eager's."""
    for r in hf_reports["llama fsdp x tp"]:
        _check_common([r], "llama")
        assert r["stats"] == {
            "matmul_all_reduce": 15, "unfused_all_reduce": 1,
            "unfused_all_gather": 5, "overlapped_all_gather": 3, "unfused_reduce_scatter": 4, "rowwise_ops": 99, "all_gather_matmul": 6, "fused_matmuls": 12,
        }, r
        eager = r["eager_collectives"]
        assert eager["all_reduce"] == 16, eager  # TP's 15 + the embedding's
        lines = r["explain"].splitlines()
        assert sum(": fused with mm" in line for line in lines) == 15, r["explain"]
        fsdp_reads = [line for line in lines if "fsdp.split_with_sizes_copy" in line]
        assert len(fsdp_reads) == 7 and all(line.startswith("all_gather") for line in fsdp_reads), r["explain"]


@pytest.mark.parametrize(
    "reentrant, fused, rowwise", [(False, 17, 113), (True, 19, 115)], ids=["non_reentrant", "reentrant"]
)
def test_hf_gradient_checkpointing_fuses_recomputed_all_reduces(hf_reports, reentrant, fused, rowwise):
    """HF's own ``gradient_checkpointing_enable()`` on the TP model: each
    decoder layer's forward runs again in backward, and its all-reduces (o_proj,
    down_proj) fuse again: reentrant, 4 more than the 15 of a step (its first
    forward runs under no_grad, where HF all-reduces in place with raw c10d,
    its inference path: fused too). Non-reentrant stops each layer's
    recomputation once it has what backward saved, before its down_proj's
    all-reduce (plain eager too): 2 more. The gradients are plain eager's."""
    results = hf_reports[f"llama checkpointed reentrant={reentrant}"]
    _check_common(results, "llama")
    for r in results:
        assert r["stats"] == {
            "matmul_all_reduce": fused, "unfused_all_reduce": 1, "unfused_all_gather": 1,
            "rowwise_ops": rowwise, "all_gather_matmul": 10, "fused_matmuls": 18,
        }, r
        eager = r["eager_collectives"]
        assert eager["all_reduce"] + eager.get("allreduce_", 0) == fused + 1, r
        assert eager.get("allreduce_", 0) == (4 if reentrant else 0), r
        assert "allreduce_" not in r["collectives"], r


# family -> (plain eager's collectives, eagertp's stats, c10d ops eagertp issued as
# written, unfused explain() reasons: (count, text in the line)).
_OTHER_PLANS = {
    # Llama's 15 matmul all-reduces, plus 4 raw c10d all_reduce_ of the q/k norm
    # weight gradients (HF's "replicated_with_grad_allreduce" hooks): 1-d, so
    # their rows do not split, a shape-only reason every rank agrees on, so
    # they are issued as the program wrote them.
    "qwen3": (
        {"all_reduce": 16, "allreduce_": 4, "all_gather_into_tensor": 1},
        {"matmul_all_reduce": 15, "unfused_all_reduce": 5, "unfused_all_gather": 1, "rowwise_ops": 99, "all_gather_matmul": 8, "fused_matmuls": 12},
        {"allreduce_": 4},
        [(4, "not fused: f32[128] is one row (all dims but the last), which does not split over 4 ranks"),
         (1, "not fused [ring]: its input is not the pending output of a matmul"),
         (1, "not fused [ring]: no matmul consumed it before aten._log_softmax.default")],
    ),
    # Attention as Llama's (o_proj forward, q/k/v backward, lm_head: 9 fused);
    # the experts' outputs and input gradients (index_add sums over experts,
    # raw c10d all_reduce_ among them), the router's gradient and the
    # embedding are not matmul outputs: on the ring, unfused, with the reason.
    "mixtral": (
        {"all_reduce": 10, "allreduce_": 6, "all_gather_into_tensor": 1},
        {"matmul_all_reduce": 9, "unfused_all_reduce": 7, "unfused_all_gather": 1, "rowwise_ops": 109, "all_gather_matmul": 6, "fused_matmuls": 12},
        {},
        [(7, "not fused [ring]: its input is not the pending output of a matmul"),
         (1, "not fused [ring]: no matmul consumed it before aten._log_softmax.default")],
    ),
    # "colwise_gather_output": each layer's packed qkv and gate_up products are
    # all-gathered along the last dim (forward), as are the gradients of the
    # "rowwise_split_input" inputs (backward), and lm_head's output: 9 gathers
    # of matmul outputs. At these sizes each shard travels in one piece, so
    # each product is made first; their consumers are elementwise, so no
    # matmul binds to them either: unfused, with the reason. In pieces:
    # test_hf_gathers_of_matmul_outputs_made_as_they_are_sent.
    "phi3": (
        {"all_reduce": 10, "all_gather_into_tensor": 9},
        {"matmul_all_reduce": 9, "unfused_all_reduce": 1, "unfused_all_gather": 9, "rowwise_ops": 93, "all_gather_matmul": 4, "fused_matmuls": 4},
        {},
        [(1, "not fused [ring]: its input is not the pending output of a matmul"),
         (9, "not fused [ring]: no matmul consumed it before ")],
    ),
    # Llama's collectives, with Gemma's idioms between them: embeddings scaled
    # by sqrt(hidden), RMSNorm weights applied as (1 + w), a norm after each
    # sublayer as well as before it (both row by row on the gather halves),
    # soft-capped logits (lm_head's gather read by a division). The embedding's
    # all-reduce runs inside DTensor's dispatch of that scaling (torch 2.12 on),
    # where a mode that runs a subclass's op whole (an OpCounter) does not see it.
    "gemma2": (
        {"all_reduce": 16, "all_gather_into_tensor": 1},
        {"matmul_all_reduce": 15, "unfused_all_reduce": 1, "unfused_all_gather": 1,
         "rowwise_ops": 169 - _GEMMA_SCALE_BEFORE_ALL_REDUCE, "all_gather_matmul": 8, "fused_matmuls": 16},
        {},
        [(1, "not fused [ring]: its input is not the pending output of a matmul"),
         (1, "not fused [ring]: no matmul consumed it before aten.div.Tensor")],
    ),
    # Attention and MLP in parallel on one LayerNorm (mean-centred, no bias):
    # each block's residual sums both all-reduced outputs, which the next
    # norm reads chunk by chunk; the MLP's gate and up run after attention
    # has read the normed rows whole, so only q, k, v bind to each gather.
    "cohere": (
        {"all_reduce": 16, "all_gather_into_tensor": 1},
        {"matmul_all_reduce": 15, "unfused_all_reduce": 1, "unfused_all_gather": 1, "rowwise_ops": 95, "all_gather_matmul": 4, "fused_matmuls": 10},
        {},
        [(1, "not fused [ring]: its input is not the pending output of a matmul"),
         (1, "not fused [ring]: no matmul consumed it before aten.mul.Tensor")],
    ),
    # Norms after each sublayer only, and q/k norms over the whole projection:
    # the plan gathers the q and k products (forward) and their gradients'
    # inputs (backward) along the last dim, elementwise consumers, made first
    # at these sizes (in pieces: test_hf_gathers_of_matmul_outputs_made_as_they_are_sent).
    "olmo2": (
        {"all_reduce": 16, "all_gather_into_tensor": 9},
        {"matmul_all_reduce": 15, "unfused_all_reduce": 1, "unfused_all_gather": 9, "rowwise_ops": 99, "all_gather_matmul": 6, "fused_matmuls": 8},
        {},
        [(1, "not fused [ring]: its input is not the pending output of a matmul"),
         (9, "not fused [ring]: no matmul consumed it before ")],
    ),
    # LayerNorm with a bias (native_layer_norm row by row) and an MLP with no
    # gate (up, relu^2, down): 13 matmul all-reduces.
    "nemotron": (
        {"all_reduce": 14, "all_gather_into_tensor": 1},
        {"matmul_all_reduce": 13, "unfused_all_reduce": 1, "unfused_all_gather": 1, "rowwise_ops": 27, "all_gather_matmul": 8, "fused_matmuls": 16},
        {},
        [(1, "not fused [ring]: its input is not the pending output of a matmul"),
         (1, "not fused [ring]: no matmul consumed it before aten._log_softmax.default")],
    ),
}


@pytest.mark.parametrize("family", list(_OTHER_PLANS))
def test_hf_transformers_tp_plans_of_other_families(hf_reports, family):
    """Same answers as plain eager for every gradient, every all-reduce of a
    matmul output fused, and every other collective unfused with its reason."""
    eager, stats, as_written, reasons = _OTHER_PLANS[family]
    results = hf_reports[family]
    _check_common(results, family)
    for r in results:
        assert r["eager_collectives"] == eager, r
        assert r["stats"] == stats, r
        issued = {op: n for op, n in r["collectives"].items() if op not in ("send", "recv_")}
        assert issued == as_written, r
        lines = r["explain"].splitlines()
        assert sum(": fused with mm" in line for line in lines) == stats["matmul_all_reduce"], r["explain"]
        unfused = [line for line in lines if ": not fused" in line]
        assert len(unfused) == sum(n for n, _ in reasons), r["explain"]
        for n, text in reasons:
            assert sum(text in line for line in unfused) == n, (text, r["explain"])


# family -> (its stats with every shard in pieces, its gathers of matmul outputs)
_GATHERS_IN_PIECES = {
    # Llama's "colwise_rep" lm_head: the logits gathered along the vocabulary
    # (Qwen3 and Mixtral too, their all-reduces in pieces as well).
    "llama": ({"matmul_all_gather": 1, "matmul_all_reduce": 15, "unfused_all_reduce": 1, "rowwise_ops": 99, "all_gather_matmul": 8, "fused_matmuls": 16}, 1),
    "qwen3": ({"matmul_all_gather": 1, "matmul_all_reduce": 15, "unfused_all_reduce": 5, "rowwise_ops": 99, "all_gather_matmul": 8, "fused_matmuls": 12}, 1),
    "mixtral": ({"matmul_all_gather": 1, "matmul_all_reduce": 9, "unfused_all_reduce": 7, "rowwise_ops": 109, "all_gather_matmul": 6, "fused_matmuls": 12}, 1),
    # Phi-3's "colwise_gather_output": qkv and gate_up products forward, the
    # "rowwise_split_input" gradients backward, and lm_head's logits.
    "phi3": ({"matmul_all_gather": 9, "matmul_all_reduce": 9, "unfused_all_reduce": 1, "rowwise_ops": 93, "all_gather_matmul": 4, "fused_matmuls": 4}, 9),
    # OLMo-2's q and k products forward, their gradients' inputs backward, and lm_head's logits.
    "olmo2": ({"matmul_all_gather": 9, "matmul_all_reduce": 15, "unfused_all_reduce": 1, "rowwise_ops": 99, "all_gather_matmul": 6, "fused_matmuls": 8}, 9),
}


@pytest.mark.parametrize("family", _IN_PIECES)
@pytest.mark.parametrize("batch", ["", " batch of one"], ids=["batch2", "batch1"])
def test_hf_gathers_of_matmul_outputs_made_as_they_are_sent(hf_reports, family, batch):
    """Every shard in pieces: each gather of a matmul output in the family's
    own plan makes the product as it sends it, and every gradient still
    equals plain eager. A batch of one's [1, S, V/W] logits split along S
    (``piece_dim``)."""
    stats, gathers = _GATHERS_IN_PIECES[family]
    results = hf_reports[f"{family}{batch} in pieces"]
    _check_common(results, family)
    for r in results:
        assert r["stats"] == stats, r
        lines = [line for line in r["explain"].splitlines() if line.startswith("all_gather")]
        assert len(lines) == gathers and all(": fused with mm -> $" in line for line in lines), r["explain"]
        assert r["eager_collectives"]["all_gather_into_tensor"] == gathers, r

