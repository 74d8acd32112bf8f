"""The `head` drafter kind: lossless drafting from the target's features under every
policy, exact full-information scores, the draft-vocabulary mapping, its own forward's
timing, the handed-over features, and a head a profile names that is missing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from heads import HEAD_POOL, PROMPTS, engine_for
from specdraft.cli import app
from specdraft.core.sampling import SamplingParams, distributions, greedy_tokens
from specdraft.drafters import DraftContext
from specdraft.drafters.head_model import Readout
from specdraft.models.cached_lm import CachedLM
from tiny import VOCAB, plain_greedy, random_head, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=3)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("policy, options", [("fixed", {"draft_length": "fixed"}), ("fixed", {}), ("ucb", {}),
                                             ("normalhedge", {"update_every": 1, "evaluate": "all"}),
                                             ("normalhedge", {})])
def test_greedy_output_with_a_head_is_plain_greedy(target, prompt, policy, options):
    # whole vocabulary, half of it, and a head that also reads the target's lower layers
    for vocab, lower in ((None, ()), (list(range(0, VOCAB, 2)), ()), (None, (1, 2))):
        engine, drafters = engine_for(target, random_head(target, vocab, lower_layers=lower), policy, **options)
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(target, prompt, 32)


@pytest.mark.parametrize("params, lower", [(SamplingParams(), ()), (SamplingParams(soft_feedback=True), ()),
                                           (SamplingParams(0.9, top_k=20), ()), (SamplingParams(), (1,)),
                                           (SamplingParams(0.9, top_k=20), (1, 2))])
def test_full_information_scores_equal_a_fresh_draft_at_each_position(target, params, lower):
    """What the evaluator scores the head with at a committed position is the first-token
    alignment of a draft made from scratch there (trajectory_scores recomputes it), also
    for a head that reads lower target layers (handed over with the verify)."""
    gammas, fresh = scores_and_fresh_drafts(target, random_head(target, list(range(40)), lower_layers=lower), params)
    assert len(gammas) == len(fresh) > 10
    assert gammas == pytest.approx(fresh, abs=1e-9)


def test_greedy_scores_of_a_head_right_at_some_positions_equal_a_fresh_draft_there(target):
    """Under greedy decoding a head is scored by whether its greedy token is the committed
    one (no distribution built): a head whose vocabulary is the token the target commits
    most (never twice in a row here) is right there and wrong elsewhere, so a score read
    off the wrong position shows."""
    (common, count), = Counter(plain_greedy(target, PROMPTS[2], 32)).most_common(1)
    gammas, fresh = scores_and_fresh_drafts(target, random_head(target, [common]), SamplingParams())
    assert sum(fresh) >= 3
    assert gammas == fresh


def scores_and_fresh_drafts(target, head, params: SamplingParams) -> tuple[list[float], list[float]]:
    """The evaluator's scores of `head` over a generation of PROMPTS[2] (lookup drafting),
    and the first-token alignment of a draft made from scratch at each position."""
    generator = torch.Generator().manual_seed(0)
    engine, drafters = engine_for(target, head, "fixed", params=params,
                                  drafter="lookup", evaluate="all", update_every=1,
                                  reset="never")  # "prompt" would leave the prompt's last round unscored
    engine.generator = generator
    for drafter in drafters:
        drafter.ctx = DraftContext(params, generator, torch.device("cpu"), VOCAB)
    prompt = PROMPTS[2]
    gammas, context = [], list(prompt)
    for record in engine.generate(prompt):
        for _, g in record.learning.evaluated or ():
            gammas.extend(g[1])
        context.extend(record.tokens)
    p = distributions(CachedLM(target).uncached_logits(context)[len(prompt) - 1 : -1], params)
    return gammas, drafters[1].trajectory_scores(context, len(prompt), p, 3).alpha


def test_the_draft_vocabulary_maps_back_to_target_ids_exactly(target):
    ids = torch.tensor([3, 7, 8, 20, 41, 63])
    readout = Readout(target, ids)
    features = torch.randn(5, target.config.hidden_size, dtype=torch.float64)
    small = readout.small(features)
    wide = readout.widen(small, VOCAB)
    full = target.lm_head(features).detach()
    # a smaller matmul may sum in another order (BLAS blocking): equal to rounding, and a
    # wrong id mapping would be off by the logits' own scale
    torch.testing.assert_close(wide[:, ids], full[:, ids], rtol=0, atol=1e-12)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(wide[:, outside]).all()
    q = distributions(wide, SamplingParams(1.0))
    assert torch.allclose(q.sum(-1), torch.ones(5, dtype=q.dtype)) and (q[:, outside] == 0).all()
    # every drafted token is a draft-vocabulary id
    engine, drafters = engine_for(target, random_head(target, ids.tolist()), "fixed", draft_length="fixed")
    for record in engine.generate(PROMPTS[0]):
        pass
    drafted = drafters[1].propose(PROMPTS[0] + [3, 9], 4)
    assert set(drafted.tokens.tolist()) <= set(ids.tolist())


def test_a_greedy_head_drafts_the_argmax_over_the_target_vocabulary_without_building_q(target):
    """A step's logits stay over the draft vocabulary: the drafted token is still the argmax
    of the widened logits, q is built only where feedback reads it (soft feedback)."""
    ids = list(range(VOCAB - 1, 0, -3))  # a draft vocabulary in another order than the target's
    engine, drafters = engine_for(target, random_head(target, ids), "fixed", draft_length="fixed")
    context = PROMPTS[1] + [t for r in engine.generate(PROMPTS[1]) for t in r.tokens]
    head = drafters[1]
    draft = head.propose(context, 4)
    head.on_commit(0)
    assert draft.probs is None and len(draft.tokens) == 4
    head._greedy = lambda logits: greedy_tokens(head._wide(logits))  # the argmax over the target's ids
    assert torch.equal(head.propose(context, 4).tokens, draft.tokens)
    head.on_commit(0)
    head.ctx = DraftContext(SamplingParams(soft_feedback=True), None, torch.device("cpu"), VOCAB)
    soft = head.propose(context, 4)
    assert torch.equal(soft.tokens, draft.tokens) and soft.probs.shape == (4, VOCAB)
    assert torch.equal(soft.probs.argmax(-1), draft.tokens)
    torch.testing.assert_close(soft.probs.sum(-1), torch.ones(4, dtype=soft.probs.dtype))


def test_a_head_times_its_own_forward_for_traces(target):
    engine, drafters = engine_for(target, random_head(target), "fixed")
    seconds = drafters[1].forward_seconds((1, 5), repeats=2)
    assert set(seconds) == {1, 5} and all(s > 0 for s in seconds.values())
    assert drafters[1].head_cache.length == 0  # left reset
    out = [t for r in engine.generate(PROMPTS[0]) for t in r.tokens]
    assert out == plain_greedy(target, PROMPTS[0], 32)


def test_handed_over_features_grow_past_the_buffer_and_can_be_rewritten(target):
    from specdraft.drafters.head import HeadCache

    cache = HeadCache(random_head(target), target, VOCAB)
    rows = torch.randn(300, target.config.hidden_size, dtype=torch.float64)
    cache.observe(0, rows[:200])
    cache.observe(200, rows[200:])  # past the initial 256 rows
    assert torch.equal(cache.features, rows)
    cache.observe(150, rows[:10])  # a position handed over again replaces what followed it
    assert cache.known == 160 and torch.equal(cache.features[150:], rows[:10])
    with pytest.raises(ValueError, match="before those at 160"):
        cache.observe(170, rows[:1])


def test_a_missing_head_is_a_profile_error_unless_optional(tiny_models, tmp_path):
    runner = CliRunner()
    profile = tmp_path / "pool.toml"
    profile.write_text(HEAD_POOL.format(root=tiny_models, head=tmp_path / "nope", policy="normalhedge",
                                        policy_extra="", head_extra=""))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hi"])
    assert result.exit_code == 2 and "drafters[1].path" in result.stderr and "no such folder" in result.stderr
    profile.write_text(HEAD_POOL.format(root=tiny_models, head=tmp_path / "nope", policy="normalhedge",
                                        policy_extra="", head_extra="optional = true"))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hi"])
    assert result.exit_code == 0 and 'drafter "head" left out of the pool' in result.stderr
    profile.write_text(HEAD_POOL.format(root=tiny_models, head=tmp_path / "nope", policy="fixed",
                                        policy_extra='drafter = "head"', head_extra="optional = true"))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hi"])
    assert result.exit_code == 2 and 'drafts with "head", which is not available' in result.stderr


def test_a_head_the_planner_would_not_play_is_not_scored(target, monkeypatch):
    """A head's scoring is a forward of its own over the committed tokens: once measured and
    not worth playing (here: never, by an impossible margin) it sits out evaluation, no
    scoring forward runs for it, and output stays plain greedy decoding's."""
    from specdraft.drafters.head import HeadCache
    from specdraft.learning.planner import RoundPlanner

    monkeypatch.setattr(RoundPlanner, "COSTLY_MARGIN", 1e9)
    engine, drafters = engine_for(target, random_head(target), "normalhedge", update_every=1, reset="carry")
    head = drafters[1]
    assert head.traits.scored_by_own_forward
    consumed = []
    original = HeadCache.consume
    monkeypatch.setattr(HeadCache, "consume", lambda self, *a, **k: consumed.append(a) or original(self, *a, **k))
    for n, prompt in enumerate(PROMPTS[:1] * 3):
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 32)
        if n:
            assert engine.driver.scored_now()[1] is False
            # its forward ran only in rounds it drafted (its draft, and its scoring on that
            # round): none where another drafter played
            drafting = sum(1 for r in records if r.drafter == "head" and r.drafted)
            assert len(consumed) <= 2 * drafting
        consumed.clear()


