"""The round loop: greedy output equals plain greedy decoding for every drafter kind,
draft length and policy; caches never keep rejected tokens; budgets and EOS are honoured."""

from __future__ import annotations

import pytest
import torch

from specdraft.models.cached_lm import CachedLM
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter, SuffixDrafter
from specdraft.drafters.options import SuffixOptions
from specdraft.drafters.layers import LayersDrafter, truncated_view
from specdraft.learning.policies.base import Policy
from specdraft.learning.policies.simple import FixedPolicy, RandomPolicy
from tiny import VOCAB, plain_greedy, tiny_llama

PROMPTS = [[5, 9, 11, 3, 7, 5, 9], [1, 40, 41, 42, 40, 41], [17]]


class EveryRound(Policy):
    """Switches drafter every round, so every cache must catch up correctly."""

    name = "cycle"

    def fresh(self) -> None:
        self.t = -1

    def select(self, awake=None) -> int:
        self.t += 1
        return self.t % len(self.arms)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def pool(target):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    return [
        NgramDrafter("lookup", ctx, 1, 3),
        ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1)),
        ModelDrafter("half", ctx, truncated_view(target, 2)),
        ModelDrafter("twin", ctx, target),  # identical to the target: everything is accepted
        SuffixDrafter("suffix", ctx, SuffixOptions()),  # also drafts from the earlier prompts of the module
    ]


def run(target, drafters, policy, k, max_new=40, eos=frozenset()):
    engine = SpeculativeEngine(CachedLM(target), drafters, policy, EngineSettings(k, max_new, SamplingParams(), eos))
    return engine, engine.generate


def committed(records):
    return [t for r in records for t in r.tokens]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_drafter_and_a_switching_policy_match_plain_greedy(target, pool, k, prompt):
    reference = plain_greedy(target, prompt, 40)
    names = [d.name for d in pool]
    policies = [FixedPolicy(names, {"drafter": n}) for n in names] + [EveryRound(names), RandomPolicy(names, seed=3)]
    for policy in policies:
        _, generate = run(target, pool, policy, k)
        records = list(generate(prompt))
        assert committed(records) == reference, f"policy {policy.name} {policy.select()} with k={k}"


def test_identical_drafter_is_always_accepted(target, pool):
    _, generate = run(target, pool, FixedPolicy([d.name for d in pool], {"drafter": "twin", "draft_length": "fixed"}), 5,
                      max_new=36)
    records = list(generate(PROMPTS[0]))
    assert all(r.accepted == r.drafted for r in records)
    assert [len(r.tokens) for r in records] == [6] * 6
    assert all(abs(a - 1.0) < 1e-9 for r in records for a in r.alphas)


def test_target_cache_holds_exactly_the_committed_tokens(target, pool):
    engine, generate = run(target, pool, EveryRound([d.name for d in pool]), 4)
    context = list(PROMPTS[0])
    for record in generate(PROMPTS[0]):
        context.extend(record.tokens)
        # The target has consumed every committed token but the last, which the next verify feeds.
        assert engine.target.length == len(context) - 1
        assert engine.target.cache.get_seq_length() == len(context) - 1
        for drafter in pool:
            if isinstance(drafter, ModelDrafter):
                assert drafter.lm.length < len(context)
                assert drafter.lm.cache.get_seq_length() == drafter.lm.length


def test_budget_is_exact_and_drafts_never_overshoot_it(target, pool):
    for max_new in (1, 2, 7):
        _, generate = run(target, pool, FixedPolicy([d.name for d in pool], {"drafter": "twin"}), 5, max_new=max_new)
        records = list(generate(PROMPTS[1]))
        assert len(committed(records)) == max_new
        assert records[-1].finish == "length"
        assert all(r.drafted <= max_new - 1 for r in records)


def test_eos_ends_generation_and_is_the_last_token(target, pool):
    reference = plain_greedy(target, PROMPTS[0], 40)
    eos = reference[12]
    _, generate = run(target, pool, EveryRound([d.name for d in pool]), 5, eos=frozenset({eos}))
    records = list(generate(PROMPTS[0]))
    out = committed(records)
    assert out == reference[: reference.index(eos) + 1]
    assert records[-1].finish == "eos"


