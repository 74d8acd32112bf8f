"""What a scored round was worth in the objective a policy optimises (ARCHITECTURE.md,
"Feedback"): the per-round values the regret against the best fixed drafter sums
(`RegretTracker`), and the draft length a drafter is judged at on a scored chunk, which the
goodput losses of the hedge learners use too.

- `objective = "acceptance"`: a drafter's expected accepted length over the first K
  positions, in "tokens" (HedgeSpec's EAL).
- `objective = "goodput"`: the round's expected committed tokens at the judged draft length
  k over `T(arm, k)` from the policy's own round cost model (`RoundCostModel`, the one that
  plans K), in "tok/s": a drafter that accepts more but costs far more is worth less.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from specdraft.learning.feedback import expected_accept_length

if TYPE_CHECKING:
    from specdraft.learning.policies.base import Policy

REGRET_UNITS = {"acceptance": "tokens", "goodput": "tok/s"}  # objective -> unit of a round's value


def value_unit(policy: "Policy") -> str:
    """The unit of `round_value` for `policy`, and of its regret."""
    return REGRET_UNITS["goodput" if policy.goodput else "acceptance"]


def judged_length(policy: "Policy", arm: int, chunk: int) -> int:
    """The draft length `arm` is judged at on a scored chunk of `chunk` committed positions:
    its best K, at most the chunk (positions past it are censored). Judged at its best K but
    credited for at most the chunk, a drafter would look slow whenever the chosen arm
    commits short chunks (a plain round's one token), and a cheap arm would lock the learner in."""
    return min(policy.best_length(arm, policy.draft_tokens), chunk)


def round_value(policy: "Policy", arm: int, gammas: Sequence[float] | None) -> float | None:
    """What `arm` earned on a scored round whose committed positions it aligns with as
    `gammas`, in `value_unit(policy)`; None when it was not scored (skipped), or under
    goodput while its cost is unknown (it has not drafted yet)."""
    if gammas is None:
        return None
    if not policy.goodput:
        return expected_accept_length(gammas[: policy.draft_tokens])
    k = judged_length(policy, arm, len(gammas))
    seconds = policy.costs.round_seconds(arm, k)
    if seconds is None or seconds <= 0:
        return None
    return expected_accept_length(gammas[:k]) / seconds


def round_values(policy: "Policy", gammas: Sequence[Sequence[float] | None]) -> list[float | None]:
    """`round_value` of every arm on one scored round. An arm with None earns nothing in the
    regret: a drafter is ranked on what was measured (RegretTracker)."""
    return [round_value(policy, arm, g) for arm, g in enumerate(gammas)]
