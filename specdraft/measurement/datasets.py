"""Prompt datasets for `bench`, `trace` and `calibrate-beta`.

JSONL (`prompt`, optional `task`, optional `id`), CSV with a `prompt` column (and
optional `task`, `id`), or plain text with one prompt per line. A malformed line (bad
JSON, no prompt, bytes that are not UTF-8) is reported with its line number and skipped;
it never ends the run and is never dropped silently.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from specdraft.errors import UsageError
from specdraft.storage.regular_files import read_regular_bytes


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    task: str = "default"


DATA_LIMIT = 2 << 30  # bytes: far more prompts than a run decodes; /dev/zero is refused, not read


def load_dataset(file: str | Path, warn: Callable[[str], None], limit: int | None = None) -> list[Example]:
    if limit is not None and limit < 1:
        raise UsageError(f"--limit: must be at least 1 (got {limit})")
    path = Path(file)
    try:
        data = read_regular_bytes(path, limit=DATA_LIMIT)
    except FileNotFoundError:
        raise UsageError(f"--data {file}: file not found") from None
    except OSError as exc:
        raise UsageError(f"--data {file}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a pipe, a device, or more than a prompt file holds
        raise UsageError(f"--data {file}: cannot read: {exc}") from None
    text = _decoded(data, str(file), warn)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        examples = _jsonl(text, str(file), warn)
    elif suffix == ".csv":
        examples = _csv(text, str(file), warn)
    else:
        examples = [Example(f"{i}", line.rstrip("\r"), "default")
                    for i, line in enumerate(text.split("\n"), start=1) if line.strip()]
    ids = [e.id for e in examples]
    if len(set(ids)) != len(ids):
        raise UsageError(f"--data {file}: ids must be unique")
    if not examples:
        raise UsageError(f"--data {file}: no usable prompts")
    return examples[:limit] if limit else examples


def _decoded(data: bytes, file: str, warn: Callable[[str], None]) -> str:
    """The file as text; a line that is not UTF-8 is reported and left empty (so line
    numbers stay right) instead of failing the whole file."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            warn(f"{file}:{number}: skipped: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")
            lines[number - 1] = b""
    return b"\n".join(lines).decode("utf-8")


def json_lines(text: str, file: str, warn: Callable[[str], None]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line; a line that is not JSON is
    reported with its number and skipped."""
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            warn(f"{file}:{number}: skipped: not JSON ({exc.msg})")


def _jsonl(text: str, file: str, warn: Callable[[str], None]) -> list[Example]:
    out = []
    for number, row in json_lines(text, file, warn):
        example = _example(row, number, file, warn)
        if example:
            out.append(example)
    return out


def _csv(text: str, file: str, warn: Callable[[str], None]) -> list[Example]:
    reader = csv.DictReader(text.splitlines())
    if not reader.fieldnames or "prompt" not in reader.fieldnames:
        raise UsageError(f"--data {file}: a CSV needs a 'prompt' column (found: {', '.join(reader.fieldnames or [])})")
    out = []
    for row in reader:
        example = _example(row, reader.line_num, file, warn)
        if example:
            out.append(example)
    return out


def _example(row: object, number: int, file: str, warn: Callable[[str], None]) -> Example | None:
    if not isinstance(row, dict):
        warn(f"{file}:{number}: skipped: expected an object with a 'prompt'")
        return None
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        warn(f"{file}:{number}: skipped: missing or empty 'prompt'")
        return None
    task = row.get("task") or "default"
    ident = row.get("id")
    return Example(str(ident) if ident not in (None, "") else str(number), prompt, str(task))