def test_records_carry_alphas_and_timings(target, pool):
    _, generate = run(target, pool, FixedPolicy([d.name for d in pool], {"drafter": "small"}), 3)
    for record in generate(PROMPTS[0]):
        assert len(record.alphas) == record.drafted
        assert all(0.0 <= a <= 1.0 + 1e-9 for a in record.alphas)
        # a model drafter drafting k tokens runs k forwards: its draft time is real time
        assert record.times.draft_s > 0 and record.times.verify_s > 0 and record.times.overhead_s > 0


def test_layers_view_shares_weights_and_leaves_the_target_whole(target):
    view = truncated_view(target, 2)
    assert len(target.model.layers) == 3 and target.config.num_hidden_layers == 3
    assert view.model.layers[0] is target.model.layers[0]
    assert view.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        full, short = target(ids).logits, view(ids).logits
    assert not torch.allclose(full, short)


def test_empty_prompt_is_refused(target, pool):
    _, generate = run(target, pool, RandomPolicy(["a"]), 3)
    with pytest.raises(ValueError, match="empty"):
        next(generate([]))


# --- learning policies and full-information evaluation ---------------------------------

from specdraft.drafters import PlainDecoding  # noqa: E402
from specdraft.learning.policies import POLICIES, build_policy  # noqa: E402


def policy_engine(target, drafters, name, k=4, max_new=40, target_lm=None, **options):
    options = {"drafter": drafters[0].name} | options if name == "fixed" else options
    policy = build_policy(name, options, [d.name for d in drafters], seed=0, draft_tokens=k, horizon=max_new)
    settings = EngineSettings(k, max_new, SamplingParams())
    return SpeculativeEngine(target_lm or CachedLM(target), drafters, policy, settings)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("options", [{}, {"evaluate": "all"}, {"draft_length": "fixed"},
                                     {"evaluate": "all", "reset": "prompt"},
                                     {"evaluate": "all", "objective": "acceptance", "draft_length": "fixed",
                                      "allow_none": False}])
def test_every_policy_keeps_greedy_output_identical(target, pool, name, options):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target)  # shared with the layers drafter, which drafts over its cache
    drafters = pool + [LayersDrafter("shared", ctx, target_lm, 2), PlainDecoding(ctx)]
    reference = plain_greedy(target, PROMPTS[0], 40)
    engine = policy_engine(target, drafters, name, target_lm=target_lm, **options)
    for _ in range(2):  # a second prompt starts from reset state (or keeps it): same text either way
        records = list(engine.generate(PROMPTS[0]))
        assert committed(records) == reference
        evaluated = sum(len(r.learning.evaluated or ()) for r in records)
        if not engine.driver.full_information:
            assert evaluated == 0
        elif engine.policy.goodput and engine.policy.forgets_per_prompt:
            # the policy forgets before the next prompt: its last rounds are not scored
            assert records[-1].learning.evaluated is None and 1 <= evaluated < len(records)
        elif engine.policy.evaluation_sampled:  # adaptive: one round in m, the last one always
            assert 1 <= evaluated <= len(records) and records[-1].learning.evaluated
        else:  # every round, in batches or one by one
            assert evaluated == len(records)


def test_full_information_keeps_every_cache_in_sync(target, pool):
    # (The acceptance objective scores every drafter: goodput skips the hopeless ones.)
    engine = policy_engine(target, pool, "normalhedge", update_every=1, objective="acceptance")
    context = list(PROMPTS[1])
    for record in engine.generate(PROMPTS[1]):
        context.extend(record.tokens)
        assert [len(g) for g in record.learning.gammas] == [len(record.tokens)] * len(pool)
        assert all(0.0 <= g <= 1.0 + 1e-9 for gs in record.learning.gammas for g in gs)
        for drafter in pool:
            if isinstance(drafter, ModelDrafter) and record.finish is None:
                # scored through the round's last token, or drafted all it accepted and one more
                assert len(context) - 1 <= drafter.lm.length <= len(context)
        twin = record.learning.gammas[3]
        assert twin == pytest.approx([1.0] * len(twin))


def test_counterfactual_gammas_equal_what_the_drafter_scores_when_chosen(target, pool):
    """A drafter's gamma at a position depends only on the context, so the value seen when
    it drafted and the value from evaluating it while another drafter ran must agree."""
    by_position = {}
    for chosen in ("small", "lookup", "half"):
        engine = policy_engine(target, pool, "fixed", drafter=chosen, evaluate="all")
        position = len(PROMPTS[0])
        for record in engine.generate(PROMPTS[0]):
            for arm, gammas in enumerate(record.learning.gammas or ()):  # a prompt's last round is not scored
                for offset, gamma in enumerate(gammas or ()):  # (nor a drafter the planner leaves out)
                    key = (arm, position + offset)
                    by_position.setdefault(key, []).append(gamma)
            position += len(record.tokens)
    assert any(len(v) > 1 for v in by_position.values())
    for key, values in by_position.items():
        assert values == pytest.approx([values[0]] * len(values), abs=1e-9), key


