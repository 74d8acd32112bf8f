#!/usr/bin/env python3
"""How close specdraft's model of a GGUF file is to llama.cpp's on the same file: the next
token's agreement (top-1) and the logits' relative L2 distance along llama.cpp's own greedy
continuations (llama-cpp-python with `logits_all`, float32 KV cache; tests/llama_cpp_oracle.py).

Two parts, each optional:
- `--tiny`: the tiny random models of every mapped architecture (tests/gguf_models.py),
  quantized by llama.cpp to each format of `--formats`; per file its distance and agreement,
  and the agreement over all.
- `--real FILE ...`: real GGUF files, each continued greedily from six prompts for `--tokens`
  tokens (the tokenizer is the file's own). With `--nudge`, also specdraft against itself with
  its first layer's input norm weights scaled by 1 + 2^-22 (a couple of float32 ulps): how far
  a rounding-sized difference upstream moves this model's logits and next tokens, the floor
  that any engine not identical to llama.cpp in every float operation meets.

    python benchmarks/oracle_agreement.py --tiny --real /work/models/gemma-3-270m-q4_k_m.gguf --nudge
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


def tiny(formats: list[str]) -> None:
    from llama_cpp_oracle import ARCHITECTURES, SHAPES, decode_rows, float_model, llama_cpp_logits, quantized, relative

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
                mine = decode_rows(model, tokens, 9)
                agree = int((mine.argmax(-1) == theirs.argmax(-1)).sum())
                same, total = same + agree, total + len(theirs)
                print(f"{architecture:9s} {format_name:7s} distance {relative(mine, theirs):.4f} "
                      f"top-1 {agree}/{len(theirs)}", flush=True)
    print(f"tiny models: top-1 {same}/{total} = {same / total:.1%}")


def nudged_rows(model, tokens: list[int], prompt: int):
    """decode_rows with the first layer's input norm weights scaled by 1 + 2^-22."""
    import torch
    from llama_cpp_oracle import decode_rows

    from specdraft.models.cached_lm import CachedLM

    weight = CachedLM(model, lean=True).lean.layers[0].norm1.weight  # (what the kernels read)
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1 + 2 ** -22)
    try:
        return decode_rows(model, tokens, prompt)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def real(path: Path, new_tokens: int, nudge: bool) -> None:
    from llama_cpp_oracle import decode_rows, llama_cpp_logits, relative

    from specdraft.models.gguf_loading import load_gguf_mapped

    tokenizer, model = load_gguf_mapped(path, "p.toml", "target")
    same = itself = total = 0
    for text in PROMPTS:
        prompt = tokenizer(text).input_ids
        tokens, theirs = llama_cpp_logits(path, new_tokens, prompt, n_ctx=len(prompt) + new_tokens + 8)
        mine = decode_rows(model, tokens, len(prompt))
        at = slice(len(prompt) - 1, None)  # the positions whose next token was generated
        agree = int((mine.argmax(-1)[at] == theirs.argmax(-1)[at]).sum())
        count = len(tokens) - len(prompt) + 1
        same, total = same + agree, total + count
        line = f"{path.name}: {text[:30]!r:34s} distance {relative(mine[at], theirs[at]):.4f} top-1 {agree}/{count}"
        if nudge:
            moved = nudged_rows(model, tokens, len(prompt))
            kept = int((mine.argmax(-1)[at] == moved.argmax(-1)[at]).sum())
            itself += kept
            line += f"; nudged itself: distance {relative(mine[at], moved[at]):.4f} top-1 {kept}/{count}"
        print(line, flush=True)
    print(f"{path.name}: top-1 {same}/{total} = {same / total:.1%}"
          + (f"; against itself nudged {itself}/{total} = {itself / total:.1%}" if nudge else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--formats", default="Q4_0,Q4_K,Q6_K,Q8_0")
    parser.add_argument("--real", nargs="*", default=[], type=Path)
    parser.add_argument("--tokens", type=int, default=170)
    parser.add_argument("--nudge", action="store_true", help="also specdraft against itself nudged (docstring)")
    args = parser.parse_args()
    if args.tiny:
        tiny(args.formats.split(","))
    for path in args.real:
        real(path, args.tokens, args.nudge)


if __name__ == "__main__":
    main()
