"""Policies on a mixed stream: input-grounded rewrites (prompt lookup should win) and open
generation (a self-drafter should win), on the demo model with two self-drafter depths.

For every prompt and configuration: mean accepted tokens, tokens/s, the hindsight-best
drafter (in the policy's objective: expected accepted length, HedgeSpec Theorem 3, or
tokens per second under goodput) and its margin over the
runner-up, the share of rounds after the first 10 that used it, regret, and the wall-time
shares of full-information evaluation and of the policy step. Configurations run
interleaved. Usage:

    python benchmarks/policy_mix.py [--pool profiles/demo-wide.toml] [-n 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specdraft.commands.io import quiet_libraries  # noqa: E402
from specdraft.models.loading import load_model  # noqa: E402
from specdraft.config.profile import load_profile  # noqa: E402
from specdraft.runtime import build_runtime  # noqa: E402
from specdraft.session.prompt_run import PromptRun  # noqa: E402

TEXT_A = ("The city council met on Tuesday evening to discuss the proposed changes to the public library's opening "
          "hours. After a long debate, members agreed to keep the main branch open until nine o'clock on weekdays, "
          "while the two smaller branches will close at six. The council also approved a modest increase in the "
          "budget for children's books, asked the library director to report back in March on visitor numbers, and "
          "thanked the volunteers who run the Saturday reading club for young children and their parents.")
TEXT_B = ("Our team shipped the new billing service in March. It replaced three older scripts, cut the monthly "
          "invoice run from six hours to forty minutes, and removed the manual checks that the finance group used "
          "to do every Friday. Customers now receive their invoices on the first day of the month, and the support "
          "team reports fewer questions about late or duplicated charges. Next quarter we plan to add refunds.")
PROMPTS = {
    "rewrite-library": "Rewrite the following text in formal English, keeping every fact:\n\n" + TEXT_A,
    "open-story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "rewrite-billing": "Repeat the following text, correcting any grammar mistakes:\n\n" + TEXT_B,
    "open-explain": "Explain to a ten-year-old how rain forms.",
}
CONFIGS = {
    "normalhedge": "normalhedge",
    "ucb": "ucb",
    "normalhedge cost-aware": "normalhedge+cost",
    "ucb cost-aware": "ucb+cost",
    "normalhedge cost-aware, update_every=4": "normalhedge+cost+skip",
    "ucb cost-aware (evaluate=chosen)": "ucb+cost+chosen",
}


def policy_for(profile, spec: str):
    flag, *extras = spec.split("+")
    overridden = profile.with_overrides(policy=flag)
    name = overridden.policy.name
    options = dict(overridden.policy.options) | {"evaluate": "all"}
    if "cost" not in extras:  # the papers' objective; "+cost" keeps the goodput defaults
        options |= {"objective": "acceptance", "draft_length": "fixed", "allow_none": False}
    if "chosen" in extras:  # no evaluation phase at all: only the chosen drafter is scored
        options["evaluate"] = "chosen"
    if "skip" in extras:
        options |= {"warmup_rounds": 6, "update_every": 4}
    from dataclasses import replace

    from specdraft.config.profile import PolicyConfig

    return replace(overridden, policy=PolicyConfig(name, options))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="profiles/demo-wide.toml")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=96)
    parser.add_argument("--json")
    parser.add_argument("--only", help="comma-separated configuration labels to run (plain always runs)")
    args = parser.parse_args()
    quiet_libraries(False)
    torch.set_grad_enabled(False)
    profile = load_profile(args.pool).with_overrides(max_new_tokens=args.max_new_tokens, temperature=0.0)
    target = load_model(profile.target, str(profile.file), "target")
    configs = dict(CONFIGS) | {f"fixed:{d.name}": f"fixed:{d.name}" for d in profile.drafters}
    runtimes = {label: build_runtime(policy_for(profile, spec), target) for label, spec in configs.items()}
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        runtimes = {k: v for k, v in runtimes.items() if k in wanted}
    runtimes["plain"] = build_runtime(profile, target, plain=True)

    results = []
    for task, prompt in PROMPTS.items():
        for label, runtime in runtimes.items():
            run = PromptRun(runtime, prompt, None)
            records = []
            start = time.perf_counter()
            for _, record in run:
                records.append(record)
            elapsed = time.perf_counter() - start
            results.append(summarize(task, label, run, records, elapsed))
            print(json.dumps(results[-1]), flush=True)

    print_table(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


def summarize(task, label, run, records, elapsed) -> dict:
    stats = run.stats
    row = {"task": task, "config": label, "tokens": stats.tokens, "rounds": stats.rounds,
           "mean_accepted": stats.mean_accepted, "tokens_per_s": stats.tokens / elapsed,
           "evaluate_share": stats.evaluate_s / elapsed, "overhead_share": stats.overhead_s / elapsed,
           "text_ids": run.detokenizer.ids}
    tracker = stats.regret_tracker
    if tracker is not None:
        totals = sorted(tracker.totals, reverse=True)
        best = tracker.best
        after = tracker.chosen[10:]
        row |= {"best_drafter": stats.drafter_names[best], "best_margin": totals[0] / totals[1] - 1 if totals[1] else None,
                "best_share_after_10": after.count(best) / len(after) if after else None,
                "best_arm_share": tracker.best_arm_share, "regret": tracker.regret,
                # in the policy's objective: "tokens" (EAL) or "tok/s"; each arm's total over
                # the rounds it was scored in (see RegretTracker)
                "regret_unit": tracker.unit, "totals": dict(zip(stats.drafter_names, tracker.totals)),
                "scored_rounds": dict(zip(stats.drafter_names, tracker.scored))}
        if tracker.unit == "tokens":  # the older name, kept where it still says what it holds
            row["eal_totals"] = row["totals"]
    return row


def print_table(results) -> None:
    plain = {r["task"]: r for r in results if r["config"] == "plain"}
    print("\n| prompt | policy | mean accepted | tokens/s | speedup | best drafter (margin) | best share after 10 "
          "| regret | evaluate share | text = plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = plain[r["task"]]
        best = f"{r['best_drafter']} (+{r['best_margin']:.0%})" if r.get("best_drafter") else "-"
        share = f"{r['best_share_after_10']:.0%}" if r.get("best_share_after_10") is not None else "-"
        regret = f"{r['regret']:.2f} {r.get('regret_unit', '')}".strip() if r.get("regret") is not None else "-"
        print(f"| {r['task']} | {r['config']} | {r['mean_accepted']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {best} | {share} | {regret} | "
              f"{r['evaluate_share']:.0%} | {'yes' if r['text_ids'] == base['text_ids'] else 'NO'} |")


if __name__ == "__main__":
    main()
