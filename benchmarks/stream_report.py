"""Speed over a stream from a `specdraft bench --out` file: tokens per second of each
configuration over the prompts from position --skip on (the prompts before it warm a
drafter that learns from earlier answers), as a ratio to plain decoding and to a chosen
configuration, with the mean tokens per round.

    python benchmarks/stream_report.py /tmp/batch.json --skip 10 --versus fixed:lookup
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bench_json")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N prompts of each pass")
    parser.add_argument("--versus", default=None, help="also report ratios to this configuration")
    args = parser.parse_args()
    samples = json.load(open(args.bench_json, encoding="utf-8"))["samples"]
    order: list[str] = []
    for s in samples:
        if s["id"] not in order:
            order.append(s["id"])
    kept = set(order[args.skip:])
    tokens, seconds, rounds, mismatches = defaultdict(int), defaultdict(float), defaultdict(int), defaultdict(int)
    for s in samples:
        if s["id"] in kept:
            tokens[s["config"]] += s["tokens"]
            seconds[s["config"]] += s["elapsed_s"]
            rounds[s["config"]] += s["rounds"]
            mismatches[s["config"]] += bool(s.get("mismatch"))
    speed = {c: tokens[c] / seconds[c] for c in tokens}
    plain = speed.get("plain")
    print(f"prompts {args.skip + 1}..{len(order)} ({len(kept)})")
    print(f"{'config':<28}{'tok/s':>8}{'vs plain':>10}" + (f"{'vs ' + args.versus:>22}" if args.versus else "")
          + f"{'tokens/round':>14}{'mismatch':>10}")
    for config, value in speed.items():
        line = f"{config:<28}{value:>8.1f}{value / plain if plain else float('nan'):>9.2f}x"
        if args.versus:
            line += f"{value / speed[args.versus]:>21.2f}x"
        per_round = f"{tokens[config] / rounds[config]:.2f}" if rounds[config] else "-"  # transformers' own: unknown
        line += f"{per_round:>14}{mismatches[config]:>10}"
        print(line)


if __name__ == "__main__":
    main()
