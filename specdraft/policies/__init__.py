"""Drafter-selection policies: a registry from profile names to classes, and option validation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from specdraft.errors import ProfileError
from specdraft.policies.bandits import DiscountedUCBPolicy, Exp3Policy, SlidingWindowUCBPolicy, UCBPolicy
from specdraft.policies.base import OptionSpec, Policy, RoundFeedback
from specdraft.policies.halving import HalvingPolicy
from specdraft.policies.hedge import AdaNormalHedgePolicy, HedgePolicy, NormalHedgePolicy
from specdraft.policies.simple import FixedPolicy, RandomPolicy

if TYPE_CHECKING:
    from specdraft.profile import PolicyConfig, Profile

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (FixedPolicy, RandomPolicy, UCBPolicy, Exp3Policy, HalvingPolicy, DiscountedUCBPolicy,
                SlidingWindowUCBPolicy, NormalHedgePolicy, HedgePolicy, AdaNormalHedgePolicy)
}

__all__ = ["POLICIES", "Policy", "RoundFeedback", "OptionSpec", "build_policy", "validate_policy", "option_value"]


def validate_policy(config: "PolicyConfig", profile: "Profile", key: str) -> None:
    """Check the policy name, its options' types and ranges, and drafter references."""
    file = str(profile.file)
    cls = POLICIES.get(config.name)
    if cls is None:
        raise ProfileError(file, f"{key}.name" if key == "policy" else key,
                           f'unknown policy "{config.name}"; expected one of {", ".join(POLICIES)}')
    where = (lambda opt: f"{key}.{opt}") if key == "policy" else (lambda opt: f"{key} ({config.name}.{opt})")
    specs = cls.all_options()
    for opt, value in config.options.items():
        spec = specs.get(opt)
        if spec is None:
            known = ", ".join(specs)
            raise ProfileError(file, where(opt), f'unknown option for policy "{config.name}"; its options: {known}')
        if (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types):
            expected = " or ".join(t.__name__ for t in spec.types)
            raise ProfileError(file, where(opt), f"expected {expected}, got {type(value).__name__}")
        if not spec.check(value):
            raise ProfileError(file, where(opt), f"{spec.requirement} (got {value!r})")
    if not profile.drafters:
        raise ProfileError(file, "drafters", "the pool is empty: add at least one [[drafters]] table")
    if cls.FULL_INFORMATION and option_value(config, "evaluate") != "all":
        raise ProfileError(file, where("evaluate"),
                           f'policy "{config.name}" learns from every drafter each round: set evaluate = "all"')
    drafter = config.options.get("drafter")
    if config.name == "fixed" and drafter is None and len(profile.drafters) > 1:
        raise ProfileError(file, where("drafter"), "fixed needs drafter = the name of one drafter in the pool")
    if drafter is not None and profile.drafter_index(drafter) is None and not (
        drafter == "none" and option_value(config, "allow_none")
    ):
        names = ", ".join(d.name for d in profile.drafters)
        raise ProfileError(file, where("drafter"), f'no drafter named "{drafter}"; the pool has {names}')


def option_value(config: "PolicyConfig", name: str) -> Any:
    specs = POLICIES[config.name].all_options()
    return config.options.get(name, specs[name].default if name in specs else None)


def build_policy(config: "PolicyConfig", arms: Sequence[str], seed: int | None = None,
                 draft_tokens: int = 5, horizon: int = 256) -> Policy:
    return POLICIES[config.name](arms, dict(config.options), seed=seed, draft_tokens=draft_tokens, horizon=horizon)
