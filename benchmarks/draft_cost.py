#!/usr/bin/env python3
"""Draft cost per token of every drafter in a pool, against one target forward.

The same timings `specdraft trace` records for replay (`measurement/traces.measure_costs`):
median seconds of a forward of 1 and of k + 1 tokens after a 64-token prefill, for the
target and for each drafter that drafts with a network; repeated and interleaved.

    python benchmarks/draft_cost.py --pool profiles/specialists.toml [--k 4] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", required=True)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from specdraft.profile import load_profile
    from specdraft.measurement.traces import measure_costs
    from specdraft.runtime import build_runtime

    runtime = build_runtime(load_profile(args.pool))
    costs = measure_costs(runtime, args.k, args.repeats)
    target = costs.pop("target")
    print(f"target: one-token forward {target(1) * 1e3:.2f} ms, {args.k + 1} tokens {target(args.k + 1) * 1e3:.2f} ms")
    for name, cost in costs.items():
        if cost(1) > 0:
            print(f"{name}: one draft step {cost(1) * 1e3:.2f} ms = {cost(1) / target(1):.1%} of a target forward")


if __name__ == "__main__":
    main()
