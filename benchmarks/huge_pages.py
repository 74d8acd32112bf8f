#!/usr/bin/env python3
"""The command with and without huge pages for its heap (`specdraft/launch.py`): `specdraft
bench` run in pairs of processes, one started as usual and one with SPECDRAFT_HUGE_PAGES=0,
their order alternating; each configuration's tokens/s over all prompts, pair by pair.

    python benchmarks/huge_pages.py --pool profiles/specialists.toml \
        --data benchmarks/data/head-eval.jsonl --policies normalhedge,fixed:lookup -n 128 --pairs 3

A pair's two runs are separate processes minutes apart: compare the ratio over several pairs,
not one.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile


def bench(args: argparse.Namespace, huge: bool, out: str) -> dict[str, float]:
    """One `specdraft bench` process: tokens/s of each configuration over all prompts."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(HF_HUB_OFFLINE="1", SPECDRAFT_HUGE_PAGES="1" if huge else "0")
    command = [sys.executable, "-m", "specdraft", "bench", "--pool", args.pool, "--data", args.data,
               "--policies", args.policies, "-n", str(args.max_new_tokens), "--csv", out]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as rows:
        return {row["config"]: float(row["tokens_per_s"]) for row in csv.DictReader(rows) if row["task"] == "all"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--policies", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "bench.csv")
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            runs = {huge: bench(args, huge, out) for huge in order}
            for config, speed in runs[True].items():
                ratios.setdefault(config, []).append(speed / runs[False][config])
                print(f"pair {pair + 1}: {config}: {speed:.1f} tokens/s with huge pages, "
                      f"{runs[False][config]:.1f} without ({speed / runs[False][config]:.3f}x)", flush=True)
    for config, values in ratios.items():
        print(f"{config}: {statistics.mean(values):.3f}x with huge pages (pairs: "
              f"{', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
