"""What a serving worker builds once from a profile: the host-side drafters every request
forks, the policy each request starts from, and the learned state requests hand on.

Only drafters that draft from token ids alone (`DrafterTraits.token_ids_only`: the lookups) can
run inside an engine that owns the target: the others need the target's hidden states or
KV cache, or run a model of their own beside it, and are left out of the served pool, each
with its reason (`DrafterTraits.engine_problem`). Suffix stores, the learned store and the history of answers are
built once and shared by every request's fork (`Drafter.fork`), so an answer one request
finished is drafted from by the next.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import torch

from specdraft.drafters import DraftContext, Drafter, PlainDecoding, PoolContext
from specdraft.drafters.registry import build_pool, kind_class
from specdraft.errors import ProfileError, UsageError
from specdraft.learning.batch_planner import MatchCalibration
from specdraft.learning.driver import PolicyDriver
from specdraft.learning.policies import build_policy
from specdraft.models.loading import LoadedModel
from specdraft.profile import Profile
from specdraft.runtime import sampling_params
from specdraft.storage import atomic_files
from specdraft.storage.regular_files import read_regular_text

NO_LIMIT = 10**9  # the engine stops a request at its own max_tokens
# The state file's key for the acceptance model (MatchCalibration) beside the
# policy's state: a restarted server prices its first requests' drafts as the last one did.
CALIBRATION_KEY = "serving_calibration"


def served_drafters(profile: Profile) -> tuple[Profile, dict[str, str]]:
    """The profile with only the drafters a serving engine can run, and {name: why} for
    each one left out. A ProfileError when none is left or the fixed policy names one left out."""
    classes = {c.name: kind_class(c.kind) for c in profile.drafters}
    kept = tuple(c for c in profile.drafters if classes[c.name].traits.token_ids_only)
    left = {c.name: f"{c.kind}: {classes[c.name].traits.engine_problem}" for c in profile.drafters
            if not classes[c.name].traits.token_ids_only}
    if not kept:
        raise ProfileError(str(profile.file), "drafters", "no drafter can serve under vLLM (only drafters that "
                           "draft from token ids can): " + "; ".join(f"{n} ({w})" for n, w in left.items()))
    chosen = profile.policy.options.get("drafter") if profile.policy.name == "fixed" else None
    if chosen in left:
        raise ProfileError(str(profile.file), "policy.drafter", f'"{chosen}" cannot serve under vLLM ({left[chosen]})')
    return dataclasses.replace(profile, drafters=kept), left


def new_calibration(served: Profile) -> MatchCalibration:
    """A fresh acceptance model for the served pool's arms (its drafters,
    and the plain arm where the policy allows it) and draft length."""
    return MatchCalibration(len(served.arms), max(1, served.decode.draft_tokens))


def check_calibration(served: Profile, state: dict, file: str) -> None:
    """A UsageError naming `file` when its acceptance model does not fit the
    served pool (checked before vLLM starts, like the policy's state)."""
    if CALIBRATION_KEY not in state:
        return
    try:
        new_calibration(served).load(state[CALIBRATION_KEY])
    except ValueError as exc:
        raise UsageError(f"--policy-state {file}: cannot use it: {exc}") from None


class ServingPool:
    """One per engine worker: the template drafters, the policy's recipe and the prior
    (the learned state the latest finished request left, which the next request starts
    from; saved to `state_file` when given)."""

    def __init__(self, profile: Profile, tokenizer: Any, vocab_size: int, state_file: Path | None = None,
                 record: bool = True, seed: int = 0):
        self.profile, _ = served_drafters(profile)  # the caller warns about those left out
        profile = self.profile
        self.ctx = DraftContext(sampling_params(profile), None, torch.device("cpu"), vocab_size)
        pool = PoolContext(self.ctx, LoadedModel(torch.nn.Module(), tokenizer, profile.target.describe()), None,
                           str(profile.file), seed, record=record)
        built, _ = build_pool(profile.drafters, pool)
        by_name = {d.name: d for d in built}
        self.templates = [by_name.get(name) or PlainDecoding(self.ctx) for name in profile.arms]
        self.arms = [d.name for d in self.templates]
        self.draft_tokens = profile.decode.draft_tokens
        self.seed = seed
        self.state_file = state_file
        self.prior: dict | None = None
        # The acceptance model, learned from every offer of every request this worker serves.
        self.calibration = new_calibration(profile)
        self._lock = threading.Lock()
        self._requests = 0
        if state_file is not None and state_file.exists():
            saved = json.loads(read_regular_text(state_file, limit=64 << 20))
            self.new_driver().load_state_dict(saved)  # raises ValueError on a state of another pool
            if CALIBRATION_KEY in saved:  # (absent from a state `generate` wrote)
                self.calibration.load(saved[CALIBRATION_KEY])
            self.prior = saved

    def new_driver(self) -> PolicyDriver:
        """A policy and planner for one request, started from the prior."""
        self._requests += 1
        # vLLM verifies one chain per request: no token trees (and no tree planner to run).
        options = dict(self.profile.policy.options) | {"tree": False}
        policy = build_policy(self.profile.policy.name, options, self.arms,
                              seed=self.seed + self._requests, draft_tokens=self.draft_tokens, horizon=NO_LIMIT)
        driver = PolicyDriver(policy, self.draft_tokens, NO_LIMIT)
        if self.prior is not None:
            driver.load_state_dict(self.prior)
        return driver

    def new_drafters(self) -> list[Drafter]:
        return [d.fork() for d in self.templates]

    def hand_on(self, driver: PolicyDriver, save: bool) -> None:
        """A finished request's learned state becomes the next requests' prior."""
        self.prior = driver.state_dict()  # the policy's and planner's only: save() adds the calibration
        if save:
            self.save()

    def save(self) -> None:
        """Write the prior and the worker's acceptance model to `state_file` (whole
        or not at all), if there is a prior to write."""
        if self.state_file is not None and self.prior is not None:
            with self._lock:
                saved = {**self.prior, CALIBRATION_KEY: self.calibration.state()}
                atomic_files.write_text(self.state_file, json.dumps(saved, indent=1))
