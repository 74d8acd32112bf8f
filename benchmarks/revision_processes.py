#!/usr/bin/env python3
"""Whole runs of this checkout against another revision, each in processes of its own:
`specdraft bench` in pairs of processes, one importing this checkout and one importing the
other revision's tree (checked out for the run with `git worktree`), their order alternating,
on the same profile file (so the same drafters, heads included) and the same prompts. Unlike
revision_speed.py, which swaps only the suffix index and the C kernels inside one process,
every line of code differs, kernel interfaces included.

    python benchmarks/revision_processes.py --against 90819c4 --pool profiles/specialists.toml \
        --data benchmarks/data/head-eval.jsonl --policies "fixed:suffix,normalhedge" -n 128 --pairs 3

(`plain` is always among the configurations.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from bench_pairs import add_bench_arguments, run_pairs  # benchmarks/, the folder the script runs from

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the git revision compared")
    add_bench_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tree = os.path.join(folder, "tree")
        subprocess.run(["git", "worktree", "add", "--detach", "-q", tree, args.against], cwd=ROOT, check=True)
        try:
            base = dict(os.environ)
            run_pairs(args, {"this checkout": {**base, "PYTHONPATH": str(ROOT)},
                             args.against: {**base, "PYTHONPATH": tree}},
                      {"this checkout": str(ROOT), args.against: tree})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
