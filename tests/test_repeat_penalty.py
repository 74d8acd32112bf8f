"""The repetition penalty: every verify row penalised by its own window, so speculative
decoding commits exactly what plain decoding with the penalty commits (greedy, chains and
trees) and samples from the penalised target's law; the flag, the profile keys and the
commands that would not apply it."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from specdraft.core.penalty import WHOLE_CONTEXT, RepeatPenalty
from specdraft.core.sampling import SamplingParams, sampling_probs
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.drafters import DraftContext
from specdraft.learning.policies import build_policy
from specdraft.learning.policies.simple import FixedPolicy, RandomPolicy
from specdraft.models.cached_lm import CachedLM
from test_sampling import SAMPLING_PROMPT, assert_follows_laws, sampling_pool
from test_tree_round import PROMPTS, greedy_pool, scripted_branches
from tiny import VOCAB, plain_greedy, tiny_llama


def penalised_naively(logits: torch.Tensor, window: list[int], factor: float) -> torch.Tensor:
    """llama.cpp's rule on one row, written out token by token."""
    out = logits.clone()
    for token in set(window):
        out[token] = out[token] / factor if out[token] > 0 else out[token] * factor
    return out


def window_of(ids: list[int], last_n: int) -> list[int]:
    return list(ids) if last_n == WHOLE_CONTEXT else list(ids[max(0, len(ids) - last_n):]) if last_n else []


