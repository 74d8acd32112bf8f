"""What a round reports (`RoundRecord`): what it committed, and in three parts what it cost
(`RoundTimes`), what the policy planned and learned from it (`RoundLearning`) and, in a tree
round, how its branches fared (`RoundTree`). The engine yields one per round; statistics,
panels, traces and JSON records read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.learning.driver import Gammas


@dataclass
class RoundTimes:
    """Seconds of the round's phases, and on a prompt's first round its prefill."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0  # choosing, committing, policy updates: everything but the three phases
    evaluate_s: float = 0.0
    # On a prompt's first round: its prefill (the target's, and under full information the
    # drafters' scored from the first round on) and the prompt tokens the target fed.
    prefill_s: float = 0.0
    prefill_tokens: int = 0


@dataclass
class RoundLearning:
    """What the policy planned for the round and what finished learning in it."""

    planned: int = 0  # the draft length the policy chose
    expected_tokens: float | None = None  # the policy's estimate of what the round commits ...
    expected_seconds: float | None = None  # ... and of how long it takes (None while unknown)
    # Rounds whose evaluation finished in this round, as (chosen arm, gammas): this round
    # alone, or several when the policy batches evaluation every m rounds.
    evaluated: list[tuple[int, Gammas]] | None = None
    # For each of those rounds, what every arm earned in the policy's objective (None: not
    # scored), in `value_unit` ("tokens" or "tok/s"): what the regret tracker sums.
    values: list[list[float | None]] | None = None
    value_unit: str = "tokens"

    @property
    def gammas(self) -> Gammas | None:
        """This round's gammas per drafter and committed position, if evaluated now (it is
        always the last of the rounds evaluated together)."""
        return self.evaluated[-1][1] if self.evaluated else None


@dataclass
class RoundTree:
    """The chains the verify checked: one in a chain round, several in a tree round."""

    # The drafters whose chains the verify checked, the chosen one first, each as (name,
    # tokens drafted, tokens of them committed); more than one in a tree round.
    branches: list[tuple[str, int, int]] | None = None
    tree_size: int = 0  # drafted tokens the verify checked (shared prefixes counted once)
    winner: str | None = None  # the drafter whose chain the committed tokens followed furthest
    runner_ups: list[tuple[str, int]] = field(default_factory=list)  # (drafter, its runner-up leaves verified)
    runner_up_won: str | None = None  # the drafter whose runner-up leaf the committed tokens ended on


@dataclass
class RoundRecord:
    arm: int
    drafter: str
    drafted: int  # tokens drafted (at most `learning.planned`: a drafter may stop early)
    accepted: int  # drafted tokens accepted; the round commits accepted + 1 before truncation
    tokens: list[int]  # committed this round (cut at EOS or at max_new_tokens)
    alphas: list[float]  # 1 - TV(p_j, q_j) per drafted position
    finish: str | None = None  # "eos" or "length" on the last round
    verify_width: int = 0  # tokens the verify forward ran over (drafted + 1, or padded wider)
    times: RoundTimes = field(default_factory=RoundTimes)
    learning: RoundLearning = field(default_factory=RoundLearning)
    tree: RoundTree = field(default_factory=RoundTree)