def test_evaluation_time_is_reported(target, pool):
    engine = policy_engine(target, pool, "normalhedge", update_every=1)
    records = list(engine.generate(PROMPTS[0]))
    assert all(r.times.evaluate_s > 0 for r in records[:-1])  # the last round is not scored (the policy resets)
    assert records[0].times.prefill_s > 0 and all(r.times.prefill_s == 0 for r in records[1:])


def counting_feeds(drafter):
    """Record the width of every forward `drafter` runs over its own cache."""
    widths, feed = [], drafter.lm.feed

    def counted(tokens, keep=1):
        widths.append(tokens.shape[-1])
        return feed(tokens, keep)

    drafter.lm.feed = counted
    return widths


def test_full_information_prefills_the_drafters_before_the_first_round(target):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    small = ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1))
    engine = policy_engine(target, [NgramDrafter("lookup", ctx, 1, 3), small], "normalhedge", update_every=1)
    widths = counting_feeds(small)
    rounds = engine.generate(PROMPTS[0])
    first = next(rounds)
    assert widths[0] == len(PROMPTS[0]) - 1  # the prompt, before any round ran
    assert first.times.prefill_s > 0
    rounds.close()
    # Without full information nothing is prefilled (a bandit may never choose a drafter):
    # the drafter's first forward is its first draft's catch-up over the whole prompt.
    bandit = policy_engine(target, [NgramDrafter("lookup", ctx, 1, 3), small], "fixed", drafter="small")
    widths.clear()
    bandit_rounds = bandit.generate(PROMPTS[0])
    next(bandit_rounds)
    bandit_rounds.close()
    assert widths and widths[0] == len(PROMPTS[0])


@pytest.mark.parametrize("policy", ["normalhedge", "cycle"])
def test_model_drafters_left_out_of_scoring_are_not_prefilled_and_catch_up_when_they_draft(target, pool, policy,
                                                                                           monkeypatch):
    """Goodput leaves a drafter scored by its own forwards out of evaluation once it is
    measured and not worth playing (here: always, by an impossible margin); it is then not
    prefilled at the next prompt, and when the policy plays it all the same (the cycling
    one does every few rounds), its cache catches up over everything it missed: output
    stays plain greedy decoding's."""
    from specdraft.learning.planner import RoundPlanner

    monkeypatch.setattr(RoundPlanner, "COSTLY_MARGIN", 1e9)
    prepared = []
    for drafter in pool:
        monkeypatch.setattr(drafter, "prepare_scoring", lambda context, name=drafter.name: prepared.append(name))
    names = [d.name for d in pool]
    if policy == "cycle":
        settings = EngineSettings(4, 40, SamplingParams())
        engine = SpeculativeEngine(CachedLM(target), pool, EveryRound(names, {"evaluate": "all"}), settings)
    else:
        engine = policy_engine(target, pool, policy, update_every=1, reset="carry")
    models = [d.name for d in pool if d.traits.scored_by_own_forward]
    assert models == ["small", "half", "twin"]
    drafted = set()
    for n, prompt in enumerate(PROMPTS[:2] * 2):
        prepared.clear()
        records = list(engine.generate(prompt))
        assert committed(records) == plain_greedy(target, prompt, 40)
        # Each drafted in the first prompt (a cost probe), so all are measured after it.
        assert engine.driver.scored_now()[1:4] == [False] * 3
        if n:
            assert not set(prepared) & set(models)  # none of them was prefilled
            drafted |= {r.drafter for r in records if r.drafted and r.drafter in models}
    assert policy != "cycle" or drafted  # one caught up over what it sat out (the others plan K = 0)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)])
