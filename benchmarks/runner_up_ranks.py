"""How often runner-up leaves could pay: each drafter that ranks tokens (model and head
drafters) drafts alone at a fixed K on the prompts, greedy, and at every round where its
draft is wrong, where the target's token comes in the drafter's order after the drafted one
(1: its runner-up) is counted, as the tree planner learns it (`RoundFeedback.runner_ups`).

    python benchmarks/runner_up_ranks.py --pool profiles/specialists.toml \
        --data benchmarks/data/head-eval.jsonl --drafters code,math --by-task -n 128

Prints per drafter (and with --by-task only on prompts whose task is its name) the wrong
drafts counted and the share of them whose target token is its runner-up, within its first
two and first three runner-ups, and further down. No timing: the counts are the models'.
"""

from __future__ import annotations

import argparse
import collections
import os
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdraft.measurement.datasets import load_dataset  # noqa: E402
from specdraft.profile import load_profile, parse_policy_flag  # noqa: E402
from specdraft.runtime import build_runtime  # noqa: E402
from specdraft.session.prompt_ids import prompt_token_ids  # noqa: E402

WIDTH = 3  # leaves a planner may give a position (TreePlanner.MAX_WIDTH)


def ranks_of(pool: str, drafter: str, prompts: list[str], new_tokens: int) -> collections.Counter:
    """Where the target's token came in `drafter`'s order at its first wrong position, per
    wrong draft (capped at WIDTH + 1: none of the leaves), drafting alone at the profile's K."""
    profile = load_profile(pool)
    profile = replace(profile.with_overrides(max_new_tokens=new_tokens),
                      policy=parse_policy_flag(f"fixed:{drafter}(draft_length=fixed)", profile))
    runtime = build_runtime(profile)
    engine, driver = runtime.engine, runtime.engine.driver
    choose, finish = driver.choose, driver.finish_round
    counts: collections.Counter = collections.Counter()

    def with_rankings(produced, awake=None):  # no leaves, but the drafts keep their rankings
        plan = choose(produced, awake)
        return replace(plan, runner_ups=((plan.arm, 0, 1),))

    def counted(outcome, last):
        for _, rank in outcome.feedback.runner_ups:
            counts[min(rank, WIDTH + 1)] += 1
        return finish(outcome, last)

    driver.choose, driver.finish_round = with_rankings, counted
    for prompt in prompts:
        for _ in engine.generate(prompt_token_ids(runtime.target.tokenizer, prompt, None)):
            pass
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--drafters", required=True, help="comma-separated names of drafters that rank tokens")
    parser.add_argument("--by-task", action="store_true", help="each drafter only on the prompts of its own task")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    examples = load_dataset(args.data, print)
    for name in args.drafters.split(","):
        prompts = [e.prompt for e in examples if not args.by_task or e.task == name]
        counts = ranks_of(args.pool, name, prompts, args.max_new_tokens)
        total = sum(counts.values())
        if not total:
            print(f"{name}: no wrong drafts")
            continue
        within = [sum(counts[r] for r in range(1, w + 1)) / total for w in range(1, WIDTH + 1)]
        print(f"{name}: {len(prompts)} prompts, {total} wrong drafts; the target's token is its runner-up "
              f"{within[0]:.1%}, within 2 {within[1]:.1%}, within 3 {within[2]:.1%}, further {1 - within[-1]:.1%}")


if __name__ == "__main__":
    main()
