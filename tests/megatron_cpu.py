"""Megatron-core's own tensor-parallel layers on CPU and gloo (imported inside
workers by tests/test_megatron.py).

Megatron-core (0.16.1, the release pip resolves for Python 3.11; no Apex, no
TransformerEngine) is written for CUDA. Every change it needs to run here is
in ``megatron_on_cpu`` and ``cpu_config``, each with the reason; nothing in
the layers themselves is replaced, so their collectives, buffers and
autograd functions are Megatron's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Apex / TransformerEngine not installed": expected here
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

SEED = 1234
HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 64, 4, 256, 128, 16, 2


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's RNG tracker keeping CPU generator states (its own saves and
    restores ``torch.cuda`` RNG states)."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm with Megatron's norm signature, its parameters marked
    ``sequence_parallel`` as Apex's and TransformerEngine's norms mark them
    (Megatron's own torch-norm wrapper refuses sequence parallelism)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


@contextlib.contextmanager
def megatron_on_cpu(group: dist.ProcessGroup) -> Iterator[None]:
    """Megatron's TP state over ``group``, and the patches it needs on CPU,
    restored on exit. Build and run models inside it: collectives allocate
    their outputs at run time."""
    saved_device = torch.cuda.current_device
    saved_tracker = megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    # Megatron allocates collective outputs, its global gather buffer and the
    # rotary tables on torch.cuda.current_device().
    torch.cuda.current_device = lambda: torch.device("cpu")
    _set_parallel_state(group)
    # Weight initialisation and attention fork the RNG tracker even with
    # dropout 0; seeded as model_parallel_cuda_manual_seed does (which calls
    # torch.cuda.manual_seed).
    tracker = CpuRNGStatesTracker()
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, SEED)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, SEED + 2718 + group.rank())
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, SEED + 1024)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()  # drops references only: the groups stay the pool's
        torch.cuda.current_device = saved_device
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker


_OWN_GROUPS: dict[int, dist.ProcessGroup] = {}


def _set_parallel_state(group: dist.ProcessGroup) -> None:
    """Megatron's parallel state for TP over ``group`` and one rank on every
    other dimension. ``initialize_model_parallel`` would make its groups over
    the whole default world, which a job on 2 of the pool's 4 ranks cannot."""
    ps = parallel_state
    ps.destroy_model_parallel()
    rank = dist.get_rank()
    if rank not in _OWN_GROUPS:  # NB: made by this rank alone; c10d's group counter stays as it was
        _OWN_GROUPS[rank] = dist.new_group([rank], use_local_synchronization=True)
    alone, tp_ranks = _OWN_GROUPS[rank], dist.get_process_group_ranks(group)
    for name in (
        "_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
        "_TENSOR_AND_DATA_PARALLEL_GROUP", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "_EXPERT_TENSOR_PARALLEL_GROUP",
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
    ):
        setattr(ps, name, group)
    for name in (
        "_PIPELINE_MODEL_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_GLOO",
        "_DATA_PARALLEL_GROUP_WITH_CP", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_EMBEDDING_GROUP", "_POSITION_EMBEDDING_GROUP",
        "_EXPERT_MODEL_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    ):
        setattr(ps, name, alone)
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = ps._MODEL_PARALLEL_GLOBAL_RANKS = tp_ranks
    for name in (
        "_PIPELINE_GLOBAL_RANKS", "_CONTEXT_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS",
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS",
    ):
        setattr(ps, name, [rank])
    ps._set_global_memory_buffer()


def cpu_config(sequence_parallel: bool, tp: int, num_layers: int = 2) -> TransformerConfig:
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        params_dtype=torch.float32,
        # One master weight per layer, split: the same model on every rank.
        use_cpu_initialization=True,
        # The fused weight-gradient accumulation is an Apex CUDA kernel
        # (gradients then land in .grad, as autograd puts them).
        gradient_accumulation_fusion=False,
        # The fused kernels are CUDA's (or Apex's); torch's paths instead.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False,
        # Deterministic: the same draws in both runs compared.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_func=torch.nn.functional.gelu,
    )


def layer_spec():
    """Megatron's local (non-TransformerEngine) GPT layer, with the norm above."""
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = SequenceParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return spec


def causal_mask() -> torch.Tensor:
    """Explicit: Megatron's default (no mask) builds one with device="cuda"."""
    return torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)


def build(kind: str, sequence_parallel: bool, tp: int) -> torch.nn.Module:
    """``mlp`` (ColumnParallelLinear -> gelu -> RowParallelLinear), ``layer``
    (a TransformerLayer), ``gpt_tied`` / ``gpt_untied`` (a 2-layer GPTModel,
    its output layer tied to the embedding, Megatron's default, or not)."""
    torch.manual_seed(SEED)
    config = cpu_config(sequence_parallel, tp)
    if kind == "mlp":
        submodules = MLPSubmodules(linear_fc1=tensor_parallel.ColumnParallelLinear, linear_fc2=tensor_parallel.RowParallelLinear)
        return MLP(config, submodules)
    if kind == "layer":
        return build_module(layer_spec(), config=config, layer_number=1)
    block = TransformerBlockSubmodules(layer_specs=[layer_spec()] * config.num_layers, layer_norm=SequenceParallelLayerNorm)
    return GPTModel(
        config=config, transformer_layer_spec=block, vocab_size=VOCAB, max_sequence_length=SEQ,
        share_embeddings_and_output_weights=kind == "gpt_tied",
    )


def forward_backward(kind: str, model: torch.nn.Module, sequence_parallel: bool, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """One step's loss, output and gradients (parameters', and the input's for
    a layer), cloned. The input is the same on every rank; under sequence
    parallelism each rank takes its rows of the sequence."""
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(SEED + 7)
    if kind.startswith("gpt"):
        tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        out = model(tokens, positions, causal_mask(), labels=labels)  # per-token loss [B, S]
        x = None
    else:
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)  # [S, B, H], Megatron's layout
        if sequence_parallel:
            x = x.chunk(group.size())[group.rank()]
        x = x.contiguous().requires_grad_()
        if kind == "layer":
            out, _ = model(x, attention_mask=causal_mask())  # (hidden states, context)
        else:
            out, bias = model(x)  # the row-parallel bias, returned for a fused add
            out = out if bias is None else out + bias
    loss = out.float().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return [loss.detach().clone(), out.detach().clone(), *grads, *([] if x is None else [x.grad.clone()])]
