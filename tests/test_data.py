"""Dataset files: JSONL, CSV and plain text; bad lines are reported and skipped."""

from __future__ import annotations

import pytest

from specdraft.measurement.datasets import load_dataset
from specdraft.errors import UsageError


def test_jsonl_with_bad_lines_reports_each_and_keeps_the_rest(tmp_path):
    file = tmp_path / "d.jsonl"
    file.write_text('{"prompt": "a", "task": "code", "id": "x1"}\n\nnot json\n[1]\n{"task": "t"}\n{"prompt": "b"}\n')
    warnings = []
    examples = load_dataset(file, warnings.append)
    assert [(e.id, e.prompt, e.task) for e in examples] == [("x1", "a", "code"), ("6", "b", "default")]
    assert [w.split(": skipped")[0] for w in warnings] == [f"{file}:3", f"{file}:4", f"{file}:5"]


def test_csv_and_text(tmp_path):
    csv_file = tmp_path / "d.csv"
    csv_file.write_text('prompt,task\n"hello, world",greet\n,empty\nbye,\n')
    warnings = []
    examples = load_dataset(csv_file, warnings.append)
    assert [(e.prompt, e.task) for e in examples] == [("hello, world", "greet"), ("bye", "default")]
    assert len(warnings) == 1 and ":3:" in warnings[0]
    text = tmp_path / "d.txt"
    text.write_text("one\n\ntwo\n")
    assert [e.prompt for e in load_dataset(text, warnings.append, limit=1)] == ["one"]


def test_unusable_files_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="file not found"):
        load_dataset(tmp_path / "nope.jsonl", print)
    bad = tmp_path / "d.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(UsageError, match="needs a 'prompt' column"):
        load_dataset(bad, print)
    empty = tmp_path / "e.jsonl"
    empty.write_text("oops\n")
    with pytest.raises(UsageError, match="no usable prompts"):
        load_dataset(empty, lambda m: None)


def test_a_line_that_is_not_utf8_is_skipped_not_fatal(tmp_path):
    file = tmp_path / "d.txt"
    file.write_bytes(b"one\n\xffbad\nthree\n")
    warnings = []
    assert [e.prompt for e in load_dataset(file, warnings.append)] == ["one", "three"]
    assert warnings == [f"{file}:2: skipped: not valid UTF-8 (byte 0xff at column 1)"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xe9"}\n')
    assert [e.id for e in load_dataset(jsonl, warnings.append)] == ["1"]


@pytest.mark.parametrize("limit", [0, -1])
def test_limit_below_one_is_refused(tmp_path, limit):
    file = tmp_path / "d.txt"
    file.write_text("one\ntwo\n")
    with pytest.raises(UsageError, match="--limit: must be at least 1"):
        load_dataset(file, print, limit=limit)
