"""Model loading: hub sources stay offline unless allowed, and the GGUF conversion cache
survives damage, read-only folders, killed writers and concurrent processes.

No real GGUF file is parsed here: transformers' GGUF reading (any from_pretrained call with
`gguf_file=`) is replaced by a tiny in-memory model, so the cache logic runs for real on
real safetensors files in seconds."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from specdraft.config.model_spec import ModelSpec
from specdraft.profile import parse_profile
from specdraft.errors import ProfileError
from specdraft.models.loading import load_model
from tiny import byte_tokenizer, tiny_llama
from gguf_models import write_model


@pytest.fixture
def messages():
    """specdraft's log lines, whatever handlers a CLI test left on the logger."""
    logger = logging.getLogger("specdraft")
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect(logging.INFO)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(old_level)


# -- 1: hub sources -------------------------------------------------------------------------


@pytest.fixture
def network(monkeypatch):
    """Every HTTP request huggingface_hub tries, refused at once (and its retries not slept)."""
    import httpx2
    import huggingface_hub.constants as constants
    import huggingface_hub.utils._http as http

    tried: list[str] = []

    def send(self, request, *args, **kwargs):
        tried.append(str(request.url))
        raise httpx2.ConnectError("no network in tests", request=request)

    monkeypatch.setattr(httpx2.Client, "send", send)
    monkeypatch.setattr(http.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # a user without HF_HUB_OFFLINE set
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return tried


def test_hub_source_reads_the_local_cache_only(network):
    start = time.perf_counter()
    with pytest.raises(ProfileError) as info:
        load_model(ModelSpec(hub="nobody/not-cached"), "p.toml", "target")
    assert network == []
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert message.startswith("p.toml: target.hub: ") and "not in the local Hugging Face cache" in message
    assert "allow_download = true" in message and "\n" not in message


def test_allow_download_lets_a_hub_source_fetch(network, tmp_path):
    profile = parse_profile('[target]\nhub = "nobody/x"\nallow_download = true\n[[drafters]]\nname = "l"\n'
                            'kind = "ngram"\n', tmp_path / "p.toml")
    assert profile.target.allow_download
    with pytest.raises(ProfileError):
        load_model(profile.target, "p.toml", "target")
    assert network  # it did try: downloads were allowed


def test_allow_download_needs_a_hub_source(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ProfileError, match="target.allow_download: only a hub source"):
        parse_profile('[target]\npath = "m"\nallow_download = true\n', tmp_path / "p.toml")


# -- 6: the GGUF conversion cache -------------------------------------------------------------


@pytest.fixture
def gguf(tmp_path, monkeypatch, messages):
    """A stand-in .gguf file (`.path`) and its conversions (`.conversions`: how many log
    lines had been written when each began)."""
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    # a real header (checked before anything loads), of an architecture not run on the kernels
    file = write_model(tmp_path / "tiny.gguf", architecture="stablelm", hidden=32, ffn=64, layers=1)
    conversions = []
    model_load = transformers.AutoModelForCausalLM.from_pretrained
    tokenizer_load = transformers.AutoTokenizer.from_pretrained

    def fake_model(location, *args, **kwargs):
        if "gguf_file" not in kwargs:
            return model_load(location, *args, **kwargs)
        conversions.append(len(messages))
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            time.sleep(getattr(fake_model, "delay", 0))
        tok = byte_tokenizer()
        model = tiny_llama(vocab=len(tok)).to(kwargs.get("dtype", torch.float32))
        model.config.eos_token_id = tok.eos_token_id
        return model

    def fake_tokenizer(location, *args, **kwargs):
        return byte_tokenizer() if "gguf_file" in kwargs else tokenizer_load(location, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tokenizer)
    return SimpleNamespace(path=file, conversions=conversions, fake=fake_model)


def load(gguf):
    return load_model(ModelSpec(path=gguf.path, dtype="float64"), "p.toml", "target")


def entry(gguf) -> Path:
    folders = [p for p in (Path(os.environ["SPECDRAFT_CACHE_DIR"]) / "gguf").iterdir() if p.is_dir()]
    assert len(folders) == 1
    return folders[0]


def test_first_load_converts_once_and_says_so(gguf, messages):
    load(gguf)
    load(gguf)
    assert len(gguf.conversions) == 1
    folder = entry(gguf)
    assert [m for m in messages if m.startswith("converting")] == [
        f"converting tiny.gguf to float64 once (~5 s), cached at {folder}"]
    assert (folder / "specdraft.json").exists()


def test_each_dtype_caches_its_own_weights(gguf):
    """The cache holds weights in the dtype they run in: a bfloat16 entry is half the bytes
    of a float32 one, and float32 entries keep their old names (no re-conversion)."""
    from safetensors import safe_open

    from specdraft.models.gguf.cache import entry_folder

    for dtype in ("float32", "bfloat16", "float32"):
        loaded = load_model(ModelSpec(path=gguf.path, dtype=dtype), "p.toml", "target")
        # (bfloat16 matrices run on the block kernels, held in their dtype: float_blocks.py)
        from specdraft.models.kernels.block_linear import BlockLinear

        matrices = [m.codes for m in loaded.model.modules() if isinstance(m, BlockLinear)]
        assert {w.dtype for w in matrices or loaded.model.parameters()} == {getattr(torch, dtype)}
    assert len(gguf.conversions) == 2
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        folder = entry_folder(gguf.path, dtype)
        with safe_open(folder / "model.safetensors", "pt") as weights:
            assert {weights.get_tensor(k).dtype for k in weights.keys()} == {getattr(torch, dtype)}
        sizes[dtype] = (folder / "model.safetensors").stat().st_size
    assert entry_folder(gguf.path, "float32").name.startswith("tiny-")
    assert entry_folder(gguf.path, "bfloat16").name.startswith("tiny-bfloat16-")
    assert sizes["bfloat16"] < 0.6 * sizes["float32"]


@pytest.mark.parametrize("damage", ["truncate", "delete tokenizer", "delete config"])
def test_damaged_cache_entry_is_rebuilt(gguf, messages, damage):
    load(gguf)
    folder = entry(gguf)
    if damage == "truncate":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        (folder / ("tokenizer.json" if damage == "delete tokenizer" else "config.json")).unlink()
    loaded = load(gguf)
    assert loaded.model is not None and len(gguf.conversions) == 2
    assert any(m.startswith(f"cached conversion {folder} is unusable") for m in messages)


def test_a_load_never_leaves_torchs_default_dtype_changed(gguf, monkeypatch):
    """transformers sets the default dtype while it builds a model and does not always
    restore it (two loads in threads race on it): a head built afterwards would be float64."""
    real = transformers.AutoModelForCausalLM.from_pretrained

    def leaky(*args, **kwargs):
        model = real(*args, **kwargs)
        torch.set_default_dtype(torch.float64)  # what a racing load leaves behind
        return model

    load(gguf)  # converted and cached by the fixture's fake conversion
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", leaky)
    try:
        load(gguf)
        assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_unwritable_cache_folder_warns_before_converting_and_still_loads(gguf, messages, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(blocker / "cache"))  # cannot be created, even by root
    loaded = load(gguf)
    assert loaded.model is not None
    warning = next(i for i, m in enumerate(messages) if m.startswith("cache folder"))
    assert "cannot be written" in messages[warning] and gguf.conversions[0] > warning


def test_stale_partial_folders_are_removed(gguf):
    from specdraft.models.gguf.leftovers import legacy_host

    root = Path(os.environ["SPECDRAFT_CACHE_DIR"]) / "gguf"
    dead = root / f".partial-{legacy_host()}-999999999-abc"
    old = root / ".partial-xyz"
    alive = root / f".partial-{legacy_host()}-{os.getpid()}-def"
    for folder in (dead, old, alive):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    hour_ago = time.time() - 7200
    os.utime(old, (hour_ago, hour_ago))
    load(gguf)
    assert not dead.exists() and not old.exists() and alive.exists()


def test_two_loaders_convert_once(gguf):
    gguf.fake.delay = 0.2
    results, errors = [], []

    def run():
        try:
            results.append(load(gguf))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 2
    assert len(gguf.conversions) == 1


def test_conversion_draws_no_progress_bar_when_quiet(gguf, capfd):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        load(gguf)
    finally:
        hf_logging.enable_progress_bar()
    assert "Converting" not in capfd.readouterr().err


def test_the_command_line_says_once_what_the_first_load_does(gguf, tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    pool = tmp_path / "pool.toml"
    pool.write_text(f'[target]\npath = "{gguf.path}"\ndtype = "float64"\n[decode]\nmax_new_tokens = 3\n'
                    '[[drafters]]\nname = "lookup"\nkind = "ngram"\n')
    first = CliRunner().invoke(app, ["generate", "--pool", str(pool), "hi"])
    assert first.exit_code == 0, first.stderr
    said = first.stderr.splitlines()
    assert said[0] == f"converting tiny.gguf to float64 once (~5 s), cached at {entry(gguf)}"
    # the verify-cost probe announces itself only when it expects to take > 3 s: on a loaded machine
    from test_cli import LOAD_NOTICES

    assert all(line.startswith(LOAD_NOTICES) for line in said[1:]), said
    second = CliRunner().invoke(app, ["generate", "--pool", str(pool), "hi"])
    from test_cli import unannounced

    assert second.exit_code == 0 and unannounced(second.stderr) == ""


def test_a_tied_head_is_tied_to_the_embedding_and_unloaded_weights_are_named(tmp_path):
    """Fresh CI runs saw a GGUF-loaded model with `tie_word_embeddings` whose head was not
    the embedding (on the meta device, or random): the converter ties it itself, and names
    any weight still unloaded in a profile error."""
    import torch

    from specdraft.models.gguf.cache import tie_absent_head

    tied = tiny_llama()
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = torch.nn.Parameter(torch.empty_like(tied.lm_head.weight, device="meta"))
    tie_absent_head(tied, tmp_path / "m.gguf", "p.toml", "target")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = tiny_llama()  # its own head: never replaced by the embedding
    head = untied.lm_head.weight
    tie_absent_head(untied, tmp_path / "m.gguf", "p.toml", "target")
    assert untied.lm_head.weight is head
    untied.lm_head.weight = torch.nn.Parameter(torch.empty_like(head, device="meta"))
    with pytest.raises(ProfileError, match="m.gguf left 1 weights unloaded .first: lm_head.weight"):
        tie_absent_head(untied, tmp_path / "m.gguf", "p.toml", "target")


def test_a_cached_head_alone_gives_the_embedding_its_weights(tmp_path):
    """A cached conversion stores a tied pair once, under the head's name (safetensors keeps
    one); after two models were built at once in threads, transformers reported the
    embedding missing and initialized it at random, and tying the head to it then made the
    whole model's head and embedding random (seen as a trained draft head refusing the
    dequantized demo target, whose embedding signs agreed on 50%). The tie follows the
    checkpoint: the embedding takes the head's weights when only the head was stored."""
    import torch
    from safetensors.torch import save_model

    from specdraft.models.gguf.cache import checkpoint_names, tie_absent_head

    source = tiny_llama()
    source.config.tie_word_embeddings = True
    tie_absent_head(source, tmp_path / "m.gguf", "p.toml", "target")
    save_model(source, str(tmp_path / "model.safetensors"))
    stored = checkpoint_names(tmp_path)
    assert "lm_head.weight" in stored and "model.embed_tokens.weight" not in stored  # what safetensors keeps
    loaded = tiny_llama()  # as transformers left it: the head loaded, the embedding newly initialized
    loaded.config.tie_word_embeddings = True
    loaded.lm_head.weight = torch.nn.Parameter(source.lm_head.weight.detach().clone())
    tie_absent_head(loaded, tmp_path / "m.gguf", "p.toml", "target", stored)
    assert loaded.model.embed_tokens.weight is loaded.lm_head.weight
    assert torch.equal(loaded.model.embed_tokens.weight, source.model.embed_tokens.weight)
    read_from_gguf = tiny_llama()  # no names given: the embedding is what was read
    read_from_gguf.config.tie_word_embeddings = True
    embedding = read_from_gguf.model.embed_tokens.weight
    tie_absent_head(read_from_gguf, tmp_path / "m.gguf", "p.toml", "target")
    assert read_from_gguf.lm_head.weight is embedding


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_device_is_named_by_the_key_or_the_flag_that_asked_for_it():
    from specdraft.errors import ProfileError
    from specdraft.models.loading import resolve_device

    with pytest.raises(ProfileError) as flag:
        resolve_device("cuda", None, "--device")
    assert "--device" in str(flag.value) and "--device.device" not in str(flag.value)
    with pytest.raises(ProfileError) as key:
        resolve_device("cuda:1", "p.toml", "drafters[0].device")
    assert "drafters[0].device" in str(key.value) and "p.toml" in str(key.value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("name", ["pipe.gguf", "pipe"])
def test_a_named_pipe_as_the_model_is_refused_without_reading_it(tmp_path, name):
    pipe = tmp_path / name
    os.mkfifo(pipe)  # opening it to read would wait for a writer forever
    with pytest.raises(ProfileError, match="neither a regular file nor a folder"):
        load_model(ModelSpec(path=pipe), "p.toml", "target")
