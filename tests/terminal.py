"""A tiny terminal emulator for tests: enough VT100 (print, wrap, CR, LF, cursor up, erase
line, SGR and cursor-visibility codes) to replay what Rich's Live display writes and read
back what a user would see, scrollback included."""

from __future__ import annotations

import io
import re

_ESCAPE = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


class Terminal(io.StringIO):
    """A write-only stream that is a terminal: `isatty()` is true and `screen()` renders."""

    def __init__(self, width: int = 60, height: int = 16):
        super().__init__()
        self.width, self.height = width, height

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no file descriptor")

    def screen(self) -> list[str]:
        """Every line ever shown that is still visible or scrolled into the scrollback."""
        scrollback: list[str] = []
        rows = [[" "] * self.width for _ in range(self.height)]
        row = col = 0
        pending_wrap = False  # a character written in the last column wraps only when the next one comes

        def newline():
            nonlocal row
            if row == self.height - 1:
                scrollback.append("".join(rows.pop(0)).rstrip())
                rows.append([" "] * self.width)
            else:
                row += 1

        text, i = self.getvalue(), 0
        while i < len(text):
            match = _ESCAPE.match(text, i)
            if match:
                args, code = match.groups()
                n = int(args) if args.isdigit() else 1
                if code == "A":
                    row = max(0, row - n)
                    pending_wrap = False
                elif code == "K":
                    rows[row] = [" "] * self.width if args == "2" else rows[row][:col] + [" "] * (self.width - col)
                elif code == "G":
                    col, pending_wrap = max(0, n - 1), False
                i = match.end()
                continue
            ch = text[i]
            i += 1
            if ch == "\r":
                col, pending_wrap = 0, False
            elif ch == "\n":
                newline()
                col, pending_wrap = 0, False
            elif ch == "\x1b":
                continue
            else:
                if pending_wrap:
                    newline()
                    col, pending_wrap = 0, False
                rows[row][col] = ch
                if col == self.width - 1:
                    pending_wrap = True
                else:
                    col += 1
        lines = scrollback + ["".join(r).rstrip() for r in rows]
        while lines and not lines[-1]:
            lines.pop()
        return lines
