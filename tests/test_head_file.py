"""A head on disk (head.json + head.safetensors): saved and loaded with the same outputs,
the layers it reads, older formats, and refusal of another target's head or of non-finite
weights."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.drafters.head_model import DraftHead, HeadFileError, load_head, save_head
from tiny import random_head, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=3)


def test_a_head_for_another_target_is_refused(target, tmp_path):
    save_head(tmp_path / "h", random_head(target))
    assert isinstance(load_head(tmp_path / "h", target), DraftHead)
    other = tiny_llama(seed=9, layers=3)  # same shapes, other weights
    with pytest.raises(HeadFileError, match="another model of the same shape"):
        load_head(tmp_path / "h", other)
    wider = tiny_llama(seed=0, layers=3, hidden=48)
    with pytest.raises(HeadFileError, match="hidden_size = 32"):
        load_head(tmp_path / "h", wider)
    with pytest.raises(HeadFileError, match="no such folder"):
        load_head(tmp_path / "missing", target)


def test_a_saved_head_loads_with_the_same_outputs(target, tmp_path):
    head = random_head(target, [1, 2, 5, 9]).double()
    save_head(tmp_path / "h", head, {"steps": 3})
    loaded = load_head(tmp_path / "h", target).double()
    assert torch.equal(loaded.vocab_ids, head.vocab_ids)
    x = torch.randn(1, 4, target.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(4).view(1, 4)
    assert torch.allclose(loaded(x, x, positions), head(x, x, positions))
    assert json.loads((tmp_path / "h" / "head.json").read_text())["trained"] == {"steps": 3}


def test_a_head_reading_lower_layers_saves_and_loads_and_a_format_1_head_still_loads(target, tmp_path):
    head = random_head(target, [1, 2, 5, 9], lower_layers=(2,)).double()
    save_head(tmp_path / "h", head)
    loaded = load_head(tmp_path / "h", target).double()
    assert loaded.config.layers_read == [2, 3] and loaded.fuse is not None
    x = torch.randn(1, 4, 2 * target.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded.fused(x), head.fused(x))
    old = random_head(target, [1, 2, 5, 9])  # written before heads named the layers they read
    save_head(tmp_path / "old", old)
    config = json.loads((tmp_path / "old" / "head.json").read_text())
    del config["feature_layers"]
    config["format"] = 1
    (tmp_path / "old" / "head.json").write_text(json.dumps(config))
    assert load_head(tmp_path / "old", target).config.layers_read == [3]
    config["format"] = 9
    (tmp_path / "old" / "head.json").write_text(json.dumps(config))
    with pytest.raises(HeadFileError, match="format 9"):
        load_head(tmp_path / "old", target)


def test_a_head_with_non_finite_weights_is_refused_when_loaded(target, tmp_path):
    from safetensors.torch import load_file, save_file

    save_head(tmp_path / "h", random_head(target))
    weights = tmp_path / "h" / "head.safetensors"
    state = load_file(str(weights))
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name][0] = float("nan")
    save_file(state, str(weights))
    with pytest.raises(HeadFileError, match=f"{name} holds nan or infinite values"):
        load_head(tmp_path / "h", target)

