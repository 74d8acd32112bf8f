"""Recording traces: decode each prompt once, then teacher-force the trajectory through
every drafter once (ARCHITECTURE.md, "Replay").

Per prompt and drafter, for every generated position t (context = prompt + tokens[:t]):
- `alpha[t]`: gamma at t, sum_v min(p_t, q_t) (exact under greedy: 1 when the drafter's
  argmax is the target's), a fresh lookup's p(proposal) for prompt lookup: what
  full-information evaluation scores;
- `drafted[t]`, `run[t]`: how many tokens it would draft at t and how many of them match
  the trajectory (its accepted run under greedy);
- `span[t]`: the alignment of each drafted position (teacher-forced past the first miss).
Plus measured per-forward costs of the target and each drafter, for simulated timing.
Greedy only: the trajectory is then the same whichever drafters run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from specdraft.core.sampling import distributions
from specdraft.drafters.base import TrajectoryScores
from specdraft.drafters.registry import scored_by_own_forward
from specdraft.errors import UsageError
from specdraft.storage.atomic_files import fresh_stream
from specdraft.storage.regular_files import read_regular_text
from specdraft.measurement.datasets import Example
from specdraft.models.cached_lm import CachedLM
from specdraft.runtime import Runtime, build_runtime
from specdraft.session.prompt_run import PromptRun

TRACE_VERSION = 1


DrafterTrace = TrajectoryScores  # one drafter's lane of a prompt's trace


@dataclass
class PromptTrace:
    id: str
    task: str
    prompt_tokens: int
    tokens: list[int]
    drafters: dict[str, DrafterTrace]


@dataclass
class ForwardCost:
    """Seconds for a forward of n tokens with a warm cache: fixed + per_token * n, or where
    the forward was timed at every width 1 .. len(by_width) (the target's, whose curve is
    not a line on a CPU), the cheapest timed width >= n: a verify is padded to a cheaper
    wider width, as live rounds do (`RoundPlanner.verify_width`); past the widths timed, the
    line, never below the last of them."""

    fixed: float
    per_token: float
    by_width: list[float] | None = None

    def __call__(self, n: int) -> float:
        if n <= 0:
            return 0.0
        line = self.fixed + self.per_token * n
        if not self.by_width:
            return line
        if n <= len(self.by_width):
            return min(self.by_width[n - 1:])
        return max(line, self.by_width[-1])


@dataclass
class TraceHeader:
    draft_tokens: int
    max_new_tokens: int
    drafters: list[str]
    kinds: list[str]
    costs: dict[str, ForwardCost]
    profile: str = ""
    version: int = TRACE_VERSION
    type: str = "header"
    # Per drafter: scored by a forward of its own over the tokens it did not draft (what a
    # full-information replay charges every round); None in traces from before it was
    # recorded, where its kind says.
    scored_by_own_forward: list[bool] | None = None

    def catches_up(self, name: str) -> bool:
        """Whether full-information scoring runs drafter `name`'s own forward."""
        index = self.drafters.index(name)
        if self.scored_by_own_forward is not None:
            return self.scored_by_own_forward[index]
        return scored_by_own_forward(self.kinds[index])


@dataclass
class Trace:
    header: TraceHeader
    prompts: list[PromptTrace] = field(default_factory=list)

    def save(self, file: str | Path) -> None:
        with TraceWriter(file) as writer:
            writer.header(self.header)
            for prompt in self.prompts:
                writer.prompt(prompt)

    @classmethod
    def load(cls, file: str | Path, flag: str = "--trace") -> "Trace":
        """`flag` names the option the file came from in error messages; every field is
        checked (trace_checks.py) before anything is built from it."""
        from specdraft.measurement.trace_checks import checked_header, checked_prompt

        try:
            text = read_regular_text(file)
            lines = text.splitlines()
            if len(lines) > 1 and not text.endswith("\n") and not _parses(lines[-1]):
                lines.pop()  # a run killed mid-write: every complete line is still good
            if not lines:
                raise ValueError("the file is empty")
            head = json.loads(lines[0])
            if not isinstance(head, dict) or head.get("type") != "header" or head.get("version") != TRACE_VERSION:
                raise ValueError("not a specdraft trace (version %s)" % TRACE_VERSION)
            head = checked_header(head)
            head["costs"] = {k: ForwardCost(**v) for k, v in head["costs"].items()}
            header = TraceHeader(**head)
            prompts = []
            for number, line in enumerate(lines[1:], start=2):
                row = checked_prompt(json.loads(line), number, header.drafters, header.draft_tokens)
                row["drafters"] = {k: DrafterTrace(**v) for k, v in row["drafters"].items()}
                prompts.append(PromptTrace(**row))
        except (OSError, ValueError, TypeError, RecursionError) as exc:
            raise UsageError(f"{flag} {file}: cannot read trace: {exc}") from None
        return cls(header, prompts)


