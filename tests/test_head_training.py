"""What a draft head learns (training/head.py): the loss over learned pairs, unrolled draft
steps on the head's own predictions, bf16 autocast, held-out metrics, the draft vocabulary,
the fused-layers start, and training that lowers the KL and drafts what the target says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heads import PROMPTS, engine_for, head_objective, trained_head
from specdraft.training.features import RowBatches, extract_features
from specdraft.training.head import HeadObjective, HeadTrainingSettings, draft_vocabulary, new_head
from tiny import VOCAB, plain_greedy, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=3)


def test_a_head_trained_on_the_targets_own_text_drafts_what_the_target_says():
    """Trained on the target's greedy continuations of a few prompts (self-distillation), a
    head drafts most of what the target then says for one of them: training and drafting
    pair features and tokens the same way."""
    target = tiny_llama(seed=0, layers=2, scale=6.0)  # sharp: the target's argmax is clear
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    tokens = np.array([p + plain_greedy(target, p, 45) for p in prompts], dtype=np.int32)
    head, _ = trained_head(target, tokens, steps=200, lr=1e-2)
    engine, _ = engine_for(target, head, "fixed", draft_length="fixed")
    records = list(engine.generate(prompts[0]))
    assert [t for r in records for t in r.tokens] == plain_greedy(target, prompts[0], 32)
    assert sum(r.accepted for r in records) > 0.5 * sum(r.drafted for r in records)


def test_a_few_training_steps_lower_the_kl():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, size=(8, 48)).astype(np.int32)
    _, (before, after) = trained_head(target, tokens, steps=40, lr=1e-2)
    assert after["kl"] < 0.7 * before["kl"]


def test_bf16_autocast_training_computes_the_same_loss_and_lowers_the_kl():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(0).integers(3, VOCAB, size=(8, 48)).astype(np.int32)
    objective = head_objective(target, tokens, None, unroll=2)
    batch = objective.batch(np.arange(4))
    exact, _ = objective.loss(*batch, noise=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded, _ = objective.loss(*batch, noise=False)
    assert rounded.dtype == torch.float32  # the loss itself stays float32
    rounded_value, exact_value = float(rounded.detach()), float(exact.detach())
    assert rounded_value == pytest.approx(exact_value, rel=0.05) and rounded_value != exact_value
    # a training step autocasts exactly when the settings say so
    steps = {}
    for bf16 in (False, True):
        objective.settings.bf16 = bf16
        objective.batches = RowBatches(np.arange(4), 4, 0)
        steps[bf16] = float(objective.step(0)[0].detach())
    assert steps[False] == pytest.approx(exact_value, rel=1e-5)
    assert steps[True] != pytest.approx(exact_value, rel=1e-5)
    _, (before, after) = trained_head(target, tokens, steps=40, lr=1e-2, bf16=True)
    assert after["kl"] < 0.7 * before["kl"]


def test_the_unrolled_loss_over_ragged_masks_is_the_dense_weighted_one():
    """The loss reads out only the pairs that count; it must equal weighing every pair."""
    import torch.nn.functional as F

    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(4).integers(3, VOCAB, size=(3, 16)).astype(np.int32)
    mask = np.random.default_rng(5).random((3, 16)) < 0.6  # a different mask in every row
    objective = head_objective(target, tokens, mask, unroll=3)
    tokens_t, features, learned = objective.batch(np.arange(3))
    loss, metrics, counts = objective.weighed_loss(tokens_t, features, learned, noise=False)

    head, readout = objective.head, objective.readout
    inputs = head.fused(features[:, :-1])
    embeddings = objective.embed(tokens_t[:, 1:]).float()
    goal = features[:, 1:, -head.config.hidden_size:]
    log_p = F.log_softmax(readout.small(goal).float(), dim=-1)
    weight = torch.cat([learned[:, 2:], learned[:, -1:]], dim=1).float()
    positions = torch.arange(15).expand(3, -1)
    dense = torch.zeros(())
    for (depth, suffix), predicted in zip(enumerate(("", "@2", "@3"), start=1),
                                          objective.depth_predictions(embeddings, inputs, positions, 3)):
        log_q = F.log_softmax(readout.small(predicted).float(), dim=-1)
        count = weight.sum().clamp_min(1.0)
        kl = ((log_p.exp() * (log_p - log_q)).sum(-1) * weight).sum() / count
        regression = (F.smooth_l1_loss(predicted, goal, reduction="none").mean(-1) * weight).sum() / count
        top1 = ((log_q.argmax(-1) == log_p.argmax(-1)).float() * weight).sum() / count
        dense = dense + (kl + regression) / 3
        assert metrics["kl" + suffix] == pytest.approx(float(kl.detach()), rel=1e-5)
        assert metrics["top1" + suffix] == pytest.approx(float(top1), rel=1e-6)
        assert counts[suffix] == float(weight.sum())
        goal, log_p, weight = goal[:, 1:], log_p[:, 1:], weight[:, 1:]
    assert float(loss.detach()) == pytest.approx(float(dense.detach()), rel=1e-5)


def test_each_unrolled_depth_predicts_what_the_head_computes_when_it_drafts_that_token():
    """EAGLE-3's training-time test: the a-th drafted token after the committed text at
    p - a + 1 is predicted from the head's cache of the real pairs up to there and its own
    a - 1 drafted steps since; training's depth a at position p must compute exactly that
    (not attend to its own predictions at every earlier position)."""
    import copy

    from specdraft.drafters.head import HeadCache

    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(6).integers(3, VOCAB, size=(1, 14)).astype(np.int32)
    objective = head_objective(target, tokens, None, unroll=3)
    tokens_t, features, _ = objective.batch(np.arange(1))
    head = objective.head.eval()
    with torch.no_grad():
        embeddings = objective.embed(tokens_t[:, 1:]).float()
        depths = objective.depth_predictions(embeddings, head.fused(features[:, :-1]), torch.arange(13).view(1, -1), 3)
    assert [d.shape[1] for d in depths] == [13, 12, 11]
    drafting = HeadCache(copy.deepcopy(head), target, VOCAB)
    context = tokens[0].tolist()
    for depth, predicted in enumerate(depths, start=1):
        for p in range(depth - 1, 13):
            drafting.reset()
            drafting.observe(0, features[0])
            drafting.consume(context, p - depth + 3, 1)  # the real pairs at positions 0 .. p - depth + 1
            for b in range(2, depth + 1):  # drafted steps at p - depth + 2 .. p, fed the text's tokens
                drafting.step(torch.tensor(context[p - depth + b + 1]))
            torch.testing.assert_close(drafting.last[0, -1], predicted[0, p - depth + 1], rtol=1e-4, atol=1e-4)


def test_the_drafting_mask_is_causal_for_one_depth_and_diagonal_beyond():
    from specdraft.training.head import drafting_mask

    assert torch.equal(drafting_mask([4], torch.device("cpu"))[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    mask = drafting_mask([3, 2], torch.device("cpu"))[0, 0].int()
    # depth 2 at positions 1, 2: the real pairs up to the position before, and itself
    assert mask[3].tolist() == [1, 0, 0, 1, 0] and mask[4].tolist() == [1, 1, 0, 0, 1]
    assert mask[:3, 3:].sum() == 0  # depth 1 never reads a drafted step


def test_the_draft_vocabulary_is_the_most_frequent_tokens_plus_the_required_ones():
    tokens = np.array([[5, 5, 5, 6, 6, 7, 8]], dtype=np.int32)
    assert draft_vocabulary(tokens, 2, 10).tolist() == [5, 6]
    assert draft_vocabulary(tokens, 3, 10, always=(2,)).tolist() == [2, 5, 6]
    assert draft_vocabulary(tokens, 50, 10).tolist() == list(range(10))


def test_unrolled_training_scores_the_second_draft_step_on_the_heads_own_prediction(tmp_path):
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(0).integers(3, VOCAB, size=(4, 16)).astype(np.int32)
    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], tmp_path / "f")
    head = new_head(target, draft_vocabulary(tokens, VOCAB, VOCAB))
    objective = HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=4, unroll=2, noise=0.0),
                              np.arange(4), torch.device("cpu"))
    loss, metrics = objective.step(0)
    assert set(metrics) == {"kl", "top1", "kl@2", "top1@2"}
    # depth 2 reads depth 1's predictions: its inputs depend on the head's weights twice
    loss.backward()
    assert head.fc.weight.grad is not None and torch.isfinite(loss)
    one, _ = objective.loss(*objective.batch(np.arange(4)), noise=False, unroll=1)
    two, m2 = objective.loss(*objective.batch(np.arange(4)), noise=False, unroll=2)
    assert float(two.detach()) != pytest.approx(float(one.detach()))


def test_the_head_loss_counts_only_pairs_whose_predicted_token_is_learned():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(1).integers(3, VOCAB, size=(2, 12)).astype(np.int32)
    mask = np.ones((2, 12), dtype=bool)
    mask[:, :5] = False  # a chat prompt: tokens 0-4 are never drafted
    objective = head_objective(target, tokens, mask)
    tokens_t, features, learned = objective.batch(np.arange(2))
    assert not learned[:, :5].any() and learned[:, 5:].all()

    def loss(positions):  # pairs whose predicted token (pair t predicts token t + 2) is learned
        only = torch.zeros(2, 12, dtype=torch.bool)
        only[:, [p + 2 for p in positions]] = True
        return objective.loss(tokens_t, features, only, noise=False)[0].item()

    each = [loss([t]) for t in range(10)]  # pairs 0..9 predict tokens 2..11
    assert len(set(round(e, 6) for e in each)) > 5  # the pairs' losses differ, so the means below can tell
    masked, _, counts = objective.weighed_loss(tokens_t, features, learned, noise=False)
    # pairs 3..9 predict learned tokens 5..11; pair 10 (the last) counts as token 11 does
    last = objective.loss(tokens_t, features, torch.ones(2, 12, dtype=torch.bool), noise=False)[0].item() * 11 \
        - sum(each)
    assert masked.item() == pytest.approx((sum(each[3:]) + last) / 8, rel=1e-4)
    assert counts[""] == 2 * 8


def test_held_out_metrics_are_means_over_learned_tokens_not_over_batches():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(2).integers(3, VOCAB, size=(3, 12)).astype(np.int32)
    mask = np.ones((3, 12), dtype=bool)
    mask[2, :11] = False  # the third sequence has a single learned token
    objective = head_objective(target, tokens, mask)
    whole = objective.evaluate(np.arange(3))
    objective.settings.batch_sequences = 1  # three batches of very different sizes
    split = objective.evaluate(np.arange(3))
    assert split["kl"] == pytest.approx(whole["kl"], rel=1e-4)
    assert split["top1@2"] == pytest.approx(whole["top1@2"], rel=1e-4)


def test_unrolling_deeper_trains_each_later_draft_step_on_the_heads_own_predictions():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(3).integers(3, VOCAB, size=(2, 16)).astype(np.int32)
    objective = head_objective(target, tokens, None, unroll=4)
    loss, metrics = objective.step(0)
    assert set(metrics) == {f"{name}{depth}" for name in ("kl", "top1") for depth in ("", "@2", "@3", "@4")}
    counts = objective.weighed_loss(*objective.batch(np.arange(2)), noise=False)[2]
    assert counts == {"": 2 * 15, "@2": 2 * 14, "@3": 2 * 13, "@4": 2 * 12}  # one pair fewer per depth
    three, _ = objective.loss(*objective.batch(np.arange(2)), noise=False, unroll=3)
    four, _ = objective.loss(*objective.batch(np.arange(2)), noise=False, unroll=4)
    assert float(three.detach()) != pytest.approx(float(four.detach()))
    loss.backward()
    assert torch.isfinite(loss) and head_has_gradients(objective.head)


def head_has_gradients(head):
    """Every weight the head drafts with got a gradient (its unused 1-row token table aside)."""
    return all(p.grad is not None for name, p in head.named_parameters() if not name.startswith("body.embed_tokens"))


def test_a_head_reading_lower_layers_starts_as_the_final_feature_head_does(target):
    """`fuse` starts as 'take the final feature': before training, reading more layers
    changes nothing, so training starts from the recipe that reads the final feature only."""
    from specdraft.training.head import new_head

    ids = draft_vocabulary(np.arange(VOCAB), VOCAB, VOCAB)
    torch.manual_seed(0)
    plain = new_head(target, ids).double()
    torch.manual_seed(0)
    fused = new_head(target, ids, (1, 2)).double()
    assert fused.config.layers_read == [1, 2, 3] and plain.config.layers_read == [3]
    ids_t = torch.tensor([PROMPTS[0]])
    states = target(ids_t, output_hidden_states=True).hidden_states
    side_by_side = torch.cat([states[layer] for layer in (1, 2, 3)], dim=-1)
    positions = torch.arange(ids_t.shape[1]).view(1, -1)
    embeddings = target.get_input_embeddings()(ids_t)
    torch.testing.assert_close(fused(embeddings, fused.fused(side_by_side), positions),
                               plain(embeddings, plain.fused(states[3]), positions))

