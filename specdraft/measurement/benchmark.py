"""Live benchmarks: every configuration on every prompt, interleaved, timed by wall clock.

A configuration is plain decoding (the baseline every speedup is a ratio to), a policy
over the pool, or one of transformers' own generation modes (baselines.py). Runs are interleaved (the configuration order
rotates per prompt and repeat) so machine drift does not favour one. Every greedy output
is compared token for token with plain decoding.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from specdraft.measurement.datasets import Example
from specdraft.errors import UsageError
from specdraft.profile import Profile
from specdraft.runtime import Runtime, build_runtime
from specdraft.session.prompt_run import PromptRun

PLAIN = "plain"


@dataclass
class Sample:
    id: str
    task: str
    config: str
    repeat: int
    tokens: int
    rounds: int
    elapsed_s: float
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    regret: float | None = None
    best_drafter: str | None = None
    best_arm_share: float | None = None
    mismatch: bool = False
    regret_curve: list[float] = field(default_factory=list)
    # The regret's unit, the policy's objective: "tokens" (expected accepted length) or
    # "tok/s" (tokens per second by the policy's cost model, summed over evaluated rounds).
    regret_unit: str | None = None
    # Where the time went (seconds: draft, verify, evaluate, everything else), the drafted
    # length of each round, and the policy's ideal speedup for this pool at the end.
    time_s: dict[str, float] = field(default_factory=dict)
    draft_lengths: dict[str, int] = field(default_factory=dict)
    ideal_speedup: float | None = None
    drafter_rounds: dict[str, int] = field(default_factory=dict)  # rounds each arm played
    # Token trees: rounds that verified several drafters' chains, the chains verified in
    # all, and per drafter the tree rounds it drafted a branch in and those it won.
    tree_rounds: int = 0
    branches: int = 0
    branched: dict[str, int] = field(default_factory=dict)
    won: dict[str, int] = field(default_factory=dict)
    runner_up_rounds: int = 0  # rounds that verified drafters' runner-up leaves ...
    runner_up_wins: int = 0  # ... and those whose committed tokens ended on one
    # A peer engine's run (llama.cpp): other kernels decide near-ties, so its output is
    # compared as text (`identical`) instead of counted as a mismatch; `failed` says why a
    # run of it broke off.
    peer: bool = False
    identical: bool | None = None
    failed: str | None = None
    ids: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("ids")
        out["tokens_per_s"] = round(self.tokens_per_s, 3)
        out["mean_accepted"] = round(self.tokens / self.rounds, 4) if self.rounds else None
        return out


@dataclass
class Config:
    label: str
    run: Callable[[Example], Sample]
    # Forget the text of earlier prompts (a drafter that drafts from them must not see the
    # warm-up's or an earlier repeat's answer to the prompt it is measured on).
    forget: Callable[[], None] = lambda: None
    # A peer engine's configuration: whether its output ids say the same text as plain
    # decoding's (None: specdraft's own or transformers', held to token equality).
    same_text: Callable[[list[int], list[int]], bool] | None = None


def same_text_as(tokenizer) -> Callable[[list[int], list[int]], bool]:
    """A peer configuration's comparison: whether two outputs decode to the same text."""
    def same_text(ids: list[int], reference: list[int]) -> bool:
        return tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(reference, skip_special_tokens=True)

    return same_text


def policy_configs(profile: Profile, flags: Sequence[str] | None, runtime: Runtime, chat: bool | None) -> list[Config]:
    """`--policies ucb,normalhedge,fixed:lookup`; default: the profile's policy and each drafter fixed."""
    if not flags:
        flags = [profile.policy.name] + [f"fixed:{d.name}" for d in profile.drafters]
        if profile.policy.name == "fixed":
            flags = flags[1:]
    configs, seen = [], set()
    for flag in flags:
        if flag in seen:
            continue
        seen.add(flag)
        variant = profile.with_overrides(policy=flag)
        # the bench's own runtime already warned about any optional drafter left out
        variant_runtime = build_runtime(variant, runtime.target, models=runtime.models, warn_absent=False,
                                        record=False)
        configs.append(_engine_config(flag, variant_runtime, chat))
    return configs


