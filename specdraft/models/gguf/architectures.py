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
from typing import Any, Mapping

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
    # tensors that are no module's weight (rope_freqs.weight: Llama 3's rope scaling, read by
    # mapping.py as a factor per rotary frequency)
    ignored: tuple[str, ...] = ("rope_freqs.weight",)

    def configure(self, config: Any, field_of: Any) -> None:
        """Set on `config` what transformers' reader left out (`field_of(key)`: the file's
        "<architecture>.<key>" value, None when absent)."""
        for key, attribute in self.config_keys.items():
            value = field_of(key)
            if value is not None:
                setattr(config, attribute, int(value))
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, int) and not 0 <= pad < config.vocab_size:
            # a config class's default (Phi-3's 32000) that the file's vocabulary does not reach
            config.pad_token_id = None


ARCHITECTURES = {
    "llama": Architecture("llama", rows_permuted=True),
    "mistral": Architecture("mistral"),
    "qwen2": Architecture("qwen2"),
    # QK norm; its head size is not the hidden size over the heads (Qwen3-0.6B: 1024 / 16 vs 128)
    "qwen3": Architecture("qwen3", layer_vectors={**LLAMA_VECTORS, **QK_NORMS},
                          config_keys={"attention.key_length": "head_dim"}),
    "phi3": Architecture("phi3", layer_matrices=FUSED_MATRICES),
}
