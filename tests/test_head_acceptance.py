"""The held-out acceptance by draft position that `train head` reports
(`HeadObjective.acceptance`): it must be what the head achieves when it drafts, token by
token from its own cache, against the target's greedy continuation; a token outside the
draft vocabulary is a miss; and chat prompts' tokens are not counted."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specdraft.drafters.head import HeadCache
from specdraft.training.features import extract_features
from specdraft.training.head import HeadObjective, HeadTrainingSettings, draft_vocabulary, new_head
from specdraft.training.loop import LoopSettings, train
from tiny import VOCAB, plain_greedy, tiny_llama

LENGTH, DEPTHS = 24, 3


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A sharp tiny target, its greedy text for a few prompts (one token longer than the
    rows trained on, so the last pair's target token is known), and a briefly trained head
    whose draft vocabulary leaves out some tokens the target says."""
    from rich.console import Console

    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    prompts = [[11 + i, 20 + 2 * i, 30 + i] for i in range(6)]
    longer = [p + plain_greedy(target, p, LENGTH - len(p) + 1) for p in prompts]
    with torch.no_grad():  # no near-tie in the target's text, which one forward or another could break
        top2 = target(torch.tensor(longer)).logits[:, 2:-1].topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3
    tokens = np.array([row[:LENGTH] for row in longer], dtype=np.int32)
    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], tmp_path_factory.mktemp("features"))
    vocab_ids = draft_vocabulary(tokens, 16, VOCAB)
    torch.manual_seed(0)
    head = new_head(target, vocab_ids)
    rows = np.arange(len(prompts))
    objective = HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=4, noise=0.0), rows,
                              torch.device("cpu"))
    train(head, LoopSettings(steps=25, lr=1e-2, warmup=5), objective.step, lambda *a: None,
          tmp_path_factory.mktemp("head"), Console(stderr=True, quiet=True))
    return target, objective, longer, data


def drafted_shares(target, objective, longer, data, counted) -> list[float]:
    """Acceptance by position from drafting itself: from every start, the head's cache
    over the real pairs up to it, then greedy draft steps on its own predictions."""
    head = copy.deepcopy(objective.head).eval()
    drafting = HeadCache(head, target, VOCAB)
    layer = target.config.num_hidden_layers
    hits, counts = np.zeros(DEPTHS), np.zeros(DEPTHS)
    for row, text in enumerate(longer):
        features = torch.from_numpy(np.asarray(data.features[layer][row], dtype=np.float32))
        for start in range(LENGTH - 1):  # pair `start` = (feature at start, token start + 1)
            drafting.reset()
            drafting.observe(0, features)
            logits = drafting.consume(text[:LENGTH], start + 2, 1)[0]
            alive = True
            for depth in range(1, DEPTHS + 1):
                goal = start + depth + 1  # the token this draft step must equal
                if goal > LENGTH or not all(counted(row, t) for t in range(start + 2, goal + 1)):
                    break
                token = int(head.vocab_ids[int(logits.argmax())])
                alive = alive and token == text[goal]
                hits[depth - 1] += alive
                counts[depth - 1] += 1
                logits = drafting.step(torch.tensor(token))[0]
    return list(hits / counts)


def shares_with_prompts_of(setting, prompt_tokens: int) -> tuple[list[float], list[float]]:
    """(reported, achieved) with the first `prompt_tokens` of every row a prompt: not drafted,
    not counted (the prompts' own tokens are not the target's greedy text)."""
    target, objective, longer, data = setting
    mask = np.ones((len(longer), LENGTH), dtype=bool)
    mask[:, :prompt_tokens] = False
    data.answer_mask = mask
    try:
        reported = objective.acceptance(np.arange(len(longer)), DEPTHS)
        achieved = drafted_shares(target, objective, longer, data, lambda row, token: mask[row, min(token, LENGTH - 1)])
    finally:
        data.answer_mask = None
    return reported, achieved


def test_the_reported_acceptance_is_what_drafting_achieves(setting):
    reported, achieved = shares_with_prompts_of(setting, 3)
    assert reported == pytest.approx(achieved, abs=1e-9)
    assert 0.05 < reported[1] < reported[0] < 0.95  # neither trivial nor hopeless: the test can tell
    assert reported == sorted(reported, reverse=True)
    # the target says tokens the head cannot draft: those are misses in both counts
    _, objective, longer, _ = setting
    vocab = set(objective.head.vocab_ids.tolist())
    assert sum(t not in vocab for text in longer for t in text[3 : LENGTH + 1]) > 0


def test_tokens_of_a_longer_chat_prompt_are_not_counted(setting):
    reported, achieved = shares_with_prompts_of(setting, 9)
    assert reported == pytest.approx(achieved, abs=1e-9)
    assert reported != pytest.approx(shares_with_prompts_of(setting, 3)[0], abs=1e-9)
