"""Text files into training documents: what `specdraft datastore build` indexes and what
`specdraft train` runs the target over.

Folders are walked for text files; a JSONL line contributes its text fields (`text`,
`prompt`, `completion`, ...; else every string value) as one document; any other file is
one document. A file that is not UTF-8 or a line that is not JSON is reported and skipped.
For training, a JSONL line with both a prompt and an answer (`prompt` + `text` as
`specdraft generate --json` writes them, `question` + `answer`, `prompt` +
`canonical_solution`, ...) becomes a chat exchange in the target's chat template, the way
the target sees text when it answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from specdraft.errors import UsageError
from specdraft.measurement.datasets import json_lines

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
                 ".js", ".ts", ".tsx", ".jsx", ".rb", ".sh", ".toml", ".yaml", ".yml", ".json", ".jsonl", ".ndjson",
                 ".html", ".css", ".sql", ".tex", ".csv", ".kt", ".swift", ".scala", ".lua", ".php", ".cs"}
TEXT_FIELDS = ("text", "prompt", "completion", "response", "output", "answer", "canonical_solution", "content")
PROMPT_FIELDS = ("prompt", "question", "instruction", "input")
ANSWER_FIELDS = ("text", "answer", "completion", "response", "output", "canonical_solution")


@dataclass(frozen=True)
class Document:
    text: str = ""
    exchange: tuple[str, str] | None = None  # (prompt, answer) when the line had both


def walk(items: list[str]) -> Iterator[Path]:
    """Every file named, and every text file under every folder named (sorted)."""
    for item in items:
        path = Path(item)
        if path.is_dir():
            for found in sorted(path.rglob("*")):
                if found.is_file() and found.suffix.lower() in TEXT_SUFFIXES:
                    yield found
        elif path.is_file():
            yield path
        else:
            raise UsageError(f"{item}: no such file or folder")


def documents(paths: list[Path], warn: Callable[[str], None], exchanges: bool = False) -> Iterator[Document]:
    """Each file's documents; with `exchanges`, JSONL prompt/answer lines as exchanges."""
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            warn(f"{path}: skipped: not UTF-8 text")
            continue
        except OSError as exc:
            warn(f"{path}: skipped: {exc.strerror or exc}")
            continue
        if path.suffix.lower() in (".jsonl", ".ndjson"):
            yield from _jsonl_documents(path, text, warn, exchanges)
        elif text.strip():
            yield Document(text)


def _jsonl_documents(path: Path, text: str, warn: Callable[[str], None], exchanges: bool) -> Iterator[Document]:
    for number, row in json_lines(text, str(path), warn):
        if isinstance(row, str):
            yield Document(row)
            continue
        if not isinstance(row, dict):
            warn(f"{path}:{number}: skipped: neither an object nor a string")
            continue
        pair = _exchange(row) if exchanges else None
        if pair:
            yield Document(exchange=pair)
            continue
        fields = [row[k] for k in TEXT_FIELDS if isinstance(row.get(k), str)]
        fields = fields or [v for v in row.values() if isinstance(v, str)]
        if fields:
            yield Document("\n".join(fields))


def _exchange(row: dict[str, Any]) -> tuple[str, str] | None:
    prompt = next((row[k] for k in PROMPT_FIELDS if isinstance(row.get(k), str) and row[k].strip()), None)
    answer = next((row[k] for k in ANSWER_FIELDS if isinstance(row.get(k), str) and row[k].strip()), None)
    return (prompt, answer) if prompt and answer else None