def plain_penalised(model, prompt: list[int], max_new: int, penalty: RepeatPenalty) -> list[int]:
    """Plain greedy decoding with the penalty: a full forward per token, no cache."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(penalised_naively(logits, window_of(ids, penalty.last_n), penalty.factor).argmax())
            out.append(token)
            ids.append(token)
    return out


@pytest.mark.parametrize("last_n", [1, 3, 4, 5, 7, 9, 10, 64, WHOLE_CONTEXT])
@pytest.mark.parametrize("factor", [1.5, 0.7])
def test_every_row_gets_its_own_window(last_n, factor):
    """Windows shorter, as long as and longer than the context (and than it with the draft)."""
    gen = torch.Generator().manual_seed(0)
    context, draft = [3, 9, 9, 4, 17, 6, 30], torch.tensor([4, 21, 21, 8])
    logits = torch.randn(5, 32, generator=gen)
    penalty = RepeatPenalty(factor, last_n)
    chain = penalty.chain(logits, context, draft)
    rows = penalty.rows(logits, context, [draft[:j].tolist() for j in range(5)])
    for j in range(5):
        expected = penalised_naively(logits[j], window_of(context + draft[:j].tolist(), last_n), factor)
        assert torch.equal(chain[j], expected) and torch.equal(rows[j], expected), j


def test_a_penalty_of_one_or_a_window_of_zero_is_off():
    assert not RepeatPenalty(1.0, 64).active and not RepeatPenalty(1.3, 0).active and RepeatPenalty(1.3, 64).active


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("penalty", [RepeatPenalty(1.8, 12), RepeatPenalty(1.3, WHOLE_CONTEXT)])
def test_every_drafter_commits_what_penalised_plain_decoding_commits(target, penalty):
    target_lm = CachedLM(target)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = greedy_pool(target, target_lm, ctx)
    names = [d.name for d in drafters]
    changed = 0
    for prompt in PROMPTS:
        reference = plain_penalised(target, prompt, 40, penalty)
        changed += reference != plain_greedy(target, prompt, 40)
        for policy in [FixedPolicy(names, {"drafter": n}) for n in names] + [RandomPolicy(names, seed=3)]:
            engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(5, 40, SamplingParams(), penalty=penalty))
            assert [t for r in engine.generate(prompt) for t in r.tokens] == reference, policy.select()
    assert changed == len(PROMPTS)  # the penalty changes every prompt's text: the check can fail


@pytest.mark.parametrize("static", [False, True])
def test_token_trees_commit_what_penalised_plain_decoding_commits(static):
    target = tiny_llama(seed=0)
    penalty = RepeatPenalty(1.8, 10)  # longer than the prompts: the window first covers all of them
    target_lm = CachedLM(target, static=static)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = greedy_pool(target, target_lm, ctx)
    policy = build_policy("normalhedge", {"evaluate": "all"}, [d.name for d in drafters], seed=0, draft_tokens=5,
                          horizon=40)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(5, 40, SamplingParams(), penalty=penalty))
    scripted_branches(engine, seed=3)
    trees = 0
    for prompt in PROMPTS:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_penalised(target, prompt, 40, penalty)
        trees += sum(len(r.tree.branches) > 1 for r in records)
    assert trees >= 10


def penalised_laws(model, prompt, params, penalty) -> tuple[Counter, Counter]:
    """The exact law of the first two generated tokens and of the third, penalised."""
    vocab = model.config.vocab_size
    joint2, marginal3 = Counter(), Counter()
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=3):
            ids = prompt + list(seq)
            logits = model(torch.tensor([ids])).logits[0]
            prob = 1.0
            for i, token in enumerate(seq):
                at = len(prompt) + i
                row = penalised_naively(logits[at - 1], window_of(ids[:at], penalty.last_n), penalty.factor)
                prob *= float(sampling_probs(row.view(1, -1), params)[0, token])
            joint2[seq[:2]] += prob
            marginal3[seq[2]] += prob
    return joint2, marginal3


@pytest.mark.parametrize("trees", [False, True])
def test_sampled_tokens_follow_the_penalised_target(trees):
    params, penalty = SamplingParams(1.0), RepeatPenalty(3.0, 2)
    model, target_lm, gen, drafters = sampling_pool(params)
    policy = RandomPolicy([d.name for d in drafters], seed=2)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(3, 3, params, penalty=penalty), gen)
    if trees:
        scripted_branches(engine, seed=4, most=3, deepest=3, least=2)
    joint2, marginal3 = penalised_laws(model, SAMPLING_PROMPT, params, penalty)
    plain2, _ = penalised_laws(model, SAMPLING_PROMPT, params, RepeatPenalty(1.0, 2))
    assert max(abs(joint2[s] - plain2[s]) for s in joint2) > 0.05  # the penalty moves the law visibly
    assert_follows_laws(engine, SAMPLING_PROMPT, joint2, marginal3)


# --- the command line -----------------------------------------------------------------------

def specdraft(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "specdraft", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    from tiny import save_tiny_pair

    folder = tmp_path_factory.mktemp("penalty")
    target = save_tiny_pair(folder)
    profile = folder / "pool.toml"
    profile.write_text(f'[target]\npath = "{target}"\n[decode]\nmax_new_tokens = 48\nverify_costs = "line"\n'
                       '[policy]\nname = "normalhedge"\n[[drafters]]\nname = "lookup"\nkind = "ngram"\n'
                       '[[drafters]]\nname = "suffix"\nkind = "suffix"\n')
    return profile


def texts(profile, *flags):
    done = specdraft("generate", "--pool", str(profile), "--raw", "--json", *flags, "abcabcabcabc abc", env=offline())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["text"]


def offline():
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def test_generate_with_a_penalty_equals_plain_decoding_with_it(tiny_profile):
    penalised = texts(tiny_profile, "--repeat-penalty", "1.5", "--repeat-last-n", "16")
    assert penalised == texts(tiny_profile, "--repeat-penalty", "1.5", "--repeat-last-n", "16", "--policy", "fixed:none")
    assert penalised != texts(tiny_profile, "--policy", "fixed:none")


@pytest.mark.parametrize("flags, message", [(["--repeat-penalty", "0"], "--repeat-penalty"),
                                            (["--repeat-penalty", "11"], "--repeat-penalty"),
                                            (["--repeat-last-n", "-2"], "--repeat-last-n")])
def test_a_penalty_out_of_range_is_a_usage_error(tiny_profile, flags, message):
    done = specdraft("generate", "--pool", str(tiny_profile), *flags, "hi", env=offline())
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_profile_keys_and_the_baselines_that_would_not_apply_them(tiny_profile, tmp_path):
    from specdraft.errors import ProfileError
    from specdraft.profile import load_profile, refuse_penalty

    text = tiny_profile.read_text().replace("[decode]\n", "[decode]\nrepeat_penalty = 1.2\nrepeat_last_n = -1\n")
    (tmp_path / "p.toml").write_text(text)
    profile = load_profile(tmp_path / "p.toml")
    assert (profile.decode.repeat_penalty, profile.decode.repeat_last_n) == (1.2, -1)
    with pytest.raises(ProfileError, match="decode.repeat_penalty"):
        refuse_penalty(profile, "--baseline transformers")
    refuse_penalty(load_profile(tiny_profile), "--baseline transformers")  # no penalty: nothing to refuse
    (tmp_path / "bad.toml").write_text(text.replace("repeat_last_n = -1", "repeat_last_n = 100000"))
    with pytest.raises(ProfileError, match="decode.repeat_last_n"):
        load_profile(tmp_path / "bad.toml")
