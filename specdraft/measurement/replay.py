"""Offline replay: any policy run over a recorded trace, without a model, in milliseconds.

Under greedy decoding the committed text does not depend on the drafters, so a round is
fully described by the trace: the drafter chosen at position t drafts `drafted[t]` tokens
(capped by the draft length the driver allows), gets its `run[t]` accepted, and the round
commits accepted + 1 tokens. The policy is driven by the same PolicyDriver as live
decoding; full-information evaluation reads the trace's teacher-forced gammas, and round
costs are simulated from the measured forward costs. BE rewards and full-information
losses replay exactly; BD rewards past the first rejected position use the teacher-forced
alignment, an approximation. A plan with branches (a token tree) replays each branch's
lane the same way: the round commits the longest run + 1, and its verify covers the
committed path once plus every chain's rejected tokens (chains are taken to part wherever
they are wrong, as the tree planner assumes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdraft.profile import PolicyConfig
from specdraft.learning.driver import Gammas, PolicyDriver, RoundOutcome
from specdraft.learning.feedback import RegretTracker, RoundFeedback
from specdraft.learning.policies import build_policy, option_value
from specdraft.learning.planner import PLAIN_ARM, pool_arms
from specdraft.learning.policies.objective import value_unit
from specdraft.measurement.hindsight import Option, best_rate
from specdraft.measurement.traces import PromptTrace, Trace, TraceHeader


@dataclass
class ReplayResult:
    id: str
    task: str
    tokens: int
    rounds: int
    simulated_s: float
    plain_simulated_s: float
    regret: float | None = None
    best_drafter: str | None = None
    best_arm_share: float | None = None
    regret_unit: str | None = None  # "tokens" or "tok/s": the policy's objective (RegretTracker)
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times drafted
    # Token trees, as a live run's Sample counts them: rounds with several chains, chains in
    # all rounds, and per drafter the tree rounds it drafted a branch in and those it won.
    tree_rounds: int = 0
    branches: int = 0
    branched: dict[str, int] = field(default_factory=dict)
    won: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per round, the bonus token included (mean accepted tokens)."""
        return self.tokens / self.rounds if self.rounds else 0.0


def replay(trace: Trace, config: PolicyConfig, seed: int = 0) -> list[ReplayResult]:
    """Replay the policy `config` over every prompt of `trace`."""
    head = trace.header
    # The trace's pool, then the plain arm if this policy has one (whether or not the
    # recording run had it), exactly as the runtime builds the arms of a live run.
    arms = pool_arms(head.drafters, bool(option_value(config.name, config.options, "allow_none")))
    policy = build_policy(config.name, config.options, arms, seed=seed, draft_tokens=head.draft_tokens,
                          horizon=head.max_new_tokens)
    driver = PolicyDriver(policy, head.draft_tokens, head.max_new_tokens)
    return [_replay_prompt(head, prompt, driver, arms) for prompt in trace.prompts]


def _replay_prompt(head: TraceHeader, prompt: PromptTrace, driver: PolicyDriver, arms: list[str]) -> ReplayResult:
    total, target = len(prompt.tokens), head.costs["target"]
    result = ReplayResult(prompt.id, prompt.task, total, 0, 0.0, total * target(1),
                          accepted_at=[0] * head.draft_tokens, drafted_at=[0] * head.draft_tokens)
    tracker = RegretTracker(arms, value_unit(driver.planner)) if driver.full_information else None
    driver.start_prompt(_TraceEvaluator(prompt, arms) if driver.full_information else None)
    position = 0
    while position < total:
        awake = _awake(prompt, arms, position) if driver.wants_awake else None
        plan = driver.choose(position, awake)  # no early stop here: a trace has no drafter confidences
        arm, k = plan.arm, plan.draft_tokens
        chains = [_replayed_chain(head, prompt, arms, a, depth, position) for a, depth in ((arm, k), *plan.branches)]
        drafted, accepted, draft_s = chains[0]
        longest = max(run for _, run, _ in chains)
        count = min(longest + 1, total - position)
        width = 1 + longest + sum(d - run for d, run, _ in chains)
        verify_s = target(width)
        seconds = verify_s + sum(cost for _, _, cost in chains)
        lane = prompt.drafters.get(arms[arm])
        feedback = RoundFeedback(arm, drafted, accepted, lane.span[position][:drafted] if lane else [], seconds,
                                 draft_seconds=draft_s, verify_seconds=verify_s, verify_width=width,
                                 silent=None if awake is None else [not a for a in awake],
                                 branch_drafts=tuple((a, d, cost) for (a, _), (d, _, cost)
                                                     in zip(plan.branches, chains[1:])))
        learned = driver.finish_round(RoundOutcome(feedback, position, count), last=position + count >= total)
        result.simulated_s += seconds
        if driver.full_information:  # every other drafter scored by its own forward catches up on the chunk
            result.simulated_s += sum(head.costs[name](count) for i, name in enumerate(arms)
                                      if i != arm and name in head.costs and name in prompt.drafters
                                      and head.catches_up(name))
        for (chosen, _), values in zip(learned.evaluated, learned.values, strict=True):
            tracker.add(chosen, values)
        result.rounds += 1
        _count_tree(result, [arms[a] for a, _ in ((arm, k), *plan.branches)], [run for _, run, _ in chains])
        for j in range(drafted):
            result.drafted_at[j] += 1
            result.accepted_at[j] += j < accepted  # the chosen drafter's own tokens
        position += count
    if tracker is not None:
        result.regret, result.best_arm_share = tracker.regret, tracker.best_arm_share
        result.best_drafter, result.regret_unit = arms[tracker.best], tracker.unit
    return result


