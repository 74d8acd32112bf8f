"""Offline replay: any policy run over a recorded trace, without a model, in milliseconds.

Under greedy decoding the committed text does not depend on the drafters, so a round is
fully described by the trace: the drafter chosen at position t drafts `drafted[t]` tokens
(capped by K and the remaining budget), gets its `run[t]` accepted, and the round commits
accepted + 1 tokens. Feedback mirrors the live engine's: the chosen drafter's per-position
alignment, every drafter's gamma at the committed positions under full information
(batched the way the policy asks), and a simulated round cost from the measured forward
costs. BE rewards and full-information losses replay exactly; BD rewards past the first
rejected position use the teacher-forced alignment, an approximation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.feedback import RegretTracker
from specdraft.policies import build_policy, option_value
from specdraft.policies.base import RoundFeedback
from specdraft.profile import PolicyConfig
from specdraft.trace import PromptTrace, Trace


@dataclass
class ReplayResult:
    id: str
    task: str
    tokens: int
    rounds: int
    simulated_s: float
    plain_simulated_s: float
    chosen: list[int] = field(default_factory=list)
    regret: float | None = None
    best_drafter: str | None = None
    best_arm_share: float | None = None
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times drafted

    @property
    def mean_accepted(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def simulated_speedup(self) -> float:
        return self.plain_simulated_s / self.simulated_s if self.simulated_s else 0.0


def replay(trace: Trace, config: PolicyConfig, seed: int = 0) -> list[ReplayResult]:
    head = trace.header
    arms = list(head.drafters)
    if option_value(config, "allow_none") and "none" not in arms:
        arms.append("none")
    policy = build_policy(config, arms, seed=seed, draft_tokens=head.draft_tokens, horizon=head.max_new_tokens)
    evaluate_all = option_value(config, "evaluate") == "all"
    keep_learning = option_value(config, "reset") == "never"
    results = []
    for prompt in trace.prompts:
        if not keep_learning:
            policy.reset()
        results.append(_replay_prompt(trace, prompt, policy, arms, evaluate_all))
    return results


def _replay_prompt(trace: Trace, prompt: PromptTrace, policy, arms: list[str], evaluate_all: bool) -> ReplayResult:
    head = trace.header
    k_max, total = head.draft_tokens, len(prompt.tokens)
    target = head.costs["target"]
    result = ReplayResult(prompt.id, prompt.task, total, 0, 0.0, total * target(1),
                          accepted_at=[0] * k_max, drafted_at=[0] * k_max)
    tracker = RegretTracker(arms) if evaluate_all else None
    pending: list[tuple[RoundFeedback, int, int]] = []
    position = 0
    while position < total:
        arm = policy.select()
        lane = prompt.drafters.get(arms[arm])
        k = min(k_max, head.max_new_tokens - position - 1)
        drafted = min(lane.drafted[position], k) if lane else 0
        accepted = min(lane.run[position], drafted) if lane else 0
        count = min(accepted + 1, total - position)
        alphas = lane.span[position][:drafted] if lane else []
        seconds = target(drafted + 1) + _draft_seconds(head, arms[arm], drafted)
        feedback = RoundFeedback(arm, drafted, accepted, alphas, seconds)
        result.rounds += 1
        result.chosen.append(arm)
        for j in range(drafted):
            result.drafted_at[j] += 1
            result.accepted_at[j] += j < accepted
        if evaluate_all:
            pending.append((feedback, position, count))
            result.simulated_s += seconds + sum(
                head.costs[name](count) for i, name in enumerate(arms) if i != arm and name in head.costs and name in prompt.drafters
            )
            if position + count >= total or len(pending) >= policy.evaluation_interval():
                for fb, start, n in pending:
                    gammas = [_gammas(prompt, name, start, n) for name in arms]
                    tracker.add_round(fb.arm, gammas, k_max)
                    policy.update(RoundFeedback(fb.arm, fb.drafted, fb.accepted, fb.alphas, fb.round_seconds, gammas))
                pending = []
        else:
            result.simulated_s += seconds
            policy.update(feedback)
        position += count
    if tracker is not None:
        result.regret, result.best_arm_share = tracker.regret, tracker.best_arm_share
        result.best_drafter = arms[tracker.best]
    return result


def _gammas(prompt: PromptTrace, name: str, start: int, count: int) -> list[float]:
    lane = prompt.drafters.get(name)
    return lane.alpha[start : start + count] if lane else [0.0] * count


def _draft_seconds(head, name: str, drafted: int) -> float:
    cost = head.costs.get(name)
    if cost is None or drafted == 0:
        return 0.0
    return cost(1) * drafted  # one catch-up forward of about one token, then drafted - 1 single steps