def plain_config(profile: Profile, runtime: Runtime, chat: bool | None) -> Config:
    return _engine_config(PLAIN, build_runtime(profile, runtime.target, plain=True), chat)


def _engine_config(label: str, runtime: Runtime, chat: bool | None) -> Config:
    def run(example: Example) -> Sample:
        prompt_run = PromptRun(runtime, example.prompt, chat)
        curve = []
        start = time.perf_counter()
        for _ in prompt_run:
            regret = prompt_run.stats.regret
            if regret is not None:
                curve.append(round(regret, 4))
        elapsed = time.perf_counter() - start
        stats = prompt_run.stats
        accepted_at, drafted_at = _per_position(prompt_run, runtime.profile.decode.draft_tokens)
        phases = {"draft": stats.draft_s, "verify": stats.verify_s, "evaluate": stats.evaluate_s,
                  "prefill": stats.prefill_s}
        time_s = {name: round(value, 5) for name, value in phases.items()}
        time_s["other"] = round(max(0.0, elapsed - sum(phases.values())), 5)
        return Sample(example.id, example.task, label, 0, stats.tokens, stats.rounds, elapsed, accepted_at,
                      drafted_at, stats.regret, stats.best_drafter, stats.best_arm_share,
                      regret_curve=curve, regret_unit=stats.regret_unit, ids=list(prompt_run.detokenizer.ids),
                      time_s=time_s,
                      draft_lengths={str(k): n for k, n in sorted(stats.draft_lengths.items())},
                      ideal_speedup=stats.ideal_speedup,
                      drafter_rounds={name: use.rounds for name, use in stats.usage.items() if use.rounds},
                      tree_rounds=stats.tree_rounds, branches=stats.branches,
                      branched={name: use.branched for name, use in stats.usage.items() if use.branched},
                      won={name: use.won for name, use in stats.usage.items() if use.won},
                      runner_up_rounds=stats.runner_up_rounds, runner_up_wins=stats.runner_up_wins)

    def forget() -> None:
        for drafter in runtime.drafters:
            drafter.forget_run()

    return Config(label, run, forget)


def _per_position(prompt_run: PromptRun, k: int) -> tuple[list[int], list[int]]:
    accepted, drafted = [0] * k, [0] * k
    for record in prompt_run.records:
        own = record.tree.branches[0][2] if record.tree.branches else record.accepted  # the chosen drafter's kept tokens
        for j in range(record.drafted):
            drafted[j] += 1
            accepted[j] += j < own
    return accepted, drafted


def run_bench(configs: Sequence[Config], examples: Sequence[Example], repeat: int,
              tick: Callable[[str], None] = lambda label: None,
              on_prompt: Callable[[list[Sample]], None] = lambda samples: None, greedy: bool = True) -> list[Sample]:
    """Warm each configuration up once, then `repeat` interleaved passes over the prompts.
    `on_prompt` gets each prompt's samples as soon as all configurations ran it, so a
    caller can keep them even if a later prompt is interrupted. Greedy outputs are checked
    against plain decoding's; sampled ones differ by design."""
    if not configs or configs[0].label != PLAIN:
        raise UsageError("the plain baseline must come first")
    for config in configs:
        config.run(examples[0])
        tick(f"warm-up {config.label}")
    samples = []
    for rep in range(1, repeat + 1):
        for config in configs:  # each pass is a fresh stream: prompt i drafts only from prompts < i
            config.forget()
        for index, example in enumerate(examples):
            shift = (index + rep) % len(configs)
            order = configs[shift:] + configs[:shift]
            done = {}
            for config in order:
                sample = config.run(example)
                sample.repeat = rep
                done[config.label] = sample
                tick(config.label)
            reference = done[PLAIN].ids
            for config in order:
                sample = done[config.label]
                if config.same_text is not None:
                    sample.identical = greedy and config.same_text(sample.ids, reference)
                else:
                    sample.mismatch = greedy and sample.ids != reference
            samples.extend(done[config.label] for config in configs)
            on_prompt(list(done.values()))
    return samples
