"""Reading one TOML table with typed getters that know their key path.

Every section of a profile (and every drafter kind's own keys) is read through a
`Table`, so every mistake becomes a ProfileError naming the file and the key path, and
keys nobody read are reported as unknown.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from specdraft.errors import ProfileError


class Table:
    """One TOML table being read: typed getters that know their key path, then a leftover check."""

    def __init__(self, data: Any, file: str, path: str):
        if not isinstance(data, dict):
            raise ProfileError(file, path, f"expected a table, got {type_name(data)}")
        self.data, self.file, self.path, self.used = data, file, path, set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str | None, message: str) -> ProfileError:
        return ProfileError(self.file, self.key(name) if name else self.path, message)

    def get(self, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
        self.used.add(name)
        if name not in self.data:
            return default
        value = self.data[name]
        # TOML booleans are ints in Python; never let `true` pass as a number.
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise self.error(name, f"expected {_names(types)}, got a boolean")
        if not isinstance(value, types):
            raise self.error(name, f"expected {_names(types)}, got {type_name(value)}")
        if float in _as_tuple(types) and isinstance(value, int):
            value = float(value)
        if isinstance(value, float) and not math.isfinite(value):  # TOML spells them inf and nan
            raise self.error(name, f"must be a finite number, not {value}")
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: str | None) -> str | None:
        value = self.get(name, str, default)
        if value is not None and value not in choices:
            raise self.error(name, f'unknown value "{value}"; expected one of {", ".join(choices)}')
        return value

    def subset(self, names: tuple[str, ...]) -> "Table":
        """The keys in `names` as a table of their own at the same key path (marked used here)."""
        self.used.update(names)
        return Table({k: v for k, v in self.data.items() if k in names}, self.file, self.path)

    def finish(self) -> None:
        unknown = [k for k in self.data if k not in self.used]
        if unknown:
            raise self.error(unknown[0], "unknown key" + _suggest(unknown[0], self.used))


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "a table"}


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(dict.fromkeys(_TYPE_NAMES.get(t, t.__name__) for t in _as_tuple(types)))


def type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _suggest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f'; did you mean "{close[0]}"?' if close else f"; known keys: {', '.join(sorted(known))}"
