"""`specdraft export`: the target as a plain transformers folder that loads as is, with the
architecture named, no GGUF quantization config, a tied embedding under its own name, the
tokenizer and its chat template; the output folder checked before anything loads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.config.model_spec import ModelSpec
from specdraft.models.export import export_model
from tiny import save_tiny_pair


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_exported_folder_loads_as_is_and_gives_the_models_logits(tmp_path, tied, dtype):
    folder = save_tiny_pair(tmp_path / "model")
    if tied:  # tie the saved model's head to its embedding
        model = AutoModelForCausalLM.from_pretrained(folder)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(folder)
    check_export(tmp_path, folder, tied, dtype)


def test_a_head_sharing_the_embeddings_tensor_is_exported_tied_whatever_its_config_says(tmp_path, monkeypatch):
    """A model loaded with its head on the embedding's tensor but a config saying untied
    (transformers then saves the tensor once): the export declares it tied, so a loader
    restores the head instead of leaving it random."""
    import specdraft.models.loading as loading

    folder = save_tiny_pair(tmp_path / "model")
    load = loading.load_model

    def shared_head(spec, file, key):
        loaded = load(spec, file, key)
        loaded.model.lm_head.weight = loaded.model.model.embed_tokens.weight
        loaded.model.config.tie_word_embeddings = False
        return loaded

    monkeypatch.setattr(loading, "load_model", shared_head)
    check_export(tmp_path, folder, True, "float32")


def check_export(tmp_path, folder, tied, dtype):
    """Export the model in `folder` and check what a serving engine reads of it."""
    from specdraft.models import loading

    spec = ModelSpec(path=folder, dtype="float32")
    umask = os.umask(0o022)
    try:
        out = export_model(spec, "p.toml", "target", tmp_path / "out", dtype)
    finally:
        os.umask(umask)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] == tied
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert {weights.get_tensor(n).dtype for n in names} == {getattr(torch, dtype)}
    assert "model.embed_tokens.weight" in names and (("lm_head.weight" in names) != tied)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = loading.load_model(spec, "p.toml", "target").model.to(getattr(torch, dtype)).float()
    ids = torch.arange(3, 30)[None]
    torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.iterdir())  # an engine's user reads them
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(folder).chat_template


def test_the_command_refuses_a_non_empty_folder_before_loading(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = CliRunner().invoke(app, ["export", "--pool", str(tmp_path / "missing.toml"), "--out", str(out)])
    assert result.exit_code == 2 and "not empty" in result.output and "--force" in result.output
    result = CliRunner().invoke(app, ["export", "--pool", "p.toml", "--out", str(out), "--dtype", "int3"])
    assert result.exit_code == 2 and "--dtype int3" in result.output
    assert (out / "keep.txt").read_text() == "mine"
