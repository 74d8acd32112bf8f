"""The runtime a resident-server request decodes with: the server's own for its profile's
sampling rule, else one built for the request's rule (temperature, top-k, top-p, repetition
penalty) beside it.

Drafters and the verify are built for one sampling rule (both sides of speculative sampling
must process their distributions alike), so another rule gets its own runtime. It shares the
target's weights and the drafters' loaded models with the server's runtime (what
`build_runtime` takes for runtimes side by side), keeps its own KV cache and learned policy,
and the few most recently used are kept for the next request at the same rule.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any

from specdraft.errors import ProfileError
from specdraft.profile import Profile

log = logging.getLogger("specdraft")
KEPT = 3  # runtimes kept for rules other than the server's (each holds a KV cache)
RULE_KEYS = ("temperature", "top_k", "top_p", "repeat_penalty", "repeat_last_n")


class RuleError(ValueError):
    """A request's sampling value out of the range a profile allows (the message says which)."""


def rule_of(profile: Profile) -> tuple:
    """What decides a runtime's distributions; greedy decoding ignores top-k and top-p, so a
    greedy request that names them decodes on the greedy runtime."""
    decode = profile.decode
    if decode.greedy:
        decode = dataclasses.replace(decode, top_k=0, top_p=1.0)
    return tuple(getattr(decode, key) for key in RULE_KEYS)


class RuntimesByRule:
    def __init__(self, runtime):
        self.server = runtime
        self.others: OrderedDict[tuple, Any] = OrderedDict()

    def runtime_for(self, sampling: tuple[tuple[str, Any], ...]):
        """The runtime for a request's `sampling` (decode key, value) pairs, its `seed`
        applied to that runtime's random stream; RuleError for a value out of range."""
        overrides = dict(sampling)
        seed = overrides.pop("seed", None)
        try:
            profile = self.server.profile.with_overrides(**overrides, seed=seed)
        except ProfileError as exc:  # key "--top-p" and the range: said as the request's key
            name = (exc.key or "").lstrip("-").replace("-", "_")
            raise RuleError(f"{name} {str(exc).rsplit(': ', 1)[-1]}") from None
        rule = rule_of(profile)
        runtime = self.server if rule == rule_of(self.server.profile) else self._other(rule, profile)
        if seed is not None and runtime.engine.generator is not None:
            runtime.engine.generator.manual_seed(seed)
        return runtime

    def _other(self, rule: tuple, profile: Profile):
        from specdraft.runtime import build_runtime

        runtime = self.others.pop(rule, None)
        if runtime is None:
            log.info("building a runtime for %s", ", ".join(f"{k} {v}" for k, v in zip(RULE_KEYS, rule)))
            runtime = build_runtime(profile, target=self.server.target, models=self.server.models, warn_absent=False)
            while len(self.others) >= KEPT:
                self.others.popitem(last=False)
        self.others[rule] = runtime  # the most recently used last
        return runtime
