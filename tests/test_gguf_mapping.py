"""A GGUF model built from its mapped file (models/gguf/mapping.py): every matrix is the
weight transformers dequantizes from the same file (bit for bit where the format is read
exactly, to half an int8 step where it is rounded), for llama (query and key rows
unpermuted) and qwen2 (biases), tied and untied heads; the cache keeps no weights; a model
that does not fit, a truncated file and a misnamed tensor are refused in one line."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_models import write_model
from specdraft.errors import ProfileError, SpecdraftError
from specdraft.models.gguf import cache as gguf_cache
from specdraft.models.gguf.cache import tie_absent_head
from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.gguf.file import GGUFError, GGUFFile
from specdraft.models.gguf_loading import load_gguf_mapped, read_gguf
from specdraft.models.kernels.native import kernel_problem
from specdraft.models.kernels.quantized_embedding import QuantizedEmbedding, TiedEmbedding

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def compare(path: Path, rounded: tuple[str, ...] = ()) -> tuple:
    """Load `path` mapped and by transformers; matrices whose path ends in one of `rounded`
    are int8 rows (within half a step), the rest the file's weights bit for bit."""
    tokenizer, model = load_gguf_mapped(path, "p.toml", "target")
    reference, _ = read_gguf(path)
    tie_absent_head(reference, path, "p.toml", "target")  # (transformers' own tying is unreliable)
    modules = dict(reference.named_modules())
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, BlockLinear) or name not in modules:
            continue
        expected = modules[name].weight.detach()
        if not name.endswith(rounded):
            assert torch.equal(module.weight, expected), name
        else:
            step = expected.abs().amax(1, keepdim=True) / 127
            assert bool(((module.weight - expected).abs() <= step / 2 * (1 + 1e-5)).all()), name
        if getattr(modules[name], "bias", None) is not None:
            assert torch.equal(module.bias, modules[name].bias.detach()), name
    floats = reference.state_dict()
    for name, tensor in model.state_dict().items():
        if name in floats and tensor.dtype == torch.float32 and "proj" not in name and "lm_head" not in name:
            assert torch.equal(tensor, floats[name]), name
    return tokenizer, model, reference


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
def test_every_matrix_is_the_weight_transformers_reads_from_the_file(tmp_path, architecture, type_name):
    path = write_model(tmp_path / "m.gguf", architecture, type_name, tied=type_name in ("Q4_0", "Q5_K"))
    tokenizer, model, reference = compare(path)
    ids = tokenizer("the cat in the hat", return_tensors="pt").input_ids
    with torch.no_grad():  # the same model; the kernels round activations to int8 groups, as llama.cpp does
        mine, theirs = model(ids).logits, reference(ids).logits
    assert float((mine - theirs).norm() / theirs.norm()) < 0.05


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_float_matrices_are_the_files_weights_in_transformers_order(tmp_path, architecture):
    """F32 and F16 matrices stay float; a llama file's query and key rows are stored permuted
    for llama.cpp's rotary layout and must come back in order as the quantized ones do."""
    path = write_model(tmp_path / "m.gguf", architecture, "Q8_0", tied=False,
                       types={"attn_q": "F16", "attn_k": "F32", "attn_v": "F16", "ffn_up": "F32"})
    tokenizer, model = load_gguf_mapped(path, "p.toml", "target")
    reference, _ = read_gguf(path)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        mine, theirs = (m.model.layers[1].get_submodule(name).weight for m in (model, reference))
        assert torch.equal(mine, theirs.float()), name


