"""The README's results table, from `specdraft bench --out` JSON files.

    python tools/results_table.py docs/results/*.json                     # print the table
    python tools/results_table.py docs/results/*.json --write README.md   # replace the marked block
    python tools/results_table.py docs/results/*.json --check README.md   # exit 1 if it differs

One Markdown table over every file given, a run per file (named by the file's stem). Rows:
specdraft's plain decoding, then its other configurations (policies, fixed drafters) in the
order bench ran them, then the baselines (transformers, llama.cpp: the rows bench reports as
another engine's). Columns: tokens/s over all the run's prompts (bench's "all" rows), the
ratio to the same run's specdraft plain decoding, and the machine and commit where known: a
file's own top-level "machine" and "commit" keys, else --machine and --commit. A ratio bench
marked as not to be trusted (noisy repeats, or a speedup its accepted tokens cannot explain)
carries a "?".

`--write FILE` replaces what lies between the lines `<!-- results:begin -->` and
`<!-- results:end -->` in FILE, and nothing else. The block starts with a comment holding the
command that regenerates it, so `--check` (and the README test) can rebuild it the same way.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
PLAIN = "plain"  # bench's name for specdraft's plain decoding


class TableError(Exception):
    """An input this tool cannot use: the message says which and why."""


def load_run(path: Path) -> dict:
    """A bench JSON file's summary rows over all prompts, with its machine and commit if it
    records them."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TableError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("summary"), list):
        raise TableError(f"{path}: no \"summary\" list; expected the file of `specdraft bench --out`")
    rows = [row for row in data["summary"] if isinstance(row, dict) and row.get("task") == "all"]
    if not any(row.get("config") == PLAIN for row in rows):
        raise TableError(f"{path}: no plain decoding row over all prompts (task \"all\", config \"plain\")")
    return {"name": path.stem, "rows": rows, "machine": data.get("machine"), "commit": data.get("commit")}


def _ordered(rows: list[dict]) -> list[dict]:
    """Plain decoding first, then specdraft's other configurations, then the baselines (rows
    with no mismatch count: another engine's text is compared by share, not by mismatches)."""
    plain = [r for r in rows if r["config"] == PLAIN]
    ours = [r for r in rows if r["config"] != PLAIN and r.get("mismatches") is not None]
    peers = [r for r in rows if r["config"] != PLAIN and r.get("mismatches") is None]
    return plain + ours + peers


def _label(row: dict) -> str:
    if row.get("mismatches") is None:
        return row["config"]  # a baseline's name starts with its engine (transformers ..., llama.cpp ...)
    return f"specdraft {row['config']}"


def render(runs: list[dict], machine: str | None = None, commit: str | None = None) -> str:
    """The Markdown table (no trailing newline)."""
    runs = [{**run, "machine": run.get("machine") or machine, "commit": run.get("commit") or commit} for run in runs]
    extra = [key for key in ("machine", "commit") if any(run[key] for run in runs)]
    header = ["run", "configuration", "tokens/s", "x specdraft plain", *extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---", "---:", "---:"] + ["---"] * len(extra)) + "|"]
    marked = False
    for run in runs:
        plain = next(r for r in run["rows"] if r["config"] == PLAIN)["tokens_per_s"]
        for row in _ordered(run["rows"]):
            ratio = f"{row['tokens_per_s'] / plain:.2f}x" if plain else "-"
            if row.get("noisy") or row.get("implausible"):
                ratio += " ?"
                marked = True
            cells = [run["name"], _label(row), f"{row['tokens_per_s']:.1f}", ratio]
            cells += [str(run[key] or "-") for key in extra]
            lines.append("| " + " | ".join(cells) + " |")
    if marked:
        lines += ["", "? bench marked this ratio as not to be trusted (repeats of a prompt differed by more than "
                      "1.5x, or the speedup exceeds what its accepted tokens allow): rerun on a quiet machine."]
    return "\n".join(lines)


def block(files: list[str], machine: str | None, commit: str | None) -> str:
    """What goes between the markers: the command that regenerates it, then the table, each
    followed by a blank line (so Markdown ends the table before the end marker)."""
    command = ["python", "tools/results_table.py", *files]
    if machine:
        command += ["--machine", machine]
    if commit:
        command += ["--commit", commit]
    runs = [load_run(Path(f)) for f in files]
    comment = f"<!-- generated by: {shlex.join(command + ['--write', 'README.md'])} -->"
    return f"{comment}\n\n{render(runs, machine, commit)}\n\n"


def marked_block(text: str, where: str) -> tuple[int, int]:
    """The character span between the begin marker's line and the end marker's line."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise TableError(f"{where}: expected one {BEGIN} line and one {END} line")
    start = text.index(BEGIN)
    start = text.index("\n", start) + 1 if "\n" in text[start:] else len(text)
    end = text.index(END)
    end = text.rfind("\n", 0, end) + 1
    if end < start:
        raise TableError(f"{where}: {END} comes before {BEGIN}")
    return start, end


def replace_block(text: str, content: str, where: str = "the file") -> str:
    """`text` with the lines between the markers replaced by `content`."""
    start, end = marked_block(text, where)
    return text[:start] + content + ("" if content.endswith("\n") else "\n") + text[end:]


def current_block(text: str, where: str = "the file") -> str:
    start, end = marked_block(text, where)
    return text[start:end]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="`specdraft bench --out` JSON files, one run each")
    parser.add_argument("--machine", help="the machine the runs measured, where the JSON does not say")
    parser.add_argument("--commit", help="the commit the runs measured, where the JSON does not say")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--write", metavar="FILE", help="replace the marked block of FILE (README.md)")
    target.add_argument("--check", metavar="FILE", help="exit 1 when the marked block of FILE differs")
    args = parser.parse_args(argv)
    try:
        content = block(args.files, args.machine, args.commit)
        if args.write:
            path = Path(args.write)
            path.write_text(replace_block(path.read_text(), content, args.write))
        elif args.check:
            if current_block(Path(args.check).read_text(), args.check) != content:
                print(f"{args.check}: the results table differs from what {', '.join(args.files)} give; "
                      f"rerun with --write {args.check}", file=sys.stderr)
                return 1
        else:
            print(content, end="")
    except TableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