def test_a_draft_after_scoring_starts_from_the_scored_logits_without_a_forward(sampling):
    """Scoring feeds through the last committed token and keeps its logits; the next draft
    starts from them (k - 1 forwards, not k) and is the draft a fresh cache gives."""
    model = tiny_llama(seed=1, layers=1)
    context = [5, 9, 11, 3, 7, 5, 9, 2, 4, 6]
    prompt = 6
    fresh_ctx, ctx = (DraftContext(sampling, torch.Generator().manual_seed(0), torch.device("cpu"), VOCAB)
                      for _ in range(2))
    scored = ModelDrafter("scored", ctx, model)
    scored.prepare_scoring(context[:prompt])
    assert scored.lm.length == prompt - 1
    probs = torch.full((len(context) - prompt, VOCAB), 1.0 / VOCAB)
    gammas = scored.score(context, prompt, len(context) - prompt, probs)
    assert scored.lm.length == len(context)
    widths = counting_feeds(scored)
    draft = scored.propose(context, 4)
    assert widths == [1, 1, 1]  # the draft's own steps only: no catch-up forward
    reference = ModelDrafter("fresh", fresh_ctx, model).propose(context, 4)
    assert draft.tokens.tolist() == reference.tokens.tolist()
    torch.testing.assert_close(draft.probs, reference.probs)
    # The gammas are the uncached distributions' overlap at each scored position.
    logits = model(torch.tensor([context])).logits[0, prompt - 1 : len(context) - 1]
    q = torch.softmax(logits, -1) if not sampling.greedy else None
    expected = (torch.minimum(probs, q).sum(-1) if q is not None
                else torch.full((len(context) - prompt,), 1.0 / VOCAB))
    torch.testing.assert_close(gammas.float(), expected.float(), atol=1e-5, rtol=1e-4)


def test_a_rejected_draft_keeps_the_scored_logits_only_while_their_token_stays(target):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafter = ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1))
    context = [5, 9, 11, 3, 7, 5, 9]
    drafter.score(context, 4, 3, torch.full((3, VOCAB), 1.0 / VOCAB))
    draft = drafter.propose(context, 3)
    drafter.on_commit(0)  # all rejected: the cache is back at the committed context
    assert drafter.lm.length == len(context)
    wrong = (int(draft.tokens[0]) + 1) % VOCAB
    widths = counting_feeds(drafter)
    again = drafter.propose(context + [wrong], 2)
    assert widths == [1, 1]  # caught up on the one new token, then one step
    fresh = ModelDrafter("fresh", ctx, drafter.lm.model).propose(context + [wrong], 2)
    assert again.tokens.tolist() == fresh.tokens.tolist()


@pytest.mark.parametrize("update_every", [3, 7])
def test_batched_evaluation_gives_the_same_gammas_as_per_round(target, pool, update_every):
    """update_every = m evaluates m rounds at once; every round's gammas must be what
    per-round evaluation gives, whichever drafters were chosen in between."""
    def evaluated(engine):
        for drafter in pool:  # the suffix drafter's history of earlier prompts would differ between the runs
            drafter.forget_run()
        out = []
        for record in engine.generate(PROMPTS[0]):
            out.extend(record.learning.evaluated or [])
        return out

    # Fixed draft lengths: with "goodput" K would follow this machine's timings, which differ run to run.
    # reset = "never": the prompt's last rounds are scored too (a policy that resets would skip them)
    every = evaluated(policy_engine(target, pool, "random", evaluate="all", draft_length="fixed", reset="never"))
    batched_engine = policy_engine(target, pool, "random", evaluate="all", draft_length="fixed", reset="never")
    batched_engine.policy.evaluation_interval = lambda: update_every
    batched = evaluated(batched_engine)
    assert [arm for arm, _ in batched] == [arm for arm, _ in every]
    for (_, a), (_, b) in zip(every, batched):
        for row_a, row_b in zip(a, b, strict=True):
            assert row_a == pytest.approx(row_b, abs=1e-9)


def test_a_lookup_scored_on_the_committed_tokens_gets_what_the_targets_distribution_gives(target, monkeypatch):
    """Under greedy decoding a token-id drafter is scored against the committed tokens (no
    one-hot distribution built), and so is the plain arm (0 everywhere): on every
    evaluated batch their gammas must equal, exactly, what the target's distributions
    give, and no distribution is built for them."""
    import specdraft.decoding.evaluation as evaluation
    from specdraft.decoding.evaluation import PoolEvaluator

    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    pool = [NgramDrafter("lookup", ctx, 1, 3), NgramDrafter("bigram", ctx, 2, 2), PlainDecoding(ctx)]
    scored, evaluate, built = [], PoolEvaluator.__call__, []
    build = evaluation.distributions
    monkeypatch.setattr(evaluation, "distributions", lambda *a: built.append(1) or build(*a))

    def both_ways(self, rounds, skip=()):
        assert self.by_tokens == [True, True, True]
        by_tokens = evaluate(self, rounds, skip)
        assert not built  # nothing in this pool needs the target's distributions
        self.by_tokens = [False] * len(pool)  # (lookups keep no state that scoring changes)
        assert evaluate(self, rounds, skip) == by_tokens
        assert built
        built.clear()
        self.by_tokens = [True, True, True]
        scored.extend(g for gammas in by_tokens for g in gammas[:2] if g is not None)
        return by_tokens

    monkeypatch.setattr(PoolEvaluator, "__call__", both_ways)
    engine = policy_engine(target, pool, "normalhedge", update_every=3)
    for prompt in PROMPTS:
        assert committed(list(engine.generate(prompt))) == plain_greedy(target, prompt, 40)
    assert {0.0, 1.0} <= set(sum(scored, []))  # (scored, right and wrong)


