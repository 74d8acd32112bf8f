"""The weights of a mapped GGUF built on a thread of their own (models/gguf/weights.py) while
the config, tokenizer and module tree are read: no layer built meanwhile lands on the meta
device, a failed load leaves no thread reading the mapping, and an error on the thread
reaches the load as the same one-line error."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from accelerate import init_empty_weights

from gguf_models import write_model
from specdraft.errors import ProfileError
from specdraft.models import gguf_loading
from specdraft.models.gguf import weights as weights_module
from specdraft.models.gguf.file import GGUFError, GGUFFile
from specdraft.models.gguf.mapping import placements
from specdraft.models.gguf.weights import MODULES_BUILT, Stopped, WeightsAhead, build_weights
from specdraft.models.kernels.native import kernel_problem

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))


def weights_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "specdraft-weights"]


def test_layers_built_while_the_empty_module_tree_is_built_are_real(tmp_path):
    """accelerate's init_empty_weights puts any parameter registered anywhere in the process
    on the meta device while it is active: the thread waits for it to end."""
    gguf = GGUFFile(write_model(tmp_path / "m.gguf", "qwen2", "Q4_0", tied=False))
    with MODULES_BUILT, init_empty_weights(include_buffers=False):
        ahead = WeightsAhead(gguf, placements(gguf), tied=False)
        time.sleep(0.3)  # (the thread would build every layer of this tiny model meanwhile)
    weights = ahead.result()
    meta = [name for path, module in weights.modules.items()
            for name, p in module.named_parameters(prefix=path) if p.is_meta]
    assert not meta and len(weights.modules) >= 14


def test_the_same_weights_whether_built_ahead_or_not(tmp_path):
    gguf = GGUFFile(write_model(tmp_path / "m.gguf", "qwen2", "Q4_K", tied=True))
    places = placements(gguf)
    ahead, direct = WeightsAhead(gguf, places, tied=True).result(), build_weights(gguf, places, tied=True)
    assert ahead.modules.keys() == direct.modules.keys() and ahead.state.keys() == direct.state.keys()
    for name, tensor in ahead.state.items():
        assert tensor.equal(direct.state[name]), name
    for path, module in ahead.modules.items():
        for (name, mine), (_, theirs) in zip(module.state_dict().items(), direct.modules[path].state_dict().items()):
            assert mine.equal(theirs), f"{path}.{name}"


def test_a_cancelled_build_stops_and_joins(tmp_path):
    gguf = GGUFFile(write_model(tmp_path / "m.gguf", "llama", "Q8_0", tied=False))
    places = placements(gguf)
    with MODULES_BUILT:  # held: the thread cannot get past its first matrix
        ahead = WeightsAhead(gguf, places, tied=False)
        ahead._stop.set()
    ahead._thread.join(5)
    assert not ahead._thread.is_alive()
    with pytest.raises(Stopped):
        ahead.result()


def test_a_load_that_fails_reading_the_tokenizer_leaves_no_thread(tmp_path, monkeypatch):
    path = write_model(tmp_path / "m.gguf", "llama", "Q4_0", tied=False)

    def broken(*args):
        time.sleep(0.05)
        raise ValueError("no tokenizer in this file")

    monkeypatch.setattr(gguf_loading, "read_metadata", broken)
    with pytest.raises(ProfileError, match="no tokenizer in this file"):
        gguf_loading.load_gguf_mapped(path, "p.toml", "target")
    assert not weights_threads()


def test_an_error_on_the_thread_is_the_loads_one_line_error(tmp_path, monkeypatch):
    """A tensor that fails on the weights' thread is reported by the load as it was when the
    weights were built in line (a ProfileError naming the file and tensor: exit 2)."""
    path = write_model(tmp_path / "m.gguf", "llama", "Q4_0", tied=False)
    real = weights_module.repacked

    def failing(info, *args, **kwargs):
        if info.name == "blk.1.ffn_up.weight":
            raise GGUFError(f"m.gguf: tensor {info.name} is damaged")
        return real(info, *args, **kwargs)

    monkeypatch.setattr(weights_module, "repacked", failing)
    with pytest.raises(ProfileError, match="blk.1.ffn_up.weight is damaged"):
        gguf_loading.load_gguf_mapped(path, "p.toml", "target")
    assert not weights_threads()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q8_0"])
def test_projections_are_joined_on_the_thread_and_the_lean_forward_copies_nothing(tmp_path, type_name):
    """Query/key/value and gate/up come out of the load as slices of one buffer each, so the
    lean forward's fuse views them (no second copy at start-up) and computes what the
    separate matrices compute."""
    from specdraft.models.kernels.fused_linear import adjacent, fuse
    from specdraft.models.lean.layers import LeanLayer

    _, model = gguf_loading.load_gguf_mapped(write_model(tmp_path / "m.gguf", "qwen2", type_name, tied=False),
                                             "p.toml", "target")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    x = torch.randn(3, attn.q_proj.in_features)
    separate = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    loaded = attn.q_proj.codes.data_ptr(), mlp.gate_proj.codes.data_ptr()
    lean = LeanLayer.of(model.model.layers[1])
    assert (lean.qkv.codes.data_ptr(), lean.gate_up.codes.data_ptr()) == loaded  # (a copy would move them)
    assert torch.equal(lean.qkv(x), separate)
    assert adjacent([attn.k_proj.codes, attn.q_proj.codes]) is None  # (out of order: not one tensor)
    assert torch.equal(fuse([mlp.gate_proj, mlp.up_proj])(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1))
