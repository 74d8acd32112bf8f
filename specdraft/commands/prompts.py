"""Where `generate` gets its prompts: the argument (after piped stdin's text, when both are
given, as llm joins them), all of piped stdin, or (`--each-line`) one prompt per stdin line.

stdin is read as bytes and decoded line by line, so a line that is not UTF-8 becomes a
`Line` with an error naming its number and column instead of ending the whole batch.
Empty lines come through too (text ""): the caller decides to skip or answer them.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from typing import IO, Any, Iterator

from specdraft.errors import UsageError


@dataclass(frozen=True)
class Line:
    number: int  # 1-based stdin line; 0 for the argument or whole-stdin prompt
    text: str
    error: str | None = None


def read_prompts(prompt: str | None, each_line: bool, stdin: IO[Any]) -> Iterator[Line]:
    """The argument, else all of piped stdin as one prompt, else one prompt per stdin line."""
    if each_line:
        if prompt is not None:
            raise UsageError("--each-line reads prompts from stdin; do not also pass PROMPT")
        if stdin.isatty():
            raise UsageError("--each-line needs prompts piped on stdin")
        return _lines(stdin)
    if prompt is None:
        if stdin.isatty():
            raise UsageError("no prompt: pass PROMPT or pipe text on stdin")
        prompt = _read_all(stdin)
    elif _piped(stdin):  # `cat notes.txt | specdraft generate "summarise"`, as llm joins them
        piped = _read_all(stdin)
        if piped.strip():
            prompt = piped.rstrip("\n") + "\n\n" + prompt
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return iter([Line(0, prompt)])


def _piped(stdin: IO[Any]) -> bool:
    """Whether stdin is a pipe or a file (text to join with PROMPT): not a terminal, and
    not a device such as /dev/null."""
    try:
        mode = os.fstat(stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return not stdin.isatty()  # an in-memory stream (tests, embedding)
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


def _lines(stdin: IO[Any]) -> Iterator[Line]:
    binary = getattr(stdin, "buffer", None)
    for number, raw in enumerate(binary if binary is not None else stdin, start=1):
        if isinstance(raw, str):
            yield Line(number, raw.rstrip("\r\n"))
            continue
        raw = raw.rstrip(b"\r\n")
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a byte-order mark is not part of the first prompt
        try:
            yield Line(number, raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            yield Line(number, "", f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")


def _read_all(stdin: IO[Any]) -> str:
    binary = getattr(stdin, "buffer", None)
    if binary is None:
        return stdin.read()
    data = binary.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UsageError(f"stdin: not valid UTF-8 (byte 0x{data[exc.start]:02x} on line {line})") from None
