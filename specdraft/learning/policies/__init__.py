"""Drafter-selection policies: the registry from profile names to classes, option checks
that return problems (the profile turns them into key-path errors), and construction."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.policies.bandits import DiscountedUCBPolicy, Exp3Policy, SlidingWindowUCBPolicy, UCBPolicy
from specdraft.learning.policies.base import COMMON_OPTIONS, OptionSpec, Policy
from specdraft.learning.policies.halving import HalvingPolicy
from specdraft.learning.policies.hedge import AdaNormalHedgePolicy, HedgePolicy, NormalHedgePolicy
from specdraft.learning.policies.simple import FixedPolicy, RandomPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (FixedPolicy, RandomPolicy, UCBPolicy, Exp3Policy, HalvingPolicy, DiscountedUCBPolicy,
                SlidingWindowUCBPolicy, NormalHedgePolicy, HedgePolicy, AdaNormalHedgePolicy)
}

__all__ = ["POLICIES", "COMMON_OPTIONS", "Policy", "RoundFeedback", "OptionSpec", "build_policy", "check_policy",
           "option_value"]

Problem = tuple[str, str]  # (option name, or "name" for the policy's name; message)


def check_policy(name: str, options: Mapping[str, Any], drafters: Sequence[str]) -> list[Problem]:
    """Everything wrong with policy `name` and its `options` over a pool of `drafters` (names)."""
    cls = POLICIES.get(name)
    if cls is None:
        return [("name", f'unknown policy "{name}"; expected one of {", ".join(POLICIES)}')]
    infinite = [(key, f"must be a finite number, not {value}") for key, value in options.items()
                if isinstance(value, float) and not math.isfinite(value)]
    return infinite or cls.check_options(options, drafters)


def option_value(name: str, options: Mapping[str, Any], option: str) -> Any:
    """`option` as policy `name` would see it: given, else its default."""
    specs = POLICIES[name].all_options()
    return options.get(option, specs[option].default if option in specs else None)


def build_policy(name: str, options: Mapping[str, Any], arms: Sequence[str], seed: int | None = None,
                 draft_tokens: int = 5, horizon: int = 256) -> Policy:
    return POLICIES[name](arms, dict(options), seed=seed, draft_tokens=draft_tokens, horizon=horizon)