def test_greedy_alignment_is_exact_acceptance(target, pool):
    """Under greedy decoding alpha is 1 exactly where the drafted token is the target's
    argmax: the count of leading ones is the accepted length."""
    _, generate = run(target, pool, EveryRound([d.name for d in pool]), 4)
    for record in generate(PROMPTS[0]):
        assert set(record.alphas) <= {0.0, 1.0}
        leading = next((j for j, a in enumerate(record.alphas) if a == 0.0), len(record.alphas))
        assert leading == record.accepted


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_hindsight_best_by_regret_is_the_drafter_that_accepts_most_when_fixed(target, prompt):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1)),
                ModelDrafter("half", ctx, truncated_view(target, 2))]
    accepted = {}
    for d in drafters:
        records = list(policy_engine(target, drafters, "fixed", drafter=d.name, draft_length="fixed").generate(prompt))
        accepted[d.name] = sum(r.accepted for r in records) / len(records)
    # Every round evaluated, every drafter scored (goodput would skip the ones that cannot be
    # fastest): the hindsight comparison is over the whole run, not a sample.
    engine = policy_engine(target, drafters, "normalhedge", update_every=1, objective="acceptance")
    from specdraft.session.stats import GenerationStats

    stats = GenerationStats([d.name for d in drafters], 4)
    for record in engine.generate(prompt):
        stats.add(record)
    ranked = sorted(accepted, key=accepted.get, reverse=True)
    assert accepted[ranked[0]] > accepted[ranked[1]], accepted  # a clear winner to agree with
    assert stats.best_drafter == ranked[0], (accepted, stats.regret_tracker.totals)
    totals = dict(zip([d.name for d in drafters], stats.regret_tracker.totals))
    assert sorted(totals, key=totals.get, reverse=True) == ranked, (accepted, totals)


class FirstAwake(Policy):
    """Prefers the first arm whenever it is awake (a learner whose favourite is lookup)."""

    name = "first-awake"

    def select(self, awake=None) -> int:
        return self.awake_arms(awake)[0]


def test_a_drafter_that_would_propose_nothing_is_passed_over(target):
    """Sleeping experts: where prompt lookup finds no match the engine tells the policy, which
    hands the round to the next arm instead of wasting it as a plain one; output stays greedy."""
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    lookup, twin = NgramDrafter("lookup", ctx, 1, 3), ModelDrafter("twin", ctx, target)
    prompt = PROMPTS[0]
    engine = SpeculativeEngine(CachedLM(target), [lookup, twin], FirstAwake(["lookup", "twin"], draft_tokens=3),
                               EngineSettings(3, 40, SamplingParams()))
    context, asleep, probe = list(prompt), 0, NgramDrafter("probe", ctx, 1, 3)
    for record in engine.generate(prompt):
        if probe.awake_at(context, len(context)):
            assert record.drafter == "lookup"
        else:
            asleep += 1
            assert record.drafter == "twin", record
        context.extend(record.tokens)
    assert asleep > 0
    assert context[len(prompt):] == plain_greedy(target, prompt, 40)


def narrowing_curve(widest):
    """Verify seconds by width that fall as the width grows: every verify is padded to `widest`."""
    return [2.0 - w / widest for w in range(1, widest + 1)]


