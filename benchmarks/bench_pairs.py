"""What the process-pair benchmarks share (huge_pages.py, revision_processes.py): one
`specdraft bench` process with a given environment, its tokens/s per configuration over all
prompts, and pairs of such processes in alternating order, summarised as ratios pair by pair.
A pair's two runs are separate processes minutes apart: compare the ratio over several pairs,
not one."""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--policies", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)


def bench(args: argparse.Namespace, env: dict[str, str], out: str, cwd: str | None = None) -> dict[str, float]:
    """One `specdraft bench` process under `env`, started in `cwd` (`python -m` imports from
    there first): tokens/s of each configuration over all prompts."""
    command = [sys.executable, "-m", "specdraft", "bench", "--pool", os.path.abspath(args.pool),
               "--data", os.path.abspath(args.data), "--policies", args.policies,
               "-n", str(args.max_new_tokens), "--csv", out]
    subprocess.run(command, env={"HF_HUB_OFFLINE": "1", **env}, cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(out) as rows:
        return {row["config"]: float(row["tokens_per_s"]) for row in csv.DictReader(rows) if row["task"] == "all"}


def run_pairs(args: argparse.Namespace, envs: dict[str, dict[str, str]],
              folders: dict[str, str] | None = None) -> None:
    """Pairs of bench processes, the two environments of `envs` ({label: env}, the first
    the one measured, the second its reference; each started in `folders[label]` where
    given) in alternating order; prints each
    configuration's ratio first / second, pair by pair and on average."""
    (label, _), (reference, _) = envs.items()
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "bench.csv")
        for pair in range(args.pairs):
            order = list(envs) if pair % 2 == 0 else list(reversed(envs))
            runs = {name: bench(args, envs[name], out, (folders or {}).get(name)) for name in order}
            for config, speed in runs[label].items():
                ratio = speed / runs[reference][config]
                ratios.setdefault(config, []).append(ratio)
                print(f"pair {pair + 1}: {config}: {speed:.1f} tokens/s {label}, "
                      f"{runs[reference][config]:.1f} {reference} ({ratio:.3f}x)", flush=True)
    for config, values in ratios.items():
        print(f"{config}: {statistics.mean(values):.3f}x {label} against {reference} (pairs: "
              f"{', '.join(f'{v:.3f}' for v in values)})")
