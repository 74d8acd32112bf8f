"""Which models the lean forward (lean/decoder.py) runs, and how each layer of one runs there:
`lean_problem` says in one line why a model is not run (it then goes through transformers),
`lean_layers` builds the layers (lean/layers.py) with what the model's config says of each:
its MLP activation, its sliding window, the rotary table it reads (Gemma 3's local and global
layers have their own bases), and `rope_kinds` names those tables."""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.quantize import Int4Linear, Int8Linear
from specdraft.models.kernels.experts import Experts
from specdraft.models.lean.layers import ACTIVATIONS, LeanLayer, layer_norm_problem, norm_problem, projections
from specdraft.models.lean.mixture import is_mixture

log = logging.getLogger("specdraft")

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                 "Gemma3ForCausalLM", "Qwen3MoeForCausalLM")


def lean_problem(model: nn.Module) -> str | None:
    """Why the lean forward cannot run `model`, or None when it can."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(ARCHITECTURES)}"
    config = model.config
    if name == "MistralForCausalLM" and getattr(config, "sliding_window", None) \
            and not getattr(config, "layer_types", None):
        return "it has sliding-window attention"
    if getattr(config, "pretraining_tp", 1) > 1:
        return "it splits its projections (pretraining_tp)"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "its rotary positions cover only part of each head (partial_rotary_factor)"
    for feature in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, feature, None):
            return f"it caps its logits ({feature})"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional"
    return stack_problem(getattr(model, "model", None), model)


def activation_of(config) -> str | None:
    """The MLP's activation as lean/layers.py names it (None: one it does not run)."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return ACTIVATIONS.get(name)


def stack_problem(inner: nn.Module | None, model: nn.Module | None = None) -> str | None:
    """Why the lean forward cannot run the decoder stack `inner` (a LlamaModel-like body:
    layers, rotary module, final norm) of `model` (itself, when it is a bare stack)."""
    model = inner if model is None else model
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None:
        return "its decoder has no layers or rotary module where Llama's has them"
    if activation_of(inner.config) is None:
        return f"its MLP activation is {getattr(inner.config, 'hidden_activation', None) or inner.config.hidden_act}"
    types = getattr(inner.config, "layer_types", None) or ()
    if set(types) - {"full_attention", "sliding_attention"}:
        return f"its layers are of kinds it does not run ({', '.join(sorted(set(types)))})"
    problem = norm_problem(getattr(inner, "norm", None))
    if problem is not None:
        return f"its final norm is {problem}"
    linear = (nn.Linear, Int4Linear, Int8Linear, BlockLinear)
    for layer in layers:
        qkv, gate_up = projections(layer)
        mixture = is_mixture(layer.mlp)
        parts = [*qkv, layer.self_attn.o_proj, *gate_up, *([] if mixture else [layer.mlp.down_proj])]
        if not all(isinstance(p, linear) for p in parts):
            return "some of its projections are not linear layers this forward knows"
        if mixture and experts_problem(layer.mlp) is not None:
            return experts_problem(layer.mlp)
        problem = layer_norm_problem(layer)
        if problem is not None:
            return problem
    if any(_changing_hooks(module) for module in model.modules()):
        return "forward hooks change its tensors (they would be skipped)"
    return None


def experts_problem(mlp: nn.Module) -> str | None:
    """Why the lean forward cannot run a mixture-of-experts MLP, or None: its router scores
    experts with a float weight, and its experts are specdraft's (a GGUF file's) or
    transformers' 3D parameters (Qwen3MoeExperts)."""
    gate, experts = mlp.gate, mlp.experts
    if getattr(gate, "weight", None) is None or not gate.weight.is_floating_point() \
            or getattr(gate, "norm_topk_prob", None) is None:
        return "its mixture of experts' router is not a weight over the experts with top-k routing"
    if not isinstance(experts, Experts) and getattr(getattr(experts, "gate_up_proj", None), "dim", lambda: 0)() != 3:
        return f"its experts ({type(experts).__name__}) are not held as one gate/up and one down matrix each"
    return None


def rope_kinds(inner: nn.Module) -> list[str | None]:
    """The rotary tables a stack's layers read: one (None) for most models; Gemma 3's rotary
    module has one per layer kind (its `forward` takes the kind)."""
    types = getattr(inner.config, "layer_types", None)
    if types and hasattr(inner.rotary_emb, f"{types[0]}_inv_freq"):
        return sorted(set(types))
    return [None]


def inverse_frequencies(inner: nn.Module, kind: str | None) -> torch.Tensor | None:
    rotary = inner.rotary_emb
    return getattr(rotary, "inv_freq" if kind is None else f"{kind}_inv_freq", None)


def lean_layers(inner: nn.Module) -> list[LeanLayer]:
    """The stack's layers as the lean forward runs them."""
    config, kinds = inner.config, rope_kinds(inner)
    types = getattr(config, "layer_types", None) or ["full_attention"] * len(inner.layers)
    window = getattr(config, "sliding_window", None) or 0
    return [LeanLayer.of(layer, activation_of(config), window if kind == "sliding_attention" else 0,
                         kinds.index(kind) if kinds != [None] else 0)
            for layer, kind in zip(inner.layers, types)]


def _changing_hooks(module: nn.Module) -> list:
    """The module's forward hooks, less transformers' own output capturing (installed for
    good by a call with output_hidden_states, it records tensors and changes none)."""
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    return [hook for hook in hooks if "output_capturing_hook" not in getattr(hook, "__qualname__", "")]


def invariant_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether specdraft's kernels run the attention and norms here (float32 on a CPU, a head
    size they take, the kernels built)."""
    if device.type != "cpu" or dtype != torch.float32 or head_dim % 8 or head_dim > 256:
        return False
    from specdraft.models.kernels.native import kernel_problem

    return kernel_problem() is None


def lean_choice(core: str, model: nn.Module, device: torch.device, stack: bool = False) -> bool:
    """Whether a drafter's model runs the lean forward under `[decode] drafter_core`: "auto"
    on a CPU when the model allows it, "lean" wherever it does (a model it cannot run says
    why in the log and runs through transformers), "transformers" never. `stack`: `model`
    is a bare decoder stack fed embeddings (a draft head's layer)."""
    if core == "transformers" or (core == "auto" and device.type != "cpu"):
        return False
    problem = stack_problem(model) if stack else lean_problem(model)
    if problem is not None:
        name = "a draft head" if stack else type(model).__name__
        (log.warning if core == "lean" else log.debug)("%s runs through transformers: %s", name, problem)
    return problem is None