@pytest.mark.parametrize("k", [2, 5])
def test_a_verify_padded_to_a_cheaper_width_keeps_output_and_caches_exact(target, pool, k):
    """Padding the verify with filler tokens (when a wider forward is cheaper) must change
    nothing committed, for every kind (a self-drafter writing into the target's own cache
    included), and the padding must leave no trace in the target's cache."""
    target_lm = CachedLM(target)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = pool + [LayersDrafter("shared", ctx, target_lm, 2)]
    policy = EveryRound([d.name for d in drafters])
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(k, 40, SamplingParams()))
    engine.driver.planner.costs.verify.install(narrowing_curve(k + 4))
    for prompt in PROMPTS:
        context = list(prompt)
        for record in engine.generate(prompt):
            assert record.verify_width == k + 4  # padded past the widest a round drafts
            context.extend(record.tokens)
            assert target_lm.length == len(context) - 1 == target_lm.cache.get_seq_length()
        assert context[len(prompt):] == plain_greedy(target, prompt, 40)


@pytest.mark.parametrize("reset", ["prompt", "never"])
def test_a_prompts_last_rounds_are_scored_only_when_the_policy_keeps_what_it_learns(target, pool, reset):
    """Scoring drafters on the last rounds of a prompt costs their forwards; a policy that
    forgets before the next prompt would never use it. Those rounds still teach the costs."""
    engine = policy_engine(target, pool, "normalhedge", update_every=1, reset=reset)
    records = list(engine.generate(PROMPTS[1]))
    assert (records[-1].learning.evaluated is None) == (reset == "prompt")
    assert all(r.learning.evaluated for r in records[:-1])
    costs = engine.driver.planner.costs  # every round, the last included, taught the verify cost
    assert costs.verify.line.w == pytest.approx((1 - costs.decay ** len(records)) / (1 - costs.decay))


@pytest.mark.parametrize("update_every", [4, "adaptive"])
@pytest.mark.parametrize("flip_every", [0, 3])
def test_a_drafter_scored_from_hidden_states_sits_out_whole_batches_the_planner_skips_it_in(target, pool,
                                                                                             monkeypatch, flip_every,
                                                                                             update_every):
    """The verify hands over a layers drafter's hidden states only for batches that score
    it; in the others it is asleep for the choice and gets no gammas. With the planner's
    decision changing from batch to batch (under sampled evaluation, from one evaluation
    cycle to the next), each evaluation scores it only on rounds that all handed its
    states over. Output stays plain greedy decoding's."""
    from specdraft.learning.driver import PolicyDriver

    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target)
    shared = LayersDrafter("shared", ctx, target_lm, 2)
    drafters = [pool[0], shared, PlainDecoding(ctx)]  # (plain decoding is always awake)
    engine = policy_engine(target, drafters, "normalhedge", target_lm=target_lm, update_every=update_every,
                           warmup_rounds=0)
    calls = {"n": 0}

    def scored_now(self):
        calls["n"] += 1
        return [True, bool(flip_every) and (calls["n"] // flip_every) % 2 == 1, True]

    monkeypatch.setattr(PolicyDriver, "scored_now", scored_now)
    fed = []
    feed = target_lm.feed_with_hidden
    monkeypatch.setattr(target_lm, "feed_with_hidden", lambda tokens, keep, layers: fed.append(tuple(layers))
                        or feed(tokens, keep, layers))
    records = list(engine.generate(PROMPTS[0]))
    assert committed(records) == plain_greedy(target, PROMPTS[0], 40)
    verifies = fed[1:]  # (the first feed is the prompt's prefill)
    scored_rounds = [gammas[1] is not None for r in records for _, gammas in (r.learning.evaluated or ())]
    if not flip_every:
        assert set(verifies) == {()} and not any(scored_rounds)
        assert all(r.drafter != "shared" for r in records)
    else:  # some batches collect layer 2 and score it, the others neither
        assert {(), (2,)} <= set(verifies) and any(scored_rounds) and not all(scored_rounds)
    # Decided once per batch (per evaluation cycle when sampled), and once for the prefill.
    evaluations = sum(len(r.learning.evaluated or ()) for r in records)
    assert calls["n"] <= 1 + len(records) // (1 if update_every == "adaptive" else 4) + 1
    if update_every == "adaptive":
        assert evaluations < len(records) and calls["n"] <= evaluations + 2


def test_a_prompts_budget_cuts_below_the_settings_and_never_above(target, pool):
    """`generate(prompt, budget)`: a request's max_tokens (the resident server) under the cap."""
    names = [d.name for d in pool]
    engine, generate = run(target, pool, RandomPolicy(names, seed=1), 4, max_new=20)
    prompt = PROMPTS[0]
    reference = plain_greedy(target, prompt, 20)
    assert committed(generate(prompt, 7)) == reference[:7]
    assert committed(generate(prompt, 500)) == reference  # the settings' 20 stay the cap
