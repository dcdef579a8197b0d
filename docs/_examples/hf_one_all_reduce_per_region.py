"""One all-reduce per region for HuggingFace transformers' TP plans.

HF's ``"colwise"`` style makes each column-parallel linear take its input on
its own, so in backward each all-reduces its own input gradient: q, k and v
three times, a gated MLP's gate and up twice. ``ReplicatedInput`` on the
attention and the MLP hands their linears one replicated DTensor instead:
autograd sums the partial input gradients, and the region all-reduces once
(eagertp fuses that all-reduce with all of the region's matmuls)::

    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    register()
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan=ONE_ALL_REDUCE_PER_REGION)
    )

``tp_plan`` as a dict overrides rules of the model's own plan; its keys name
modules from the top-level model (``model.layers.*``, not ``layers.*``). For
Llama-like families (the attention at ``self_attn``, the MLP at ``mlp``);
tested with Llama by tests/test_hf.py. Where ``mlp`` is a mixture of experts
(Mixtral), its router reads the input with a replicated weight of its own:
keep the attention's rule only.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

ONE_ALL_REDUCE_PER_REGION = {
    "model.layers.*.self_attn": "replicated_input",
    "model.layers.*.mlp": "replicated_input",
}


class ReplicatedInput(TensorParallelLayer):
    """The module's input (``hidden_states``, positional or by keyword) as
    one replicated DTensor, shared by its column-parallel linears. Not under
    ``no_grad`` / ``inference_mode``: there HF's linears take their local
    fast path, and there is no backward to save an all-reduce in."""

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        if not torch.is_grad_enabled():
            return args, kwargs
        if args:
            return (_replicated(args[0], mesh), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _replicated(kwargs["hidden_states"], mesh)}


def _replicated(x, mesh):
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)


def register() -> None:
    """Make ``"replicated_input"`` a style that ``tp_plan`` can name."""
    ALL_PARALLEL_STYLES.register("replicated_input", ReplicatedInput())
