"""What the head tests share: prompts, an engine drafting with a head, a briefly trained
head, a head objective, and the profiles the command tests write."""

from __future__ import annotations

import numpy as np
import torch

from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, NgramDrafter
from specdraft.drafters.head import HeadDrafter
from specdraft.learning.policies import build_policy
from specdraft.models.cached_lm import CachedLM
from specdraft.training.features import extract_features
from specdraft.training.head import HeadObjective, HeadTrainingSettings, draft_vocabulary, new_head
from specdraft.training.loop import LoopSettings, train
from tiny import VOCAB

PROMPTS = [[5, 9, 11, 3, 7, 5, 9], [17], [1, 40, 41, 42, 40, 41, 42, 40]]


def engine_for(target, head, policy_name, params=SamplingParams(), k=4, max_new=32, **options):
    ctx = DraftContext(params, None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), HeadDrafter("head", ctx, head, target)]
    options = ({"drafter": "head"} | options) if policy_name == "fixed" else options
    policy = build_policy(policy_name, options, [d.name for d in drafters], seed=0, draft_tokens=k, horizon=max_new)
    return SpeculativeEngine(CachedLM(target), drafters, policy, EngineSettings(k, max_new, params)), drafters


def trained_head(target, tokens, steps, tmp=None, seed=0, lr=3e-3, bf16=False):
    import tempfile
    from pathlib import Path

    from rich.console import Console

    folder = Path(tmp or tempfile.mkdtemp())
    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], folder / "features")
    torch.manual_seed(seed)
    head = new_head(target, draft_vocabulary(tokens, VOCAB, VOCAB))
    rows = np.arange(tokens.shape[0])
    objective = HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=4, noise=0.0, bf16=bf16),
                              rows, torch.device("cpu"))
    before = objective.evaluate(rows)
    train(head, LoopSettings(steps=steps, lr=lr, warmup=5), objective.step, lambda *a: None, folder,
          Console(stderr=True, quiet=True))
    return head.eval(), (before, objective.evaluate(rows))


def head_objective(target, tokens, mask, unroll=1, tmp=None):
    import tempfile
    from pathlib import Path

    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], Path(tmp or tempfile.mkdtemp()) / "f")
    data.answer_mask = mask
    torch.manual_seed(0)
    head = new_head(target, draft_vocabulary(tokens, VOCAB, VOCAB))
    with torch.no_grad():  # away from the identity start, so every pair's loss differs
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rows = np.arange(tokens.shape[0])
    return HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=len(rows), unroll=unroll,
                                                                         noise=0.0), rows, torch.device("cpu"))


BASE = """
[target]
path = "{root}/target"
dtype = "float64"

[[drafters]]
name = "lookup"
kind = "ngram"
"""


HEAD_POOL = """
[target]
path = "{root}/target"
dtype = "float64"

[decode]
draft_tokens = 4
max_new_tokens = 20

[policy]
name = "{policy}"
{policy_extra}

[[drafters]]
name = "lookup"
kind = "ngram"

[[drafters]]
name = "head"
kind = "head"
path = "{head}"
{head_extra}
"""
