"""What a round was worth in the objective a policy optimises (ARCHITECTURE.md, "Feedback"),
from the estimates of the round planner (`learning/planner.py`, the one that plans K):

- the bandit reward of the chosen drafter's round (`chosen_reward`) and the speed score the
  hedge learners' goodput losses are built on (`speed_score`);
- the draft length a drafter is judged at on a scored chunk (`judged_length`);
- the per-round values the regret against the best fixed drafter sums (`RegretTracker`):
  under `objective = "acceptance"` a drafter's expected accepted length over the first K
  positions, in "tokens" (HedgeSpec's EAL); under `objective = "goodput"` the round's
  expected committed tokens at the judged draft length k over the planner's `T(arm, k)`,
  in "tok/s": a drafter that accepts more but costs far more is worth less.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from specdraft.learning.feedback import RoundFeedback, bd_reward, be_reward, expected_accept_length

if TYPE_CHECKING:
    from specdraft.learning.planner import RoundPlanner

REGRET_UNITS = {"acceptance": "tokens", "goodput": "tok/s"}  # objective -> unit of a round's value


def value_unit(planner: "RoundPlanner") -> str:
    """The unit of `round_value` under `planner`'s objective, and of the regret."""
    return REGRET_UNITS["goodput" if planner.goodput else "acceptance"]


def speed_score(planner: "RoundPlanner", arm: int, expected_tokens: float, k: int) -> float:
    """Estimated speedup over plain decoding of a round of `arm` drafting `k` tokens that
    commits `expected_tokens`, scaled into [0, 1] by the most a round can commit (K + 1);
    tokens over K + 1 while costs are unknown."""
    value = planner.speedup(arm, expected_tokens, k)
    if value is None:
        value = expected_tokens
    return min(1.0, value / (planner.draft_tokens + 1))


def chosen_reward(planner: "RoundPlanner", fb: RoundFeedback, kind: str = "bd") -> float:
    """Bandit reward in [0, 1] for the chosen arm: BD or BE (`kind`), or with the goodput
    objective the round's estimated speedup over plain decoding, over K + 1."""
    if not planner.goodput:
        return be_reward(fb.accepted, fb.drafted) if kind == "be" else bd_reward(fb.alphas)
    expected = fb.accepted + 1 if kind == "be" else expected_accept_length(fb.alphas)
    return speed_score(planner, fb.arm, expected, fb.drafted)


def judged_length(planner: "RoundPlanner", arm: int, chunk: int) -> int:
    """The draft length `arm` is judged at on a scored chunk of `chunk` committed positions:
    its best K, at most the chunk (positions past it are censored). Judged at its best K but
    credited for at most the chunk, a drafter would look slow whenever the chosen arm
    commits short chunks (a plain round's one token), and a cheap arm would lock the learner in."""
    return min(planner.best_length(arm, planner.draft_tokens), chunk)


def round_value(planner: "RoundPlanner", arm: int, gammas: Sequence[float] | None) -> float | None:
    """What `arm` earned on a scored round whose committed positions it aligns with as
    `gammas`, in `value_unit(planner)`; None when it was not scored (skipped), or under
    goodput while its cost is unknown (it has not drafted yet)."""
    if gammas is None:
        return None
    if not planner.goodput:
        return expected_accept_length(gammas[: planner.draft_tokens])
    k = judged_length(planner, arm, len(gammas))
    seconds = planner.costs.round_seconds(arm, k)
    if seconds is None or seconds <= 0:
        return None
    return expected_accept_length(gammas[:k]) / seconds


def round_values(planner: "RoundPlanner", gammas: Sequence[Sequence[float] | None]) -> list[float | None]:
    """`round_value` of every arm on one scored round. An arm with None earns nothing in the
    regret: a drafter is ranked on what was measured (RegretTracker)."""
    return [round_value(planner, arm, g) for arm, g in enumerate(gammas)]
