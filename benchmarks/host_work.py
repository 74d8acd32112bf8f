"""Where a round's host time goes, per policy: the engine's and the driver's parts timed by
wrapping them, the policies run one after another on each prompt (their order alternating),
every drafter's run history forgotten before each run so no policy drafts from another's
output.

    python benchmarks/host_work.py --pool profiles/demo-wide.toml \
        --data benchmarks/data/stream-g.jsonl --policies "normalhedge;fixed:suffix" -n 64

Prints, per policy, tokens/s, tokens per round and milliseconds per round of: the awake
check, choosing (the policy's pick and the planner's plan, the tree planner's share apart),
drafting, verifying (one chain or a tree), finishing the round (learning; the drafters'
scoring apart) and the rest. Compare policies within one run only.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdraft.decoding.engine import SpeculativeEngine  # noqa: E402
from specdraft.decoding.evaluation import PoolEvaluator  # noqa: E402
from specdraft.learning.driver import PolicyDriver  # noqa: E402
from specdraft.learning.tree_planner import TreePlanner  # noqa: E402
from specdraft.profile import load_profile  # noqa: E402
from specdraft.runtime import build_runtime  # noqa: E402
from specdraft.session.prompt_run import PromptRun  # noqa: E402

PARTS = [(SpeculativeEngine, "_awake", "awake"), (PolicyDriver, "choose", "choose"),
         (TreePlanner, "branches", "tree plan"), (SpeculativeEngine, "_verify", "verify"),
         (SpeculativeEngine, "_verify_tree", "verify tree"), (PolicyDriver, "finish_round", "finish"),
         (PoolEvaluator, "__call__", "scoring"), (SpeculativeEngine, "_start", "prefill")]
NESTED = {"tree plan", "scoring"}  # parts of choosing and finishing, timed inside them


def timed(spent: dict[str, float]) -> None:
    """Wrap each of PARTS so that its wall time adds up in `spent`."""
    for owner, name, label in PARTS:
        inner = getattr(owner, name)

        def wrapper(*args, _inner=inner, _label=label, **kwargs):
            began = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - began

        setattr(owner, name, functools.wraps(inner)(wrapper))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--data", required=True, help=".jsonl with a prompt per line")
    parser.add_argument("--policies", required=True, help='separated by ";", e.g. "normalhedge;fixed:suffix"')
    parser.add_argument("-n", "--limit", type=int, default=0, help="the first N prompts (0: all)")
    args = parser.parse_args()
    profile = load_profile(args.pool)
    policies = args.policies.split(";")
    base = build_runtime(profile)
    runtimes = {p: build_runtime(profile.with_overrides(policy=p), base.target, models=base.models, record=False)
                for p in policies}
    with open(args.data) as lines:
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    prompts = prompts[: args.limit] if args.limit else prompts
    spent: dict[str, float] = collections.defaultdict(float)
    timed(spent)
    totals = {p: collections.defaultdict(float) for p in policies}
    for i, prompt in enumerate(prompts):
        for policy in policies if i % 2 == 0 else policies[::-1]:
            for drafter in runtimes[policy].drafters:
                drafter.forget_run()
            spent.clear()
            began = time.perf_counter()
            run = PromptRun(runtimes[policy], prompt)
            for _ in run:
                pass
            total = totals[policy]
            total["wall"] += time.perf_counter() - began
            total["rounds"] += run.stats.rounds
            total["tokens"] += run.stats.tokens
            for label, seconds in spent.items():
                total[label] += seconds
    for policy in policies:
        total = totals[policy]
        rounds = total["rounds"]
        inner = sum(total[label] for _, _, label in PARTS if label not in NESTED)
        parts = " · ".join(f"{label} {1000 * total[label] / rounds:.2f}" for _, _, label in PARTS)
        print(f"{policy}: {total['tokens'] / total['wall']:.1f} tokens/s, {total['tokens'] / rounds:.2f} tokens a round, "
              f"{1000 * total['wall'] / rounds:.2f} ms a round: {parts} · rest (drafting, committing, text) "
              f"{1000 * (total['wall'] - inner) / rounds:.2f}")


if __name__ == "__main__":
    main()
