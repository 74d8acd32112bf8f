#!/usr/bin/env python3
"""The demo target in float32 against bfloat16 on this machine: plain decoding (transformers
`generate` and specdraft's own plain path), specdraft with the profile's policy, and the
target's forward cost at 1..9 tokens, all interleaved (rounds of prompts x dtypes x
configurations), medians reported.

Greedy output is checked per dtype (each configuration against transformers' plain decoding
in the same dtype); across dtypes the script reports where float32 and bfloat16 first part
(near-tie flips of the argmax, not errors).

    python benchmarks/dtype_speed.py [--pool profiles/demo.toml] [--data benchmarks/data/heldout.jsonl]
        [--limit 4] [-n 64] [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specdraft.profile import load_profile  # noqa: E402
from specdraft.measurement.datasets import load_dataset  # noqa: E402
from specdraft.models.cached_lm import CachedLM  # noqa: E402
from specdraft.models.loading import load_model  # noqa: E402
from specdraft.models.quiet import quiet_environment  # noqa: E402
from specdraft.runtime import build_runtime  # noqa: E402
from specdraft.session.prompt_ids import prompt_token_ids  # noqa: E402
from specdraft.session.prompt_run import PromptRun  # noqa: E402

WIDTHS = (1, 2, 3, 5, 7, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="profiles/demo.toml")
    parser.add_argument("--data", default="benchmarks/data/heldout.jsonl")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    quiet_environment()
    torch.set_grad_enabled(False)

    base = load_profile(args.pool).with_overrides(max_new_tokens=args.max_new_tokens, temperature=0.0)
    examples = load_dataset(args.data, lambda m: print(m, file=sys.stderr), limit=args.limit)
    dtypes = args.dtypes.split(",")
    setups = {}
    for dtype in dtypes:
        profile = dataclasses.replace(base, target=dataclasses.replace(base.target, dtype=dtype))
        target = load_model(profile.target, str(profile.file), "target")
        setups[dtype] = {
            "target": target,
            "specdraft plain": build_runtime(profile, target, plain=True),
            f"specdraft {profile.policy.name}": build_runtime(profile, target),
        }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {len(examples)} prompts x {args.max_new_tokens} tokens, "
          f"{args.repeat} interleaved repeats", file=sys.stderr)

    forward = {(d, w): [] for d in dtypes for w in WIDTHS}
    rows: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str, str], list[int]] = {}
    for rep in range(args.repeat + 1):  # repeat 0 warms up and is not recorded
        for dtype in dtypes:
            for width, seconds in forward_seconds(setups[dtype]["target"].model).items():
                if rep:
                    forward[(dtype, width)].append(seconds)
        for example in examples:
            for dtype in dtypes:
                setup = setups[dtype]
                for name in ["transformers plain", *[k for k in setup if k.startswith("specdraft")]]:
                    ids, seconds = run_once(setup, name, example.prompt, args.max_new_tokens)
                    outputs.setdefault((dtype, name, example.id), ids)
                    if rep:
                        rows.setdefault((dtype, name), []).append(len(ids) / seconds)

    reference = dtypes[0]
    print("\nforward cost of the target (median ms; ratio to one token):\n")
    print("| tokens | " + " | ".join(dtypes) + " |")
    print("|---|" + "---|" * len(dtypes))
    for width in WIDTHS:
        cells = []
        for dtype in dtypes:
            ms = statistics.median(forward[(dtype, width)]) * 1e3
            one = statistics.median(forward[(dtype, 1)]) * 1e3
            cells.append(f"{ms:.1f} ({ms / one:.2f}x)")
        print(f"| {width} | " + " | ".join(cells) + " |")

    print(f"\ntokens/s (median over prompts and repeats; ratio to {reference} specdraft plain):\n")
    print("| dtype | configuration | tokens/s | ratio | greedy = transformers plain, same dtype |")
    print("|---|---|---|---|---|")
    unit = statistics.median(rows[(reference, "specdraft plain")])
    summary = []
    for (dtype, name), speeds in rows.items():
        tps = statistics.median(speeds)
        same = all(outputs[(dtype, name, e.id)] == outputs[(dtype, "transformers plain", e.id)] for e in examples)
        summary.append({"dtype": dtype, "config": name, "tokens_per_s": tps, "ratio": tps / unit, "greedy_equal": same})
        print(f"| {dtype} | {name} | {tps:.1f} | {tps / unit:.2f}x | {'yes' if same else 'NO'} |")

    print(f"\nwhere each configuration parts from transformers' plain decoding in its dtype (token index, "
          f"of {args.max_new_tokens}; float32 should never part):")
    for (dtype, name) in rows:
        if name != "transformers plain":
            parts = [first_difference(outputs[(dtype, "transformers plain", e.id)], outputs[(dtype, name, e.id)])
                     for e in examples]
            print(f"  {dtype} {name}: " + ", ".join("same" if p is None else str(p) for p in parts))
    print(f"\nwhere the dtypes' greedy outputs part (token index, of {args.max_new_tokens}):")
    for other in dtypes[1:]:
        parts = [first_difference(outputs[(reference, "transformers plain", e.id)],
                                  outputs[(other, "transformers plain", e.id)]) for e in examples]
        print(f"  {reference} vs {other}: " + ", ".join("same" if p is None else str(p) for p in parts))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "forward_ms": {f"{d}|{w}": v for (d, w), v in forward.items()}}, fh, indent=1)


def run_once(setup: dict, name: str, prompt: str, max_new: int) -> tuple[list[int], float]:
    target = setup["target"]
    if name == "transformers plain":
        ids = prompt_token_ids(target.tokenizer, prompt, None)
        start = time.perf_counter()
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id)
        elapsed = time.perf_counter() - start
        return out[0, len(ids):].tolist(), elapsed
    run = PromptRun(setup[name], prompt, None)
    start = time.perf_counter()
    run.run()
    return run.detokenizer.ids, time.perf_counter() - start


def forward_seconds(model: torch.nn.Module, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one forward of w tokens after a 64-token prefix, per width."""
    lm = CachedLM(model)
    lm.feed(torch.arange(3, 67) % 100, keep=1)
    samples: dict[int, list[float]] = {w: [] for w in WIDTHS}
    for _ in range(repeats):
        for width in WIDTHS:
            start = lm.clock()
            lm.feed(torch.full((width,), 5), keep=width)
            samples[width].append(lm.clock() - start)
            lm.crop(64)
    return {w: statistics.median(s) for w, s in samples.items()}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


if __name__ == "__main__":
    main()