@pytest.mark.parametrize("later_from_drafts", [False, True])
def test_a_head_learns_its_later_draft_positions_from_its_drafts_not_its_scores(later_from_drafts):
    """A head's score at a committed position reads the target's real features there; its
    draft past the first token reads its own predicted ones. Scores saying every position
    would be accepted must not keep planning deep drafts that fail at their second token."""
    from specdraft.learning.feedback import RoundFeedback
    from specdraft.learning.planner import RoundPlanner

    planner = RoundPlanner(["head", "none"], 6, plain_arm=1, full_information=True)
    planner.later_from_drafts = [later_from_drafts, False]
    for _ in range(60):  # every round: the head drafts 3, its first accepted, its second not
        planner.observe(RoundFeedback(0, 3, 1, [1.0, 0.0, 1.0], 0.1, gammas=[[1.0, 1.0, 1.0], [0.0] * 3],
                                      draft_seconds=0.003, verify_seconds=0.05))
    first, second = planner.acceptance.rates(0, 2)
    assert first > 0.95  # position 1: its score is its draft's, either way
    assert (second < 0.05) == later_from_drafts and (second > 0.95) != later_from_drafts
    planner.observe(RoundFeedback(0, 3, 0, [0.0, 1.0, 1.0], 0.1, gammas=[[0.0, 1.0, 1.0], [0.0] * 3]))
    assert planner.acceptance.rates(0, 2)[1] == pytest.approx(second, abs=0.02)  # position 2 never reached


def test_the_engine_plans_heads_later_positions_from_their_drafts(target):
    engine, drafters = engine_for(target, random_head(target), "normalhedge", evaluate="all")
    assert [d.name for d in drafters] == ["lookup", "head"]
    assert engine.driver.planner.later_from_drafts == [False, True]
