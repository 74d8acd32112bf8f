"""Editing a profile in place: set one `[policy]` key without disturbing anything else.

tomlkit keeps every comment, blank line and layout of the file; only the value changes
(or one `key = value` line is added at the end of the table). The new text is validated
by the caller's check before anything is written, and written to a temporary sibling that
is renamed over the profile, so a crash or a bad value never leaves a broken profile.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Callable

import tomlkit
from tomlkit.exceptions import TOMLKitError

from specdraft.storage.atomic_files import write_text
from specdraft.errors import UsageError

# A trailing comment claiming the value is the published one stops being true once calibrated.
_PAPER_CLAIM = re.compile(r"paper|publish|default", re.IGNORECASE)


def edited_policy_text(text: str, file: Path, key: str, value: float | int, note: str | None = None) -> str:
    """`text` with `[policy] key = value`; `note` becomes the line's comment when the key is
    new or its comment claims the old value was the paper's, else the comment is kept."""
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise UsageError(f"{file}: cannot edit: TOML syntax error: {exc}") from None
    policy = doc.get("policy")
    if not isinstance(policy, MutableMapping):  # a [policy] table, dotted policy.* keys or an inline table
        raise UsageError(f"{file}: has no [policy] table to write {key} into")
    old = policy.get(key)
    old_comment = old.trivia.comment if isinstance(old, tomlkit.items.Item) else ""
    item = tomlkit.item(value)
    policy[key] = item  # keeps the old line's indent, spacing and comment
    if note and (old is None or _PAPER_CLAIM.search(old_comment or "")) and not isinstance(
            policy, tomlkit.items.InlineTable):  # an inline table has no room for a comment
        trivia = item.trivia
        trivia.comment_ws = trivia.comment_ws or "  "
        trivia.comment = f"# {note}"
    return tomlkit.dumps(doc)


def write_policy_option(file: Path, key: str, value: float | int, note: str | None = None,
                        validate: Callable[[str], None] | None = None) -> None:
    """Set `[policy] key = value` in `file`; `validate(new_text)` may raise to refuse the
    edit before the file is touched."""
    try:
        with open(file, encoding="utf-8", newline="") as fh:  # newline="": CRLF files stay CRLF
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{file}: cannot read the profile to edit it: {exc}") from None
    new_text = edited_policy_text(text, Path(file), key, value, note)
    if validate is not None:
        validate(new_text)
    try:
        _replace(Path(file), new_text)
    except OSError as exc:
        raise UsageError(f"{file}: cannot write the profile: {exc.strerror or exc}") from None


def _replace(file: Path, text: str) -> None:
    """Replace the profile whole (atomic_files.py), keeping its permissions."""
    write_text(file, text)
