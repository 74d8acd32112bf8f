"""Tokens/s of plain decoding vs specdraft with each drafter fixed, on the demo model.

Runs every configuration on every prompt, interleaved (round-robin over configurations,
repeated), so machine drift hits all alike; reports medians, mean accepted tokens, the
share of wall time spent outside model forwards, and whether the greedy text matched
plain decoding. Usage:

    python benchmarks/generate_speed.py [--pool profiles/demo.toml] [--repeat 3] [-n 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specdraft.commands.io import quiet_libraries  # noqa: E402
from specdraft.models.loading import load_model  # noqa: E402
from specdraft.config.profile import load_profile  # noqa: E402
from specdraft.runtime import build_runtime  # noqa: E402
from specdraft.session.prompt_run import PromptRun  # noqa: E402

PARAGRAPH = (
    "The city council met on Tuesday evening to discuss the proposed changes to the public library's "
    "opening hours. After a long debate, members agreed to keep the main branch open until nine o'clock "
    "on weekdays, while the two smaller branches will close at six. The council also approved a modest "
    "increase in the budget for children's books and asked the library director to report back in March."
)
PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring and an example.",
    "rewrite": "Rewrite the following paragraph in plain, formal English, keeping every fact:\n\n" + PARAGRAPH,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="profiles/demo.toml")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", help="write all measurements here")
    args = parser.parse_args()
    quiet_libraries(False)
    torch.set_grad_enabled(False)

    profile = load_profile(args.pool).with_overrides(max_new_tokens=args.max_new_tokens, temperature=0.0)
    target = load_model(profile.target, str(profile.file), "target")
    configs = {"plain (transformers generate)": None, "plain (specdraft, no drafts)": "plain"}
    configs |= {f"fixed:{d.name}": f"fixed:{d.name}" for d in profile.drafters}
    runtimes = {
        name: build_runtime(profile, target, plain=True) if spec == "plain"
        else build_runtime(profile.with_overrides(policy=spec), target) if spec else None
        for name, spec in configs.items()
    }
    print(f"device {next(target.model.parameters()).device}, torch threads {torch.get_num_threads()}, "
          f"{args.max_new_tokens} new tokens, {args.repeat} interleaved repeats", file=sys.stderr)

    rows: dict[tuple[str, str], list[dict]] = {}
    reference: dict[str, list[int]] = {}
    for rep in range(args.repeat + 1):  # repeat 0 is warm-up, not recorded
        for task, prompt in PROMPTS.items():
            for name, runtime in runtimes.items():
                sample = run_once(target, runtime, prompt, args.max_new_tokens, profile)
                if runtime is None:
                    reference[task] = sample.pop("ids")
                else:
                    sample["matches_plain"] = sample.pop("ids") == reference[task]
                if rep > 0:
                    rows.setdefault((task, name), []).append(sample)

    print("\n| prompt | configuration | tokens/s (median) | speedup vs transformers plain | mean accepted | outside forwards | greedy text = plain |")
    print("|---|---|---|---|---|---|---|")
    summary = []
    for task in PROMPTS:
        base = statistics.median(s["tokens_per_s"] for s in rows[(task, "plain (transformers generate)")])
        for name in configs:
            samples = rows[(task, name)]
            tps = statistics.median(s["tokens_per_s"] for s in samples)
            mat = statistics.median(s.get("mean_accepted", 1.0) for s in samples)
            outside = statistics.median(s.get("outside_forwards", float("nan")) for s in samples)
            match = all(s.get("matches_plain", True) for s in samples)
            summary.append({"task": task, "config": name, "tokens_per_s": tps, "speedup": tps / base,
                            "mean_accepted": mat, "outside_forwards": outside, "matches_plain": match})
            print(f"| {task} | {name} | {tps:.1f} | {tps / base:.2f}x | {mat:.2f} | "
                  f"{'-' if outside != outside else f'{outside:.1%}'} | {'yes' if match else 'NO'} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "samples": {f"{t}|{c}": v for (t, c), v in rows.items()}}, fh, indent=1)


def run_once(target, runtime, prompt: str, max_new: int, profile) -> dict:
    if runtime is None:
        from specdraft.session.prompt_run import prompt_token_ids

        ids = prompt_token_ids(target.tokenizer, prompt, None)
        start = time.perf_counter()
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
        elapsed = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        return {"tokens_per_s": len(new) / elapsed, "tokens": len(new), "ids": new}
    lms = [runtime.engine.target] + [d.lm for d in runtime.drafters if hasattr(d, "lm")]
    for lm in lms:
        lm.timed = True
    before = sum(lm.forward_seconds for lm in lms)
    run = PromptRun(runtime, prompt, None)
    start = time.perf_counter()
    run.run()
    elapsed = time.perf_counter() - start
    in_forwards = sum(lm.forward_seconds for lm in lms) - before
    return {
        "tokens_per_s": run.stats.tokens / elapsed,
        "tokens": run.stats.tokens,
        "mean_accepted": run.stats.mean_accepted,
        "outside_forwards": 1 - in_forwards / elapsed,
        "ids": run.detokenizer.ids,
    }


if __name__ == "__main__":
    main()