def test_formats_with_scales_per_16_weights_are_exact_or_int8_rows(tmp_path):
    """Q6_K and Q3_K run on 6-bit codes (exact), Q2_K on int8 rows of its weights."""
    path = write_model(tmp_path / "m.gguf", "llama", "Q4_K", tied=False,
                       types={"output": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q3_K", "ffn_up": "Q2_K"})
    _, model, _ = compare(path, rounded=("up_proj",))
    assert model.lm_head.bits == 6 and model.model.layers[0].mlp.down_proj.bits == 6
    assert model.model.layers[0].mlp.up_proj.bits == 8


def test_the_head_and_embedding_hold_the_files_codes_once(tmp_path):
    _, tied = load_gguf_mapped(write_model(tmp_path / "t.gguf", tied=True), "p.toml", "target")
    assert isinstance(tied.model.embed_tokens, TiedEmbedding) and tied.model.embed_tokens.head is tied.lm_head
    path = write_model(tmp_path / "u.gguf", tied=False)
    _, untied = load_gguf_mapped(path, "p.toml", "target")
    embedding = untied.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    # looked up in the file's mapping: the rows are the file's bytes, not a copy
    raw = GGUFFile(path).data("token_embd.weight")
    assert np.array_equal(embedding.blocks.numpy().reshape(-1), raw)
    assert not any(p.dim() == 2 for p in untied.parameters())  # no float matrix left anywhere


def test_the_cache_keeps_the_config_and_tokenizer_and_no_weights(tmp_path, cache):
    path = write_model(tmp_path / "m.gguf", tied=False)
    old = gguf_cache.entry_folder(path, gguf_cache.OLD_WEIGHT_FLAVOURS[0])
    old.mkdir(parents=True)
    (old / "quantized.safetensors").write_bytes(b"\0" * 4096)  # what specdraft 0.1 kept
    load_gguf_mapped(path, "p.toml", "target")
    assert not old.exists()
    entry = gguf_cache.entry_folder(path, gguf_cache.METADATA)
    assert (entry / "config.json").exists() and (entry / "tokenizer.json").exists()
    assert not list(entry.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in entry.iterdir()) < path.stat().st_size


def test_a_model_that_does_not_fit_is_refused_before_loading(tmp_path, monkeypatch):
    path = write_model(tmp_path / "m.gguf", tied=False)
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", "64K")
    with pytest.raises(SpecdraftError, match=r"m.gguf needs 0\.0 GiB .* only 0\.0 GiB is available") as caught:
        load_gguf_mapped(path, "p.toml", "target")
    assert caught.value.exit_code == 1 and "\n" not in str(caught.value)


def test_the_command_says_so_in_one_line_and_exits_1(tmp_path):
    path = write_model(tmp_path / "m.gguf", tied=False)
    profile = tmp_path / "p.toml"
    profile.write_text(f'[target]\npath = "{path}"\n\n[policy]\nname = "fixed"\ndrafter = "lookup"\n\n'
                       '[[drafters]]\nname = "lookup"\nkind = "ngram"\n')
    env = {**__import__("os").environ, "SPECDRAFT_MEMORY_LIMIT": "100K", "SPECDRAFT_CACHE_DIR": str(tmp_path / "c"),
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "specdraft", "generate", "--pool", str(profile), "hello"],
                          stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "needs" in errors[0] and "available" in errors[0] and "Traceback" not in done.stderr


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    path = write_model(tmp_path / "m.gguf", tied=False)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match="m.gguf .*past the file's end"):
        GGUFFile(path)
    with pytest.raises(ProfileError, match="truncated or damaged"):
        load_gguf_mapped(path, "p.toml", "target")


def _header(*pairs: bytes, tensors: int = 0, claimed_pairs: int | None = None) -> bytes:
    """A GGUF v3 header of these key-value pairs (bytes each), claiming `tensors` tensors."""
    count = len(pairs) if claimed_pairs is None else claimed_pairs
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, count) + b"".join(pairs)


def _string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _key(name: str) -> bytes:
    return _string(name.encode())


def test_headers_that_claim_more_than_the_file_holds_allocate_nothing(tmp_path):
    path = tmp_path / "h.gguf"
    path.write_bytes(_header(claimed_pairs=10**12, tensors=1))
    with pytest.raises(GGUFError, match="more than the file holds"):
        GGUFFile(path)
    path.write_bytes(_header(_key("general.x") + struct.pack("<IIQ", 9, 4, 10**11)))
    with pytest.raises(GGUFError, match="more than the file holds"):
        GGUFFile(path)


@pytest.mark.parametrize("content, cause", [
    (b"", "it is empty"),
    (b"GGML" + bytes(20), "does not start with GGUF"),
    (b"GGUF" + bytes(3), "ends inside its header"),
    (_header(_key("k") + (8).to_bytes(4, "little") + (10**9).to_bytes(8, "little") + b"abc"), "ends inside"),
    (_header(_key("k") + (8).to_bytes(4, "little") + _string(b"\xff\xfe")), "not UTF-8"),
    (_header(_key("k") + (9).to_bytes(4, "little") + (8).to_bytes(4, "little") + (3).to_bytes(8, "little")
             + _key("a") + (2**63).to_bytes(8, "little") + bytes(16)), "ends inside"),
    (_header(_key("k") + (99).to_bytes(4, "little")), "unknown value type 99"),
    (_header(_key("k") + (9).to_bytes(4, "little") + (9).to_bytes(4, "little") + (1).to_bytes(8, "little")),
     "array of value type 9"),
    (_header(_key("general.alignment") + (4).to_bytes(4, "little") + (24).to_bytes(4, "little")),
     "not a power of two"),
])
def test_a_damaged_header_is_one_line_naming_the_cause(tmp_path, content, cause):
    path = tmp_path / "d.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=cause) as caught:
        GGUFFile(path)
    assert str(caught.value).startswith("d.gguf is not a readable GGUF file") and "\n" not in str(caught.value)