@dataclass(frozen=True)
class Hindsight:
    """The best rounds of a task in hindsight (`measurement/hindsight.py`) at the replay's
    costs, as speedups over plain decoding: each drafter alone and the whole pool."""

    task: str
    drafters: dict[str, float]
    pool: float

    @property
    def best(self) -> str:
        return max(self.drafters, key=self.drafters.get)

    def as_dict(self) -> dict:
        best = self.best
        return {"task": self.task, "drafters": self.drafters, "pool": self.pool, "best_drafter": best,
                "pool_over_best": self.pool / self.drafters[best] if self.drafters[best] else None}


def hindsight(trace: Trace) -> list[Hindsight]:
    """Per task, then over every prompt ("all"): what choosing every round's drafter and
    draft length knowing its outcome would give, each drafter alone and the pool. A round
    that drafts k of a lane's tokens costs a verify of k + 1 and the drafter's k tokens, as
    replayed; a tree commits one chain's run + 1 at a verify at least as wide and pays every
    chain's drafting, so the pool's figure bounds every policy the replay runs."""
    names = [name for name in trace.header.drafters if name != PLAIN_ARM]
    tasks = list(dict.fromkeys(p.task for p in trace.prompts))
    plain = trace.header.costs["target"](1)
    out = []
    for task in [*tasks, "all"] if len(tasks) > 1 else ["all"]:
        prompts = [p for p in trace.prompts if task == "all" or p.task == task]

        def speedup(members: list[str], at_least: float = 0.0) -> float:
            options = [(len(p.tokens), _options(trace.header, p, members)) for p in prompts]
            return plain * best_rate(options, at_least / plain)

        alone = {name: speedup([name]) for name in names}
        out.append(Hindsight(task, alone, speedup(names, max(alone.values(), default=0.0))))
    return out


def _options(head: TraceHeader, prompt: PromptTrace, members: list[str]):
    """A round's options at a position: plain decoding, or a member drafting k = 1 .. what its
    lane drafted there."""
    target = head.costs["target"]
    lanes = [(name, prompt.drafters[name]) for name in members if name in prompt.drafters]

    def at(position: int) -> list[Option]:
        options = [(1, target(1))]
        for name, lane in lanes:
            run = lane.run[position]
            options += [(min(run, k) + 1, target(k + 1) + _draft_seconds(head, name, k))
                        for k in range(1, lane.drafted[position] + 1)]
        return options
    return at


def _count_tree(result: ReplayResult, names: list[str], runs: list[int]) -> None:
    """A round's chains (the chosen drafter's first) in `result`'s tree counts; the winner is
    the chain that ran furthest (the first of equals), none when nothing was accepted."""
    result.branches += len(names)
    if len(names) < 2:
        return
    result.tree_rounds += 1
    for name in names:
        result.branched[name] = result.branched.get(name, 0) + 1
    longest = max(runs)
    if longest:
        winner = names[runs.index(longest)]
        result.won[winner] = result.won.get(winner, 0) + 1


class _TraceEvaluator:
    """Full-information evaluation from the trace: each drafter's teacher-forced gammas."""

    costly = None  # (a trace's gammas cost nothing to read)
    from_hidden = None

    def __init__(self, prompt: PromptTrace, arms: list[str]):
        self.prompt, self.arms = prompt, arms

    def __call__(self, rounds: Sequence[RoundOutcome], skip: Sequence[bool] = ()) -> list[Gammas]:
        return [[None if skip and skip[i] else self._gammas(name, r.start, r.count) for i, name in enumerate(self.arms)]
                for r in rounds]

    def silent(self, round_: RoundOutcome) -> list[bool]:
        return [not a for a in _awake(self.prompt, self.arms, round_.start)]

    def _gammas(self, name: str, start: int, count: int) -> list[float]:
        lane = self.prompt.drafters.get(name)
        return lane.alpha[start : start + count] if lane else [0.0] * count


def _awake(prompt: PromptTrace, arms: list[str], position: int) -> list[bool]:
    """Per arm: would it propose anything at `position`? (The plain arm has no lane and is
    always a candidate; a drafter that drafted nothing there when traced was silent.)"""
    lanes = [None if name == PLAIN_ARM else prompt.drafters.get(name) for name in arms]
    return [lane is None or lane.drafted[position] > 0 for lane in lanes]


def _replayed_chain(head: TraceHeader, prompt: PromptTrace, arms: list[str], arm: int, depth: int,
                    position: int) -> tuple[int, int, float]:
    """(drafted, accepted, draft seconds) of `arm` drafting up to `depth` tokens at `position`."""
    lane = prompt.drafters.get(arms[arm])
    drafted = min(lane.drafted[position], depth) if lane else 0
    accepted = min(lane.run[position], drafted) if lane else 0
    return drafted, accepted, _draft_seconds(head, arms[arm], drafted)


def _draft_seconds(head: TraceHeader, name: str, drafted: int) -> float:
    cost = head.costs.get(name)
    if cost is None or drafted == 0:
        return 0.0
    return cost(1) * drafted  # one catch-up forward of about one token, then drafted - 1 single steps