class TraceWriter:
    """A trace file written while it is recorded: the header line first, then one line per
    prompt, flushed, so Ctrl-C or a crash keeps every prompt traced so far."""

    def __init__(self, file: str | Path):
        self.file, self.fh = Path(file), None

    def header(self, header: TraceHeader) -> None:
        # Opened only now, once the models are loaded: a failed start keeps an older file.
        self.fh = fresh_stream(self.file)
        self._line(asdict(header))

    def prompt(self, prompt: PromptTrace) -> None:
        self._line(asdict(prompt))

    def _line(self, row: dict) -> None:
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def record_trace(runtime: Runtime, examples: Sequence[Example], chat: bool | None,
                 progress: Callable[[Example], None] = lambda e: None, sink: TraceWriter | None = None) -> Trace:
    """`sink`, when given, receives the header and each prompt's trace as soon as they exist."""
    profile = runtime.profile
    if not profile.decode.greedy:
        raise UsageError("traces need greedy decoding (temperature = 0): only then is the trajectory drafter-free")
    plain = build_runtime(profile, runtime.target, plain=True)
    k = profile.decode.draft_tokens
    drafters = runtime.drafters
    trace = Trace(TraceHeader(k, profile.decode.max_new_tokens, [d.name for d in drafters], [d.kind for d in drafters],
                              measure_costs(runtime, k), str(profile.file),
                              scored_by_own_forward=[d.traits.scored_by_own_forward for d in drafters]))
    if sink is not None:
        sink.header(trace.header)
    for example in examples:
        run = PromptRun(plain, example.prompt, chat).run()
        context = run.prompt_ids + run.detokenizer.ids
        trace.prompts.append(trace_prompt(runtime, example, len(run.prompt_ids), context, k))
        if sink is not None:
            sink.prompt(trace.prompts[-1])
        progress(example)
    return trace


@torch.inference_mode()
def trace_prompt(runtime: Runtime, example: Example, prompt_len: int, context: list[int], k: int) -> PromptTrace:
    n = len(context) - prompt_len
    target_logits = runtime.engine.target.uncached_logits(context)[prompt_len - 1 : prompt_len - 1 + n]  # [n, V]
    penalty = runtime.engine.settings.penalty
    if penalty.active:  # position i was decoded after the prompt and the i tokens before it
        target_logits = penalty.rows(target_logits, context[:prompt_len], [context[prompt_len:prompt_len + i] for i in range(n)])
    p = distributions(target_logits, runtime.engine.settings.sampling)  # [n, V]
    scores = {d.name: d.trajectory_scores(context, prompt_len, p, k) for d in runtime.drafters}
    for drafter in runtime.drafters:  # as in a live run: later prompts may draft from this one
        drafter.end_prompt(context)
    return PromptTrace(example.id, example.task, prompt_len, context[prompt_len:], scores)


def measure_costs(runtime: Runtime, k: int, repeats: int = 5) -> dict[str, ForwardCost]:
    """Median seconds of a forward of 1 and of k + 1 tokens after a 64-token prefill;
    drafters that draft on the host cost nothing; a drafter with a network of its own
    that is not a causal LM times itself (`forward_seconds`)."""
    costs = {"target": _forward_cost(runtime.engine.target, k, repeats, every_width=True)}
    for drafter in runtime.drafters:
        model, own = drafter.causal_lm, drafter.forward_seconds((1, k + 1), repeats)
        if own is not None:
            per_token = max(0.0, (own[k + 1] - own[1]) / k)
            costs[drafter.name] = ForwardCost(max(0.0, own[1] - per_token), per_token)
        else:
            lm = getattr(drafter, "lm", None)
            costs[drafter.name] = _forward_cost(lm, k, repeats) if model is not None and isinstance(lm, CachedLM) \
                else ForwardCost(0.0, 0.0)
    return costs


@torch.inference_mode()
def _forward_cost(decoding: CachedLM, k: int, repeats: int, every_width: bool = False) -> ForwardCost:
    """Timed on a fresh cache of the kind decoding uses (static + graphs on a GPU), after
    two untimed passes per width (the first warms up, the second captures a graph); at
    widths 1 and k + 1, or `every_width` 1 .. k + 1 (kept in `by_width`)."""
    lm = decoding.twin()
    device = lm.device
    lm.feed(torch.arange(3, 67, device=device) % 100, keep=1)
    samples = {width: [] for width in (range(1, k + 2) if every_width else (1, k + 1))}
    for _ in range(2):
        for width in samples:
            lm.feed(torch.full((width,), 5, dtype=torch.long, device=device), keep=0)
            lm.crop(64)
    for _ in range(repeats):
        for width in samples:
            tokens = torch.full((width,), 5, dtype=torch.long, device=device)
            start = lm.clock()
            lm.feed(tokens, keep=0)
            samples[width].append(lm.clock() - start)
            lm.crop(64)
    one, wide = statistics.median(samples[1]), statistics.median(samples[k + 1])
    per_token = max(0.0, (wide - one) / k)
    by_width = [statistics.median(samples[width]) for width in range(1, k + 2)] if every_width else None
    return ForwardCost(max(0.0, one - per_token), per_token, by_width)
