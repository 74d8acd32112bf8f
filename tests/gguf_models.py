"""Tiny random models written as GGUF files in a real architecture's layout (the `gguf`
package writes them): what the loader, the kernels and llama.cpp are checked on. A byte-level
BPE tokenizer (GPT-2's byte alphabet and a few merges) makes them loadable by transformers
and llama.cpp alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np

K_TYPES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "Q3_K": (110, (108,)),
           "Q2_K": (84, (80, 82))}
MERGES = ["Ġ t", "h e", "i n", "Ġt he", "e r", "o n", "Ġ a", "r e", "a t", "e n"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tokens() -> list[str]:
    merged = [left + right for left, right in (m.split(" ") for m in MERGES)]
    return byte_alphabet() + merged + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def weights_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks [rows, bytes a row] of a random matrix in `type_name`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name in K_TYPES:
        size, halves = K_TYPES[type_name]
        raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for at in halves:
            scale = np.float16(0.002 + rng.random((rows, cols // 256)) * 0.004)
            raw[..., at:at + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
        return raw.reshape(rows, -1)
    weight = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
    return quantize(weight, GGMLQuantizationType[type_name]).reshape(rows, -1)


def write_model(path: Path, architecture: str = "llama", type_name: str = "Q4_0", hidden: int = 256,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 512, tied: bool = True,
                seed: int = 0, types: dict[str, str] | None = None, states_vocab_size: bool = False,
                claims: dict[str, int] | None = None, nan_in: str | None = None, head_dim: int | None = None,
                rope_factors: np.ndarray | None = None, window: int = 8, rope_base: float = 10000.0,
                layout: str | None = None, experts: tuple[int, int] = (8, 2), head_scale: float = 1.0) -> Path:
    """A tiny random model of `architecture` (llama, mistral; qwen2: with query/key/value
    biases; qwen3: a QK norm, and `head_dim` other than hidden / heads; phi3: fused query/key/
    value and gate/up matrices; gemma3: a QK norm, post-norms, GeGLU, sliding `window`s) whose
    matrices are in `type_name` (or `types[name]` for a tensor name such as "output");
    `tied`: no output.weight, the head is the embedding; `states_vocab_size`: the header
    holds `<architecture>.vocab_size` (real files mostly do; otherwise readers count tokens);
    `claims`: header numbers ("block_count", "head_count_kv", "embedding_length") that disagree with the
    tensors written; `nan_in`: a float32 vector's name whose values are all NaN; `rope_factors`:
    Llama 3's `rope_freqs.weight`, a factor per rotary frequency; `layout`: the architecture
    whose tensors are written (default `architecture`: another makes a mislabelled file);
    `experts`: a qwen3moe model's experts per layer and experts each token runs (each expert's
    MLP `ffn` wide; the router a float32 matrix, as llama.cpp keeps it); `head_scale`: a float
    output head's weights multiplied by it (a sharper next-token distribution than a random
    model's, whose near-ties make top-1 comparisons coin flips)."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab = tokens()
    writer = gguf.GGUFWriter(str(path), architecture)
    # (llama.cpp sets attributes of Phi-3's own special tokens in a model named "phi3")
    writer.add_name(f"tiny {architecture}" if architecture != "phi3" else "tiny fused-projection model")
    claims = claims or {}
    writer.add_block_count(claims.get("block_count", layers))
    writer.add_context_length(512)
    writer.add_embedding_length(claims.get("embedding_length", hidden))
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(claims.get("head_count_kv", kv_heads))
    writer.add_rope_freq_base(rope_base)
    if architecture == "gemma3":  # (llama.cpp: every sixth layer global, the others this window)
        writer.add_sliding_window(window)
    if architecture == "qwen3moe":
        writer.add_expert_count(experts[0])
        writer.add_expert_used_count(experts[1])
        writer.add_expert_feed_forward_length(ffn)
    writer.add_layer_norm_rms_eps(1e-6)
    if states_vocab_size:
        writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * (len(vocab) - 3) + [3, 3, 3])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(len(vocab) - 3)
    writer.add_eos_token_id(len(vocab) - 1)
    layout = layout or architecture
    head_dim = head_dim or hidden // heads
    if head_dim != hidden // heads or architecture == "gemma3":  # (Gemma 3's config defaults to 256)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    def matrix(name: str, rows: int, cols: int) -> None:
        kind = (types or {}).get(name.split(".")[-2] if name.startswith("blk") else name.split(".")[0], type_name)
        if kind in ("F32", "F16"):
            scale = 0.08 * (head_scale if name == "output.weight" else 1.0)
            values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32 if kind == "F32" else np.float16)
            writer.add_tensor(name, values)
            return
        writer.add_tensor(name, weights_blocks(kind, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])

    def stacked(name: str, rows: int, cols: int) -> None:  # [experts, rows, cols], expert outermost
        kind = (types or {}).get(name.split(".")[-2], type_name)
        if kind in ("F32", "F16"):
            values = rng.standard_normal((experts[0], rows, cols)) * 0.08
            writer.add_tensor(name, values.astype(np.float32 if kind == "F32" else np.float16))
            return
        raw = np.stack([weights_blocks(kind, rows, cols, rng) for _ in range(experts[0])])
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])

    def vector(name: str, size: int, around: float) -> None:
        values = (around + rng.standard_normal(size) * 0.05).astype(np.float32)
        writer.add_tensor(name, np.full(size, np.nan, np.float32) if name == nan_in else values)

    matrix("token_embd.weight", len(vocab), hidden)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_factors, dtype=np.float32))
    for i in range(layers):
        vector(f"blk.{i}.attn_norm.weight", hidden, 1.0)
        if layout == "gemma3":
            vector(f"blk.{i}.post_attention_norm.weight", hidden, 1.0)
            vector(f"blk.{i}.post_ffw_norm.weight", hidden, 1.0)
        if layout == "phi3":  # queries, keys and values in one matrix; gate and up in another
            matrix(f"blk.{i}.attn_qkv.weight", (heads + 2 * kv_heads) * head_dim, hidden)
        else:
            matrix(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
            matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
            matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        if layout in ("qwen3", "gemma3", "qwen3moe"):
            vector(f"blk.{i}.attn_q_norm.weight", head_dim, 1.0)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim, 1.0)
        if layout == "qwen2":
            vector(f"blk.{i}.attn_q.bias", heads * head_dim, 0.0)
            vector(f"blk.{i}.attn_k.bias", kv_heads * head_dim, 0.0)
            vector(f"blk.{i}.attn_v.bias", kv_heads * head_dim, 0.0)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        vector(f"blk.{i}.ffn_norm.weight", hidden, 1.0)
        if layout == "phi3":
            matrix(f"blk.{i}.ffn_up.weight", 2 * ffn, hidden)
        elif layout == "qwen3moe":  # a router, then each kind of expert matrix stacked
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                              (rng.standard_normal((experts[0], hidden)) * 0.5).astype(np.float32))
            stacked(f"blk.{i}.ffn_gate_exps.weight", ffn, hidden)
            stacked(f"blk.{i}.ffn_up_exps.weight", ffn, hidden)
            stacked(f"blk.{i}.ffn_down_exps.weight", hidden, ffn)
            continue
        else:
            matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
            matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    vector("output_norm.weight", hidden, 1.0)
    if not tied:
        matrix("output.weight", len(vocab), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
