"""How a policy declares its options (OptionSpec), the options every policy shares, and the
small helpers policies use on their options and learned state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class OptionSpec:
    types: tuple[type, ...]
    default: Any
    check: Callable[[Any], bool] = lambda value: True
    requirement: str = ""
    help: str = ""


def one_of(*values: str) -> Callable[[Any], bool]:
    return lambda value: value in values


def option_problems(specs: Mapping[str, OptionSpec], options: Mapping[str, Any], policy: str) -> list[tuple[str, str]]:
    """(option, message) for each of `options` that policy `policy` (declaring `specs`) does
    not know, or whose value has the wrong type or fails its check."""
    problems = []
    for opt, value in options.items():
        spec = specs.get(opt)
        if spec is None:
            problems.append((opt, f'unknown option for policy "{policy}"; its options: {", ".join(specs)}'))
        elif (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types):
            expected = " or ".join(t.__name__ for t in spec.types)
            problems.append((opt, f"expected {expected}, got {type(value).__name__}"))
        elif not spec.check(value):
            problems.append((opt, f"{spec.requirement} (got {value!r})"))
    return problems


def scaled(value: Any, factor: float) -> Any:
    """Every number in `value` (a number or nested lists of them) times `factor`."""
    if isinstance(value, list):
        return [scaled(v, factor) for v in value]
    return value * factor


COMMON_OPTIONS: dict[str, OptionSpec] = {
    "reset": OptionSpec((str,), "carry", one_of("prompt", "carry", "never"), 'must be "prompt", "carry" or "never"',
                        "before each prompt: forget what was learned (the papers), carry it over worth "
                        "a few rounds, or keep learning as if the prompts were one"),
    "evaluate": OptionSpec((str,), "chosen", one_of("all", "chosen"), 'must be "all" or "chosen"',
                           "score every drafter on the verified text each round (full information)"),
    "objective": OptionSpec((str,), "goodput", one_of("goodput", "acceptance"), 'must be "goodput" or "acceptance"',
                            "learn on estimated tokens per second, or on accepted tokens (the papers' objective)"),
    "allow_none": OptionSpec((bool,), True, help='the "none" arm: plain decoding for a round, when nothing pays off'),
    "draft_length": OptionSpec((str,), "goodput", one_of("fixed", "goodput"), 'must be "fixed" or "goodput"',
                               "draft K tokens every round, or the K in 0..K with the best estimated tokens/s"),
    "tree": OptionSpec((bool,), True,
                       help='with evaluate = "all" and the goodput objective: add other drafters\' chains to the '
                            "chosen one's as a token tree, verified in one forward, when that is estimated to pay"),
    "runner_ups": OptionSpec((bool,), True,
                             help="with tree = true: model and head drafters' runner-up tokens (the next-ranked "
                                  "at a drafted position) as leaves beside their chains, when estimated to pay"),
}
