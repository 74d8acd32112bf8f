#!/usr/bin/env python3
"""The command with and without huge pages for its heap (`specdraft/launch.py`): `specdraft
bench` run in pairs of processes, one started as usual and one with SPECDRAFT_HUGE_PAGES=0,
their order alternating; each configuration's tokens/s over all prompts, pair by pair.

    python benchmarks/huge_pages.py --pool profiles/specialists.toml \
        --data benchmarks/data/head-eval.jsonl --policies normalhedge,fixed:lookup -n 128 --pairs 3
"""

from __future__ import annotations

import argparse
import os

from bench_pairs import add_bench_arguments, run_pairs  # benchmarks/, the folder the script runs from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    run_pairs(args, {"with huge pages": {**base, "SPECDRAFT_HUGE_PAGES": "1"},
                     "without": {**base, "SPECDRAFT_HUGE_PAGES": "0"}})


if __name__ == "__main__":
    main()
