"""llama.cpp as the oracle of a GGUF file's model: tiny random models of an architecture
written in float32 (gguf_models.py), quantized by llama.cpp's own quantizer (through
llama-cpp-python) to each format a downloaded file holds, and llama.cpp's logits on the same
file along its own greedy continuation, for specdraft's to be compared with.

llama.cpp runs here with a float32 KV cache: its default float16 cache rounds every key and
value, and since both engines quantize activations to 8 bits before each product (each its
own way), such a small difference upstream flips activation codes downstream and hides what
the comparison is for."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
from gguf_models import write_model

# GGML type numbers (ggml.h) of the formats a file's matrices come in
GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
              "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
# the quantizer's file type that makes each format (with `pure`: every matrix in it)
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0",
              "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0",
              "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
              "Q6_K": "MOSTLY_Q6_K", "IQ4_NL": "MOSTLY_IQ4_NL", "IQ4_XS": "MOSTLY_IQ4_XS"}
# the mixes llama.cpp makes by default (K_M: some matrices in a larger K format)
MIXES = {"Q4_K_M": "MOSTLY_Q4_K_M", "Q3_K_M": "MOSTLY_Q3_K_M", "Q5_K_M": "MOSTLY_Q5_K_M"}
PROMPT = [72, 101, 108, 108, 111, 32, 116, 104, 101]  # "Hello the" in the tiny byte-level vocabulary
ARCHITECTURES = ["llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3moe"]
SHAPES = {"qwen3": {"head_dim": 128},  # a head size other than hidden / heads, as real Qwen3 models have
          # six layers: five local ones with a sliding window shorter than the 33 positions compared, then a
          # global one on a rotary base of its own; the head tied to the embedding, as Gemma's is
          "gemma3": {"layers": 6, "window": 8, "rope_base": 1e6, "tied": True}}


def float_model(folder: Path, architecture: str, **shape) -> Path:
    """A tiny random float32 model of `architecture` (untied head, K-quant-sized widths)."""
    defaults = dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, tied=False)
    return write_model(folder / f"{architecture}-F32.gguf", architecture, "F32", **{**defaults, **shape})


def quantized(source: Path, format_name: str, pure: bool = True, output_only: bool = False) -> Path:
    """`source` quantized by llama.cpp to `format_name` (a format of GGML_TYPES, or a mix of
    MIXES): with `pure` every matrix in that format, else llama.cpp's own mix; `output_only`:
    only the output head, the rest kept float32."""
    import llama_cpp

    target = source.with_name(f"{source.stem}-{format_name}{'-output' if output_only else ''}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    if output_only:
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.output_tensor_type = GGML_TYPES[format_name]
    else:
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{MIXES.get(format_name) or FILE_TYPES[format_name]}")
        params.pure = pure
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    assert status == 0, f"llama.cpp could not quantize {source.name} to {format_name} ({status})"
    return target


def llama_cpp_logits(path: Path, new_tokens: int = 24, prompt: list[int] = PROMPT,
                     n_ctx: int = 128) -> tuple[list[int], torch.Tensor]:
    """llama.cpp's greedy continuation of `prompt` on `path` and its logits at every position
    ([len(tokens), V])."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False,
                          type_k=GGML_TYPES["F32"], type_v=GGML_TYPES["F32"])
    tokens = list(prompt)
    llm.eval(tokens)
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[len(tokens) - 1]))
        llm.eval([token])
        tokens.append(token)
    logits = torch.from_numpy(np.array(llm.scores[:len(tokens)], dtype=np.float32))
    llm.close()
    return tokens, logits


def decode_rows(model: torch.nn.Module, tokens: list[int], prompt: int) -> torch.Tensor:
    """specdraft's logits at every position of `tokens` ([len(tokens), V]), as generation runs:
    the first `prompt` tokens in one feed, then one token a step, on the lean forward."""
    from specdraft.models.cached_lm import CachedLM

    lm = CachedLM(model, lean=True)
    assert lm.lean is not None, "the lean forward does not run this model"
    rows = [lm.feed(torch.tensor(tokens[:prompt]), keep=0)]
    rows += [lm.feed(torch.tensor(tokens[i:i + 1])) for i in range(prompt, len(tokens))]
    return torch.cat(rows)


def relative(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((mine.double() - theirs.double()).norm() / theirs.double().norm())
