"""Editing a profile in place: set one `[policy]` key without disturbing anything else."""

from __future__ import annotations

import re
from pathlib import Path

from specdraft.errors import UsageError

_SECTION = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")


def write_policy_option(file: Path, key: str, value: float) -> None:
    """Set `[policy] key = value` in place: the line is rewritten if present (its comment
    kept), else added at the end of the table; nothing else in the file changes."""
    lines = Path(file).read_text(encoding="utf-8").splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if (m := _SECTION.match(line)) and m.group(1).strip() == "policy"),
                 None)
    if start is None:
        raise UsageError(f"{file}: has no [policy] table to write {key} into")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    literal = repr(value) if isinstance(value, float) else str(value)
    pattern = re.compile(rf"^(\s*{re.escape(key)}\s*=\s*)([^#\r\n]*?)(\s*#[^\r\n]*)?(\r?\n)?$")
    for i in range(start + 1, end):
        match = pattern.match(lines[i])
        if match:
            lines[i] = f"{match.group(1)}{literal}{match.group(3) or ''}{match.group(4) or ''}"
            break
    else:
        insert = end
        while insert > start + 1 and not lines[insert - 1].strip():
            insert -= 1  # keep blank lines that separate tables after the new key
        if insert > 0 and not lines[insert - 1].endswith("\n"):
            lines[insert - 1] += "\n"
        lines.insert(insert, f"{key} = {literal}\n")
    Path(file).write_text("".join(lines), encoding="utf-8")
