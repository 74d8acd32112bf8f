"""The target's features cached on disk (training/features.py): a folder with more layers
serves fewer, other data is never served, a damaged cache starts over, and the feature pass
runs packed and leaves the target as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft.training.features import extract_features
from tiny import VOCAB, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=3)


def test_a_features_folder_with_more_layers_serves_without_a_target_pass_but_not_other_data(target, tmp_path):
    from specdraft.training.features import finished

    tokens = np.random.default_rng(4).integers(3, VOCAB, size=(3, 10)).astype(np.int32)
    folder = tmp_path / "f"
    full = extract_features(target, tokens, [1, 3], folder)
    assert finished(folder, tokens, [3]) and finished(folder, tokens, [1, 3]) and not finished(folder, tokens, [2])
    calls = []
    hook = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        fewer = extract_features(target, tokens, [3], folder)
    finally:
        hook.remove()
    assert calls == [] and set(fewer.features) == {3}
    assert np.array_equal(fewer.features[3], full.features[3])
    other = tokens[::-1].copy()  # same shape, other data: never served from this folder
    assert not finished(folder, other, [3])
    again = extract_features(target, other, [3], folder)
    fresh = extract_features(target, other, [3], tmp_path / "g")
    assert np.array_equal(again.features[3], fresh.features[3])


@pytest.mark.parametrize("damage", ["done", "meta", "array"])
def test_a_damaged_features_cache_starts_over_instead_of_failing(target, tmp_path, damage):
    """A cache left by a kill or a full disk (a truncated done.json or meta.json, a missing
    array) used to make every later `train head` exit 1 until the folder was deleted."""
    from specdraft.training.features import finished

    tokens = np.random.default_rng(5).integers(3, VOCAB, size=(3, 10)).astype(np.int32)
    fresh = extract_features(target, tokens, [2], tmp_path / "fresh")
    folder = tmp_path / "f"
    extract_features(target, tokens, [2], folder)
    if damage == "array":
        (folder / "features-2.npy").unlink()
    else:
        path = folder / f"{damage}.json"
        path.write_text(path.read_text()[:5])
    assert not finished(folder, tokens, [2])
    again = extract_features(target, tokens, [2], folder)
    assert np.array_equal(again.features[2], fresh.features[2]) and finished(folder, tokens, [2])


def test_the_feature_pass_runs_packed_and_leaves_the_target_as_it_was(tmp_path):
    """The feature pass runs the target's linears packed (a CPU build with oneDNN) and keeps
    no logits but the last: its features are the dense forward's up to float rounding, and
    the target's own nn.Linear modules are back afterwards (training reads them densely)."""
    from specdraft.models.kernels.packed_linear import PackedLinear, packed_while

    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    tokens = np.random.default_rng(0).integers(3, VOCAB, size=(3, 16)).astype(np.int32)
    layers = [1, target.config.num_hidden_layers]
    with packed_while(target) as packed:
        assert packed == torch.backends.mkldnn.is_available()
        assert any(isinstance(m, PackedLinear) for m in target.modules()) == packed
    data = extract_features(target, tokens, layers, tmp_path / "f")
    assert [m for m in target.modules() if type(m) is torch.nn.Linear] == linears
    assert not any(isinstance(m, PackedLinear) for m in target.modules())
    with torch.inference_mode():
        dense = target(torch.from_numpy(tokens.astype(np.int64)), output_hidden_states=True).hidden_states
    for layer in layers:
        torch.testing.assert_close(torch.from_numpy(np.asarray(data.features[layer], dtype=np.float32)),
                                   dense[layer].half().float(), rtol=2e-3, atol=2e-3)

