#!/usr/bin/env python3
"""How close specdraft's model of a GGUF file is to llama.cpp's on the same file: the next
token's agreement (top-1) and the logits' relative L2 distance along llama.cpp's own greedy
continuations (llama-cpp-python with `logits_all`, float32 KV cache; tests/llama_cpp_oracle.py).

Two parts, each optional:
- `--tiny`: the tiny random models of every mapped architecture (tests/gguf_models.py),
  quantized by llama.cpp to each format of `--formats`; per file its distance and agreement,
  and the agreement over all.
- `--real FILE ...`: real GGUF files, each continued greedily from six prompts for `--tokens`
  tokens (the tokenizer is the file's own).

    python benchmarks/oracle_agreement.py --tiny --real /work/models/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = ["def quicksort(arr):", "The capital of France is", "Once upon a time,",
           "Question: what is 17 times 23? Answer:", "import numpy as np\n\ndef moving_average(",
           "Rewrite in plain English: the meeting was postponed sine die."]
ARCHITECTURES = ["llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3moe"]
SHAPES = {"qwen3": {"head_dim": 128}, "gemma3": {"layers": 6, "window": 8, "rope_base": 1e6, "tied": True}}


def specdraft_rows(model, tokens: list[int], prompt: int):
    """specdraft's logits at every position: the prompt in one feed, then a token a step."""
    import torch

    from specdraft.models.cached_lm import CachedLM

    lm = CachedLM(model, lean=True)
    rows = [lm.feed(torch.tensor(tokens[:prompt]), keep=0)]
    rows += [lm.feed(torch.tensor(tokens[i:i + 1])) for i in range(prompt, len(tokens))]
    return torch.cat(rows)


def tiny(formats: list[str]) -> None:
    from llama_cpp_oracle import float_model, llama_cpp_logits, quantized, relative

    from specdraft.models.gguf_loading import load_gguf_mapped

    same = total = 0
    with tempfile.TemporaryDirectory() as folder:
        os.environ["SPECDRAFT_CACHE_DIR"] = str(Path(folder) / "cache")
        for architecture in ARCHITECTURES:
            source = float_model(Path(folder), architecture, **SHAPES.get(architecture, {}))
            for format_name in formats:
                path = quantized(source, format_name)
                tokens, theirs = llama_cpp_logits(path)
                _, model = load_gguf_mapped(path, "p.toml", "target")
                mine = specdraft_rows(model, tokens, 9)
                agree = int((mine.argmax(-1) == theirs.argmax(-1)).sum())
                same, total = same + agree, total + len(theirs)
                print(f"{architecture:9s} {format_name:7s} distance {relative(mine, theirs):.4f} "
                      f"top-1 {agree}/{len(theirs)}", flush=True)
    print(f"tiny models: top-1 {same}/{total} = {same / total:.1%}")


def real(path: Path, new_tokens: int) -> None:
    from llama_cpp_oracle import llama_cpp_logits, relative

    from specdraft.models.gguf_loading import load_gguf_mapped

    tokenizer, model = load_gguf_mapped(path, "p.toml", "target")
    same = total = 0
    for text in PROMPTS:
        prompt = tokenizer(text).input_ids
        tokens, theirs = llama_cpp_logits(path, new_tokens, prompt, n_ctx=len(prompt) + new_tokens + 8)
        mine = specdraft_rows(model, tokens, len(prompt))
        at = slice(len(prompt) - 1, None)  # the positions whose next token was generated
        agree = int((mine.argmax(-1)[at] == theirs.argmax(-1)[at]).sum())
        count = len(tokens) - len(prompt) + 1
        same, total = same + agree, total + count
        print(f"{path.name}: {text[:30]!r:34s} distance {relative(mine[at], theirs[at]):.4f} top-1 {agree}/{count}",
              flush=True)
    print(f"{path.name}: top-1 {same}/{total} = {same / total:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--formats", default="Q4_0,Q4_K,Q6_K,Q8_0")
    parser.add_argument("--real", nargs="*", default=[], type=Path)
    parser.add_argument("--tokens", type=int, default=170)
    args = parser.parse_args()
    if args.tiny:
        tiny(args.formats.split(","))
    for path in args.real:
        real(path, args.tokens)


if __name__ == "__main__":
    main()