@pytest.mark.parametrize("architecture, states_vocab_size", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_the_config_and_tokenizer_are_what_transformers_reads_itself(tmp_path, architecture, states_vocab_size):
    from transformers import AutoConfig, AutoTokenizer

    from specdraft.models.gguf.metadata import read_config_and_tokenizer

    path = write_model(tmp_path / "m.gguf", architecture, tied=False, states_vocab_size=states_vocab_size)
    config, tokenizer = read_config_and_tokenizer(path)
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert config.to_dict() == theirs.to_dict() and config.model_type == architecture
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tokenizer.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert tokenizer("the cat in the hat").input_ids == reference("the cat in the hat").input_ids


def test_a_transformers_the_fast_reader_does_not_fit_falls_back_to_its_own(tmp_path, monkeypatch):
    import specdraft.models.gguf.metadata as metadata

    def broken(*args, **kwargs):
        raise AttributeError("fields")

    monkeypatch.setattr(metadata, "_Reader", broken)
    monkeypatch.setattr(metadata, "_metadata_reader", broken)
    config, tokenizer = metadata.read_config_and_tokenizer(write_model(tmp_path / "m.gguf"))
    assert config.num_hidden_layers == 2 and len(tokenizer) > 256


def test_the_readers_are_swapped_back_after_reading(tmp_path):
    import gguf
    from transformers.integrations import gguf as package
    from transformers.integrations.gguf import reader

    import specdraft.models.gguf.metadata as metadata

    before = (gguf.GGUFReader, reader.read_gguf_metadata, package.read_gguf_metadata)
    metadata.read_config_and_tokenizer(write_model(tmp_path / "m.gguf", states_vocab_size=True))
    assert (gguf.GGUFReader, reader.read_gguf_metadata, package.read_gguf_metadata) == before


@pytest.mark.parametrize("states_vocab_size", [False, True])
def test_the_config_and_tokenizer_never_need_transformers_own_readers(tmp_path, monkeypatch, states_vocab_size):
    import gguf
    from transformers.integrations.gguf import reader

    import specdraft.models.gguf.metadata as metadata

    def unwanted(*args, **kwargs):
        raise RuntimeError(f"a reader of its own read the file {args}")

    from transformers.integrations import gguf as package

    monkeypatch.setattr(gguf, "GGUFReader", unwanted)
    monkeypatch.setattr(reader, "read_gguf_metadata", unwanted)
    monkeypatch.setattr(package, "read_gguf_metadata", unwanted)
    config, tokenizer = metadata.read_config_and_tokenizer(write_model(tmp_path / "m.gguf",
                                                                       states_vocab_size=states_vocab_size))
    assert config.vocab_size == len(tokenizer) and tokenizer("the cat").input_ids


def test_a_tokenizer_short_of_the_files_tokens_is_read_again_in_full(tmp_path, monkeypatch):
    import contextlib

    from transformers import AutoTokenizer
    from transformers.integrations import gguf as package
    from transformers.integrations.gguf import reader

    import specdraft.models.gguf.metadata as metadata

    original, seen = metadata._fast_readers, []

    @contextlib.contextmanager
    def short_when_lean(parsed, config_only):
        seen.append(config_only)
        with original(parsed, config_only):
            served = package.read_gguf_metadata

            def fewer(path, string_arrays=()):
                values, names = served(path, string_arrays)
                if config_only and isinstance(values.get("tokenizer.ggml.tokens"), list):
                    values["tokenizer.ggml.tokens"] = values["tokenizer.ggml.tokens"][:-3]
                    values["tokenizer.ggml.token_type"] = values["tokenizer.ggml.token_type"][:-3]
                return values, names

            with monkeypatch.context() as patch:
                patch.setattr(package, "read_gguf_metadata", fewer)
                patch.setattr(reader, "read_gguf_metadata", fewer)
                yield

    monkeypatch.setattr(metadata, "_fast_readers", short_when_lean)
    path = write_model(tmp_path / "m.gguf", states_vocab_size=True)
    config, tokenizer = metadata.read_config_and_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert seen == [True, False] and len(tokenizer) == len(reference) == config.vocab_size
