"""Whole runs of a pool on this checkout's suffix index and C kernels against another
revision's, interleaved per prompt in one process: what a change to either did to tokens/s
end to end, free of the drift between runs (a forward's cost alone: kernel_revisions.py).

The other revision's `suffix_index.py` is loaded from git as a module of its own and its
kernels are compiled as `kernel_revisions.py` compiles them; everything else (the engine,
the policy, the drafters' own code) is this checkout's. Each configuration has its own
runtimes, so each suffix drafter's history is built by its own index (a datastore on disk
is opened by this checkout's in both); as in `specdraft bench`, every pass starts a fresh stream (the drafters forget the run) and a first pass
warms up uncounted.

    python benchmarks/revision_speed.py --pool profiles/demo-wide.toml \
        --data benchmarks/data/stream-g.jsonl --against 2211d15 \
        --policies "plain;fixed:suffix;normalhedge" -n 64 --repeat 2
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import specdraft.drafters.suffix as suffix_module  # noqa: E402
import specdraft.drafters.suffix_index as this_index  # noqa: E402
from kernel_revisions import ROOT, build_revision  # noqa: E402
from specdraft.models.kernels import block_linear
from specdraft.models.kernels import native
from specdraft.models.kernels import native_layers# noqa: E402
from specdraft.profile import load_profile  # noqa: E402
from specdraft.runtime import build_runtime  # noqa: E402
from specdraft.session.prompt_run import PromptRun  # noqa: E402

SWAPPED = ("ContextIndex", "SuffixIndex", "continue_occurrences")  # the names suffix.py takes from its index


def index_module(revision: str, folder: Path):
    """`specdraft/drafters/suffix_index.py` as `revision` had it, imported under its own name."""
    source = subprocess.run(["git", "show", f"{revision}:specdraft/drafters/suffix_index.py"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    path = folder / "suffix_index_other.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("suffix_index_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--data", required=True, help=".jsonl with a prompt per line")
    parser.add_argument("--against", required=True, help="the git revision compared")
    parser.add_argument("--policies", default="plain;normalhedge", help='";"-separated; "plain": no drafting')
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="measured passes after the warm-up pass")
    args = parser.parse_args()
    profile = load_profile(args.pool).with_overrides(max_new_tokens=args.max_new_tokens)
    base = build_runtime(profile)

    def runtime(policy: str):
        if policy == "plain":
            return build_runtime(profile, base.target, models=base.models, plain=True, record=False)
        return build_runtime(profile.with_overrides(policy=policy), base.target, models=base.models, record=False)

    folder = Path(tempfile.mkdtemp())
    configs = {"this checkout": (this_index, native.library()),
               args.against: (index_module(args.against, folder), build_revision(args.against, folder))}
    policies = args.policies.split(";")
    runtimes = {(name, policy): runtime(policy) for name in configs for policy in policies}
    with open(args.data) as lines:
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    totals: dict[tuple, float] = collections.defaultdict(float)
    for rep in range(args.repeat + 1):
        for run in runtimes.values():
            for drafter in run.drafters:
                drafter.forget_run()
        for prompt in prompts:
            for policy in policies:
                for name in random.sample(list(configs), len(configs)):
                    module, library = configs[name]
                    native_layers.library = block_linear.library = native.library = lambda chosen=library: chosen
                    for attr in SWAPPED:
                        setattr(suffix_module, attr, getattr(module, attr))
                    began = time.perf_counter()
                    run = PromptRun(runtimes[name, policy], prompt)
                    for _ in run:
                        pass
                    if rep:
                        totals[policy, name, "seconds"] += time.perf_counter() - began
                        totals[policy, name, "tokens"] += run.stats.tokens
    mine, other = configs
    print(f"tokens/s over {args.repeat} pass(es) of {len(prompts)} prompts (x = this checkout / {other})")
    for policy in policies:
        a, b = (totals[policy, name, "tokens"] / totals[policy, name, "seconds"] for name in (mine, other))
        print(f"{policy:32s} {a:8.1f} {b:8.1f}  ({a / b:.3f}x)")


if __name__ == "__main__":
    main()
