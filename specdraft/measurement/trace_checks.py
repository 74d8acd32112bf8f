"""Checking a trace file read back (`bench --replay`, `calibrate-beta --trace`): a trace is
untrusted input, so every field is checked for its type, its range and its agreement with
the header before replay allocates or enumerates anything from it.

What is checked: the header is an object of this trace version; the draft length and the
token budget are within what a profile allows; drafter names are unique non-empty strings
with one kind each; every cost is a finite non-negative number (a by-width curve of at most
the draft length + 1 positive ones) and the target's is not zero; each prompt's lanes are
exactly the header's drafters, each as long as the prompt's tokens, with drafted counts
within the draft length, runs within what was drafted, and alignments finite in [0, 1].
Each problem is a ValueError naming the line and the field.
"""

from __future__ import annotations

from typing import Any

from specdraft.learning.goodput import is_number

MAX_DRAFT_TOKENS = 64  # the profile's own bound on draft_tokens (profile.py)
MAX_NEW_TOKENS = 1 << 20
MAX_DRAFTERS = 256


def checked_header(row: Any) -> dict:
    """The header line's fields, checked; its costs still plain objects."""
    _object(row, "the header")
    draft_tokens = _count(row.get("draft_tokens"), "draft_tokens", 1, MAX_DRAFT_TOKENS)
    _count(row.get("max_new_tokens"), "max_new_tokens", 1, MAX_NEW_TOKENS)
    drafters, kinds = row.get("drafters"), row.get("kinds")
    if not (isinstance(drafters, list) and 0 < len(drafters) <= MAX_DRAFTERS
            and all(isinstance(d, str) and d for d in drafters)):
        raise ValueError(f"drafters: expected a list of 1 to {MAX_DRAFTERS} names")
    if len(set(drafters)) != len(drafters):
        raise ValueError("drafters: a name appears twice")
    if not (isinstance(kinds, list) and len(kinds) == len(drafters) and all(isinstance(k, str) for k in kinds)):
        raise ValueError("kinds: expected one kind per drafter")
    own = row.get("scored_by_own_forward")
    if own is not None and not (isinstance(own, list) and len(own) == len(drafters)
                                and all(isinstance(v, bool) for v in own)):
        raise ValueError("scored_by_own_forward: expected one true or false per drafter")
    if not isinstance(row.get("profile", ""), str):
        raise ValueError("profile: expected a string")
    costs = row.get("costs")
    _object(costs, "costs")
    for name in ("target", *drafters):
        if name not in costs:
            raise ValueError(f"costs: no cost for {name}")
    for name, cost in costs.items():
        _cost(cost, f"costs.{name}", draft_tokens + 1)
    target = costs["target"]
    if target["fixed"] + target["per_token"] <= 0 and not any(target.get("by_width") or ()):
        raise ValueError("costs.target: a forward of the target costs nothing")
    return row


def checked_prompt(row: Any, line: int, drafters: list[str], draft_tokens: int) -> dict:
    """One prompt line's fields, checked against the header's drafters and draft length."""
    where = f"line {line}"
    _object(row, where)
    if not isinstance(row.get("id"), str) or not isinstance(row.get("task"), str):
        raise ValueError(f"{where}: id and task must be strings")
    _count(row.get("prompt_tokens"), f"{where}: prompt_tokens", 0, 1 << 40)
    tokens = row.get("tokens")
    if not (isinstance(tokens, list) and len(tokens) <= MAX_NEW_TOKENS
            and all(_is_int(t) and t >= 0 for t in tokens)):
        raise ValueError(f"{where}: tokens must be a list of token ids")
    lanes = row.get("drafters")
    _object(lanes, f"{where}: drafters")
    if sorted(lanes) != sorted(drafters):
        raise ValueError(f"{where}: its drafters ({', '.join(sorted(lanes))}) are not the header's "
                         f"({', '.join(sorted(drafters))})")
    n = len(tokens)
    for name, lane in lanes.items():
        _lane(lane, f"{where}: drafter {name}", n, draft_tokens)
    return row


def _lane(lane: Any, where: str, n: int, draft_tokens: int) -> None:
    _object(lane, where)
    fields = {key: lane.get(key) for key in ("alpha", "drafted", "run", "span")}
    if set(lane) != set(fields) or not all(isinstance(v, list) and len(v) == n for v in fields.values()):
        raise ValueError(f"{where}: expected alpha, drafted, run and span, one entry per generated token")
    if not all(_probability(a) for a in fields["alpha"]):
        raise ValueError(f"{where}: alpha must be numbers in [0, 1]")
    for t, (drafted, run, span) in enumerate(zip(fields["drafted"], fields["run"], fields["span"])):
        if not (_is_int(drafted) and 0 <= drafted <= draft_tokens):
            raise ValueError(f"{where}: drafted[{t}] must be a count from 0 to {draft_tokens}")
        if not (_is_int(run) and 0 <= run <= drafted):
            raise ValueError(f"{where}: run[{t}] must be a count from 0 to drafted[{t}]")
        if not (isinstance(span, list) and len(span) <= drafted and all(_probability(a) for a in span)):
            raise ValueError(f"{where}: span[{t}] must be at most drafted[{t}] numbers in [0, 1]")


def _cost(cost: Any, where: str, widths: int) -> None:
    _object(cost, where)
    if set(cost) - {"fixed", "per_token", "by_width"} or not {"fixed", "per_token"} <= set(cost):
        raise ValueError(f"{where}: expected fixed, per_token and optionally by_width")
    for key in ("fixed", "per_token"):
        if not _seconds(cost[key]):
            raise ValueError(f"{where}.{key}: expected a finite number of seconds >= 0")
    by_width = cost.get("by_width")
    if by_width is not None and not (isinstance(by_width, list) and 0 < len(by_width) <= widths
                                     and all(_seconds(s) and s > 0 for s in by_width)):
        raise ValueError(f"{where}.by_width: expected 1 to {widths} finite positive seconds")


def _object(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object")


def _count(value: Any, where: str, low: int, high: int) -> int:
    if not (_is_int(value) and low <= value <= high):
        raise ValueError(f"{where}: expected a whole number from {low} to {high}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(value: Any) -> bool:
    return is_number(value) and 0 <= value < 1e6


def _probability(value: Any) -> bool:
    return is_number(value) and 0.0 <= value <= 1.0
