#!/usr/bin/env python3
"""Decode-core costs on a GPU with random-weight models of real shapes (timings do not depend
on weight values, and nothing downloads on a lent GPU machine):

- plain decoding tokens/s: transformers `generate` against specdraft's plain path (static
  cache + CUDA graphs, and the eager dynamic-cache path), against the memory-bandwidth limit
  (weight bytes / bandwidth);
- the target's verify cost at K+1 = 1..16 tokens against one token, as a chain and as a token
  tree of two branches (its attention mask an input of the tree size's own graph);
- each drafter's one-token step against the target's step;
- speedups *simulated* from those costs and per-position acceptance rates measured on real
  models elsewhere (`--acceptance`, default: the Qwen2.5-Coder 0.5B -> 1.5B pair on the
  held-out code/math prompts, measured on the CPU), labelled as simulated.

    python benchmarks/gpu_costs.py [--shapes llama8b|tiny] [--bandwidth BYTES_PER_S] [--json out.json]

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
    # The demo target (SmolLM2-135M: what `specdraft bench --pool profiles/demo-wide.toml` runs)
    # and a 2-layer view of it, as cheap as a self-drafter's first layers.
    "smollm2": {
        "target": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
        "drafter-2-layers": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
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
    parser.add_argument("--bandwidth", type=float,
                        help="memory bandwidth, bytes/s (default: the card's datasheet figure, H100 SXM 3.35e12, H200 4.8e12)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--acceptance", default=DEFAULT_ACCEPTANCE,
                        help="share of rounds whose draft position j = 1, 2, ... was accepted (comma-separated)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"shapes {args.shapes}", file=sys.stderr)

    if args.bandwidth is None:
        args.bandwidth = datasheet_bandwidth(torch.cuda.get_device_name() if device.type == "cuda" else "")
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
    print("\n| target verify width | chain ms | vs one token | two-branch tree ms | vs one token |")
    print("|---|---|---|---|---|")
    for width, seconds in step["target"].items():
        tree = step["target-tree"].get(width)
        tree_cells = f"{tree * 1e3:.2f} | {tree / one:.2f}x" if tree else "- | -"
        print(f"| {width} | {seconds * 1e3:.2f} | {seconds / one:.2f}x | {tree_cells} |")
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
        # The same model through the decode engine's rounds (a plain round each: the policy,
        # the verify's bookkeeping and stop checks around one forward): the host's share.
        engine = plain_engine(lm, int(model.config.vocab_size), tokens)
        for _ in range(2):
            start = clock()
            produced = sum(len(r.tokens) for r in engine.generate(prompt[0].tolist()))
            rates[name + ", engine rounds"] = produced / (clock() - start)
    return rates


def plain_engine(lm, vocab: int, tokens: int):
    from specdraft.core.sampling import SamplingParams
    from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
    from specdraft.drafters import DraftContext
    from specdraft.drafters.none import PlainDecoding
    from specdraft.learning.policies import build_policy

    ctx = DraftContext(SamplingParams(), None, lm.device, vocab)
    policy = build_policy("fixed", {}, ["none"], seed=0, draft_tokens=1, horizon=tokens)
    return SpeculativeEngine(lm, [PlainDecoding(ctx)], policy, EngineSettings(1, tokens, SamplingParams()))


def step_costs(models: dict, device: torch.device, repeats: int) -> dict[str, dict[int, float]]:
    """Median seconds of a forward of w tokens after a 256-token prefix, over the static
    cache with CUDA graphs on a GPU (the decode core's fast path), eager elsewhere; for the
    target also a token tree of w rows (`target-tree`), rolled back the same way."""
    from specdraft.models.cached_lm import CachedLM

    costs = {}
    graphs = device.type == "cuda"
    for name, model in models.items():
        lm = CachedLM(model, static=graphs, graphs=graphs)
        lm.feed(torch.arange(3, 259, device=device) % 500, keep=1)
        widths = range(1, 17) if name == "target" else (1,)
        shapes = [(w, False) for w in widths] + ([(w, True) for w in widths if w >= 3] if name == "target" else [])
        samples: dict[tuple[int, bool], list[float]] = {shape: [] for shape in shapes}
        for rep in range(repeats + 2):  # two warm-ups: eager, then capture
            for width, tree in shapes:
                tokens = torch.full((width,), 5, device=device)
                start = lm.clock()
                if tree:
                    lm.feed_tree(tokens, two_branches(width))
                else:
                    lm.feed(tokens, keep=width)
                elapsed = lm.clock() - start
                lm.crop(256)
                if rep >= 2:
                    samples[(width, tree)].append(elapsed)
        costs[name] = {w: statistics.median(s) for (w, tree), s in samples.items() if not tree}
        if name == "target":
            costs["target-tree"] = {w: statistics.median(s) for (w, tree), s in samples.items() if tree}
    return costs


def two_branches(size: int) -> list[int]:
    """Parents of a `size`-row tree: the root, then two chains under it (as two drafters'
    proposals that disagree at their first token), the first one row longer when odd."""
    first = size // 2  # rows 1..first: the first chain; first + 1..size - 1: the second
    return [-1] + [0] + list(range(1, first)) + [0] + list(range(first + 1, size - 1))


def datasheet_bandwidth(name: str) -> float:
    """The card's memory bandwidth (bytes/s) from its datasheet, by name; 1e11 elsewhere (a CPU smoke run)."""
    for key, value in (("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L40S", 8.64e11)):
        if key in name:
            return value
    return 1e11


if __name__ == "__main__":
    main()
