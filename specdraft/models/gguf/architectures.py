"""What each GGUF architecture's file holds and which transformers model it becomes, one entry
per architecture: llama.cpp's tensor names to the module paths of transformers' model, whether
the converter stored the query/key rows permuted for llama.cpp's rotary layout, and the config
numbers transformers' GGUF reader leaves out. mapping.py builds a model from any entry; an
architecture whose transformers modules the lean forward runs (lean/layers.py) is one entry
here and nothing else. llama.cpp is the oracle: tests/test_llama_cpp_oracle.py compares the
logits of each entry's files with llama.cpp's on the same file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# llama.cpp's names (blk.N.<name>.weight / .bias) -> the layer's module, for Llama-shaped layers
LLAMA_MATRICES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
LLAMA_VECTORS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
# Phi-3: queries, keys and values in one matrix, and the gate and up projections in another
FUSED_MATRICES = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
                  "ffn_down": "mlp.down_proj"}
QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
GLOBAL_VECTORS = {"output_norm.weight": "model.norm.weight"}
# A mixture of experts (Qwen3-MoE): the router's float weights [experts, hidden], and each
# expert's gate, up and down matrices stacked in one 3D tensor per kind (expert outermost)
MOE_VECTORS = {"ffn_gate_inp.weight": "mlp.gate.weight"}
MOE_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
ATTENTION_MATRICES = {name: path for name, path in LLAMA_MATRICES.items() if name.startswith("attn")}
GEMMA_NORMS = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


@dataclass(frozen=True)
class Architecture:
    name: str
    layer_matrices: Mapping[str, str] = field(default_factory=lambda: LLAMA_MATRICES)
    layer_vectors: Mapping[str, str] = field(default_factory=lambda: LLAMA_VECTORS)
    # llama.cpp's converter permutes a llama model's query and key rows for its rotary layout
    # (interleaved pairs); transformers' modules want them back in order
    rows_permuted: bool = False
    # "<architecture>.<key>" metadata -> the config attribute transformers' reader leaves unset
    config_keys: Mapping[str, str] = field(default_factory=dict)
    # the file's norm weights are 1 + transformers' (Gemma's RMSNorm multiplies by 1 + weight)
    norm_offset: float = 0.0
    # the input embedding's rows come out times sqrt(hidden size) (Gemma)
    scaled_embedding: bool = False
    # what else the config needs from the file's numbers (config, field_of)
    adjust: Callable[[Any, Callable[[str], Any]], None] | None = None
    # tensors that are no module's weight (rope_freqs.weight: Llama 3's rope scaling, read by
    # mapping.py as a factor per rotary frequency)
    ignored: tuple[str, ...] = ("rope_freqs.weight",)
    # a layer's stacked expert tensors -> which of an expert's matrices each holds (mapping.py
    # splits them into the experts of the layer's `mlp.experts`)
    expert_matrices: Mapping[str, str] = field(default_factory=dict)

    def configure(self, config: Any, field_of: Any) -> None:
        """Set on `config` what transformers' reader left out (`field_of(key)`: the file's
        "<architecture>.<key>" value, None when absent)."""
        for key, attribute in self.config_keys.items():
            value = field_of(key)
            if value is not None:
                setattr(config, attribute, int(value))
        if self.adjust is not None:
            self.adjust(config, field_of)
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, int) and not 0 <= pad < config.vocab_size:
            # a config class's default (Phi-3's 32000) that the file's vocabulary does not reach
            config.pad_token_id = None


def gemma3_attention_scale(config: Any, field_of: Callable[[str], Any]) -> None:
    """Gemma 3 scales attention scores by query_pre_attn_scalar ** -0.5, which the file does not
    hold and transformers' reader leaves at its default (256): llama.cpp takes the head size,
    and hidden / heads for the 62-layer 27B model, as the released configs have it."""
    if field_of("block_count") == 62:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = int(field_of("attention.key_length") or config.head_dim)


def qwen3moe_routing(config: Any, field_of: Callable[[str], Any]) -> None:
    """llama.cpp renormalizes a Qwen3-MoE token's chosen experts' weights to sum to 1 (the
    released models' norm_topk_prob); transformers' config class defaults to not doing so.
    Every layer is a mixture (the file holds no dense MLP)."""
    config.norm_topk_prob = True
    config.decoder_sparse_step, config.mlp_only_layers = 1, []


ARCHITECTURES = {
    "llama": Architecture("llama", rows_permuted=True),
    "mistral": Architecture("mistral"),
    "qwen2": Architecture("qwen2"),
    # QK norm; its head size is not the hidden size over the heads (Qwen3-0.6B: 1024 / 16 vs 128)
    "qwen3": Architecture("qwen3", layer_vectors={**LLAMA_VECTORS, **QK_NORMS},
                          config_keys={"attention.key_length": "head_dim"}),
    "phi3": Architecture("phi3", layer_matrices=FUSED_MATRICES),
    # norms after attention and after the MLP besides the two before; local (sliding-window)
    # and global layers, whose pattern and rotary bases transformers' config holds
    "gemma3": Architecture("gemma3", layer_vectors={**QK_NORMS, **GEMMA_NORMS}, norm_offset=1.0,
                           scaled_embedding=True, config_keys={"attention.key_length": "head_dim"},
                           adjust=gemma3_attention_scale),
    # Qwen3's attention (QK norm), a mixture of experts in every layer's MLP
    "qwen3moe": Architecture("qwen3moe", layer_matrices=ATTENTION_MATRICES,
                             layer_vectors={**LLAMA_VECTORS, **QK_NORMS, **MOE_VECTORS}, expert_matrices=MOE_EXPERTS,
                             config_keys={"attention.key_length": "head_dim",
                                          "expert_feed_forward_length": "moe_intermediate_size"},
                             adjust=qwen3moe_routing),
}
