"""The round planner's learned parts as JSON (ARCHITECTURE.md, "Goodput"): the round cost
model, acceptance by position and acceptance by match length, saved beside a policy's own
state (`--policy-state`) and checked before anything is loaded. Plain Python: no torch."""

from __future__ import annotations

import copy

from specdraft.learning.goodput import AcceptanceByPosition, RoundCostModel
from specdraft.learning.match_length import MatchAcceptance

FIELDS = ("costs", "acceptance", "match_acceptance")


def learned_state(costs: RoundCostModel, acceptance: AcceptanceByPosition, by_match: MatchAcceptance) -> dict:
    """What a planner learned, as JSON fields of a saved policy state."""
    return {"costs": costs.state(), "acceptance": acceptance.state(), "match_acceptance": by_match.state()}


def checked_state(state: dict, arms: int, draft_tokens: int) -> dict:
    """The planner's fields of a saved `state` for `arms` arms drafting at most
    `draft_tokens`, a private copy; ValueError on garbage. A state saved before
    "match_acceptance" existed loads without it (learned afresh), and one saved before the
    round cost model (its "costs" a list of per-arm seconds) keeps its acceptance: the
    costs are measured again."""
    mine = {key: copy.deepcopy(state[key]) for key in FIELDS if key in state}
    if isinstance(mine.get("costs"), list):
        del mine["costs"]
    apply_state(mine, RoundCostModel(arms), AcceptanceByPosition(arms, draft_tokens),
                MatchAcceptance(arms, draft_tokens))
    return mine


def apply_state(state: dict, costs: RoundCostModel, acceptance: AcceptanceByPosition,
                by_match: MatchAcceptance) -> None:
    """Load each field `state` has into its part (ValueError naming the field on garbage)."""
    for key, part in zip(FIELDS, (costs, acceptance, by_match)):
        if key in state:
            if not isinstance(state[key], dict):
                raise ValueError(f"state field {key}: expected an object")
            part.load(state[key])
