#!/usr/bin/env python3
"""Decode-core costs on a GPU with random-weight models of real shapes (timings do not depend
on weight values, and nothing downloads on a lent GPU machine):

- plain decoding tokens/s: transformers `generate` against specdraft's plain path (static
  cache + CUDA graphs, and the eager dynamic-cache path), against the memory-bandwidth limit
  (weight bytes / bandwidth);
- the target's verify cost at K+1 = 1..9 tokens against one token;
- each drafter's one-token step against the target's step;
- speedups *simulated* from those costs and per-position acceptance rates measured on real
  models elsewhere (`--acceptance`, default: the Qwen2.5-Coder 0.5B -> 1.5B pair on the
  held-out code/math prompts, measured on the CPU), labelled as simulated.

    python benchmarks/gpu_costs.py [--shapes llama8b|tiny] [--bandwidth 3.35e12] [--json out.json]

`--shapes tiny` runs the same code on small shapes (a smoke test, also on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

SHAPES = {
    # Llama-3.1-8B target; Llama-3.2-1B-shaped drafter; a 68M-class body (2 layers, 768 wide)
    # over the same 128k vocabulary, since a drafter must share the target's tokenizer.
    "llama8b": {
        "target": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256),
        "drafter-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
        "drafter-68m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                            num_key_value_heads=12, vocab_size=128256, tie_word_embeddings=True),
    },
    "tiny": {
        "target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512),
        "drafter-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512),
        "drafter-68m": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512),
    },
}
# Share of rounds whose draft position j = 1..4 was accepted (fixed K = 4), measured here with
# `specdraft bench --pool benchmarks/qwen-quant.toml --data benchmarks/data/head-eval.jsonl
# --limit 6 -n 64` (Qwen2.5-Coder 0.5B float32 drafting for the 1.5B, greedy).
DEFAULT_ACCEPTANCE = "0.84,0.81,0.76,0.68"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM: 3.35e12)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--acceptance", default=DEFAULT_ACCEPTANCE,
                        help="share of rounds whose draft position j = 1, 2, ... was accepted (comma-separated)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"shapes {args.shapes}", file=sys.stderr)

    models = {name: random_llama(shape, dtype, device) for name, shape in SHAPES[args.shapes].items()}
    target = models["target"]
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    report: dict = {"device": str(device), "dtype": str(dtype), "shapes": args.shapes,
                    "target_weight_bytes": weight_bytes}

    limit = args.bandwidth / weight_bytes
    plain = plain_rates(target, device, args.tokens)
    print("\n| plain decoding | tokens/s | share of the bandwidth limit |")
    print("|---|---|---|")
    print(f"| bandwidth limit ({weight_bytes / 1e9:.2f} GB at {args.bandwidth / 1e12:.2f} TB/s) | {limit:.1f} | 100% |")
    for name, rate in plain.items():
        print(f"| {name} | {rate:.1f} | {rate / limit:.0%} |")
    report["plain_tokens_per_s"] = plain | {"bandwidth_limit": limit}

    step = step_costs(models, device, args.repeats)
    one = step["target"][1]
    print("\n| target verify width | ms | vs one token |")
    print("|---|---|---|")
    for width, seconds in step["target"].items():
        print(f"| {width} | {seconds * 1e3:.2f} | {seconds / one:.2f}x |")
    print("\n| drafter | one-token step ms | vs target step |")
    print("|---|---|---|")
    for name in models:
        if name != "target":
            print(f"| {name} | {step[name][1] * 1e3:.2f} | {step[name][1] / one:.1%} |")
    report["step_seconds"] = step

    cumulative = [float(a) for a in args.acceptance.split(",")]
    print("\n| drafter | K | simulated tokens per round | simulated speedup over plain |")
    print("|---|---|---|---|")
    simulated = {}
    for name in models:
        if name == "target":
            continue
        for k in range(1, min(len(cumulative), max(step["target"]) - 1) + 1):
            expected = 1 + sum(cumulative[:k])  # E[accepted] + the target's own token
            seconds = k * step[name][1] + step["target"][k + 1]
            speedup = expected / seconds * one
            simulated[f"{name}|{k}"] = speedup
            print(f"| {name} | {k} | {expected:.2f} | {speedup:.2f}x (simulated) |")
    report["simulated_speedup"] = simulated
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


def random_llama(shape: dict, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=8192, **shape)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def plain_rates(model: torch.nn.Module, device: torch.device, tokens: int) -> dict[str, float]:
    from specdraft.core.stopwatch import device_clock
    from specdraft.models.cached_lm import CachedLM

    clock = device_clock(device)
    prompt = torch.arange(3, 35, device=device).view(1, -1)
    rates = {}
    for _ in range(2):  # the first pass warms up (and captures graphs); the second is timed
        start = clock()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=0)
        rates["transformers generate"] = tokens / (clock() - start)
    variants = {"specdraft plain, dynamic cache": dict(static=False, graphs=False),
                "specdraft plain, static cache": dict(static=True, graphs=False)}
    if device.type == "cuda":
        variants["specdraft plain, static cache + CUDA graphs"] = dict(static=True, graphs=True)
    for name, options in variants.items():
        lm = CachedLM(model, **options)
        for _ in range(2):
            lm.reset()
            start = clock()
            logits = lm.feed(prompt[0], keep=1)
            for _ in range(tokens):
                logits = lm.feed(logits.argmax(-1), keep=1)
            rates[name] = tokens / (clock() - start)
    return rates


def step_costs(models: dict, device: torch.device, repeats: int) -> dict[str, dict[int, float]]:
    """Median seconds of a forward of w tokens after a 256-token prefix, over the static
    cache with CUDA graphs on a GPU (the decode core's fast path), eager elsewhere."""
    from specdraft.models.cached_lm import CachedLM

    costs = {}
    graphs = device.type == "cuda"
    for name, model in models.items():
        lm = CachedLM(model, static=graphs, graphs=graphs)
        lm.feed(torch.arange(3, 259, device=device) % 500, keep=1)
        widths = range(1, 10) if name == "target" else (1,)
        samples: dict[int, list[float]] = {w: [] for w in widths}
        for rep in range(repeats + 2):  # two warm-ups: eager, then capture
            for width in widths:
                start = lm.clock()
                lm.feed(torch.full((width,), 5, device=device), keep=width)
                elapsed = lm.clock() - start
                lm.crop(256)
                if rep >= 2:
                    samples[width].append(elapsed)
        costs[name] = {w: statistics.median(s) for w, s in samples.items()}
    return costs


if __name__ == "__main__":
    main()
