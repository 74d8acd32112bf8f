"""Every file specdraft reads back is untrusted (issue 65): each case here is a file a hostile
or careless user (or a crash) can leave, and what specdraft must do with it: never run code
from it, never hang or exhaust memory on it, never overwrite an input with an output, and
answer a damaged file in one line (exit 2 when the user named it, a rebuild or a skip with a
warning when it is a cache's). Planted and damaged kernel builds are in test_kernel_build.py,
damaged GGUF headers in test_gguf_mapping.py, SPECDRAFT_KERNEL_ISA in test_file_quantization.py.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.errors import ProfileError, UsageError

runner = CliRunner()


def finishes(call, seconds: float = 20.0):
    """`call()`'s result, or a test failure when it has not returned within `seconds` (it
    runs in a daemon thread, so a hang fails the test instead of the suite)."""
    box = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- 2: a pickle planted where training resumes from never runs --------------------------------


class _Planted:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_training_state_never_runs(tmp_path):
    from rich.console import Console

    from specdraft.training.loop import STATE, LoopSettings, train

    marker = tmp_path / "ran"
    torch.save({"identity": {"data": "x"}, "step": 2, "payload": _Planted(marker)}, tmp_path / STATE)
    head = torch.nn.Linear(2, 1)
    settings = LoopSettings(steps=2, lr=1e-2, warmup=1, identity={"data": "x"})
    result = train(head, settings, lambda step: ((head(torch.ones(1, 2)) ** 2).sum(), {}), lambda *a: None,
                   tmp_path, Console(stderr=True, quiet=True))
    assert not marker.exists() and result.resumed_from == 0 and result.step == 2
    # what the run saved itself still resumes (plain tensors and numbers load as data)
    assert train(head, LoopSettings(steps=3, lr=1e-2, warmup=1, identity={"data": "x"}),
                 lambda step: ((head(torch.ones(1, 2)) ** 2).sum(), {}), lambda *a: None, tmp_path,
                 Console(stderr=True, quiet=True)).resumed_from == 2


# -- 3: an output never overwrites an input, whatever path reaches it ----------------------------


def test_an_output_hard_linked_to_an_input_is_refused(tmp_path):
    from specdraft.commands.outputs import check_outputs

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    os.link(data, tmp_path / "d_hard.jsonl")
    (tmp_path / "sub").mkdir()
    os.symlink(data, tmp_path / "sub" / "alias.jsonl")
    for out in (tmp_path / "d_hard.jsonl", tmp_path / "sub" / "alias.jsonl", tmp_path / "sub" / ".." / "d.jsonl"):
        with pytest.raises(UsageError, match="would overwrite the --data input"):
            check_outputs([("--out", str(out))], inputs=[("--data", str(data))])
    result = runner.invoke(app, ["trace", "--pool", str(data), "--data", str(data), "--out",
                                 str(tmp_path / "d_hard.jsonl")])
    assert result.exit_code == 2 and "would overwrite" in result.stderr
    assert data.read_text() == '{"prompt": "x"}\n'


def test_streamed_outputs_replace_the_old_file_instead_of_writing_through_it(tmp_path):
    from specdraft.commands.outputs import JsonLines
    from specdraft.measurement.traces import TraceWriter

    for write in (lambda path: JsonLines(path).write({"a": 1}), lambda path: TraceWriter(path).header(_header())):
        out, other = tmp_path / "out.jsonl", tmp_path / "other-name.jsonl"
        out.write_text("kept\n")
        other.unlink(missing_ok=True)
        os.link(out, other)
        write(out)
        assert other.read_text() == "kept\n" and out.read_text() != "kept\n"
        out.unlink()


# -- 4 and 8: cached weights and manifests are checked without trusting mtimes --------------------


@pytest.fixture
def entry(tmp_path):
    """A conversion cache entry: big and small tensors in model.safetensors, a config, and
    its manifest."""
    from safetensors.torch import save_file

    from specdraft.models.gguf.entry import MANIFEST, manifest_text

    folder = tmp_path / "entry"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(4096, 256), "model.norm.weight": torch.ones(256)},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / MANIFEST).write_text(manifest_text(folder, "m.gguf"))
    return folder


def _flip_keeping_mtime(path: Path, offset: int, mask: int) -> None:
    info = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def _norm_offset(path: Path) -> int:
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    return 8 + length + header["model.norm.weight"]["data_offsets"][0]


def test_bit_rot_that_keeps_the_mtime_is_found(entry):
    from specdraft.models.gguf.entry import verify_entry

    assert verify_entry(entry) is None
    weights = entry / "model.safetensors"
    offset = _norm_offset(weights)
    for i in range(3, 256 * 4, 4):  # every sign bit of the final norm, as the case
        _flip_keeping_mtime(weights, offset + i, 0x80)
    assert "changed since it was written" in verify_entry(entry)


def test_a_changed_small_file_with_the_same_size_and_mtime_is_found(entry):
    from specdraft.models.gguf.entry import verify_entry

    _flip_keeping_mtime(entry / "config.json", 3, 0x20)
    assert verify_entry(entry) == "config.json changed since it was written"


def test_a_changed_sampled_block_is_found(entry, monkeypatch):
    from specdraft.models.gguf import entry as gguf_entry
    from specdraft.models.gguf.entry import SAMPLE_BYTES, SAMPLES, verify_entry

    monkeypatch.setattr(gguf_entry, "SMALL_FILE", 1 << 20)  # weights files are sampled past this

    size = (entry / "model.safetensors").stat().st_size
    _flip_keeping_mtime(entry / "model.safetensors", max(SAMPLE_BYTES, size // SAMPLES) * (SAMPLES // 2) + 7, 1)
    assert "a sampled block differs" in verify_entry(entry)


@pytest.mark.parametrize("damage", [
    lambda m: m["files"]["config.json"].__setitem__("mtime", m["files"]["config.json"].pop("mtime_ns")),
    lambda m: m.__setitem__("files", list(m["files"])),
    lambda m: m["files"].__setitem__("config.json", "config.json"),
    lambda m: m["files"].__setitem__("../outside", {"size": 1, "mtime_ns": 1, "sha256": "x"}),
    lambda m: m["files"]["config.json"].__setitem__("size", "12"),
    lambda m: m.__setitem__("version", "3"),
])
def test_a_malformed_manifest_is_a_damaged_entry_not_an_error(entry, damage):
    from specdraft.models.gguf.entry import MANIFEST, verify_entry

    manifest = json.loads((entry / MANIFEST).read_text())
    damage(manifest)
    (entry / MANIFEST).write_text(json.dumps(manifest))
    assert verify_entry(entry) == "unreadable manifest"


def test_an_older_manifest_is_checked_in_full_then_upgraded(entry):
    from specdraft.models.gguf.entry import MANIFEST, verify_entry

    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["version"] = 2
    for file in manifest["files"].values():
        file.pop("sampled", None)
    (entry / MANIFEST).write_text(json.dumps(manifest))
    assert verify_entry(entry) is None and json.loads((entry / MANIFEST).read_text())["version"] == 3
    manifest["files"]["model.safetensors"]["sha256"] = "0" * 64
    (entry / MANIFEST).write_text(json.dumps(manifest))
    assert verify_entry(entry) == "model.safetensors changed since it was written"


# -- 5: NaN in what the policy learns from never hangs it ------------------------------------------


def test_nan_alignments_count_as_rejections():
    from specdraft.learning.feedback import RoundFeedback
    from specdraft.learning.goodput import AcceptanceByPosition

    fb = RoundFeedback(0, 3, 0, [math.nan, 2.0, -1.0], gammas=[[math.nan, 0.5], None])
    assert fb.alphas == [0.0, 1.0, 0.0] and fb.gammas == [[0.0, 0.5], None]
    table = AcceptanceByPosition(1, 4)
    table.observe(0, [math.nan, math.inf])
    assert all(math.isfinite(v) for v in table.hits[0] + table.seen[0])


def test_a_thompson_draw_on_nan_evidence_returns():
    from specdraft.learning.goodput import AcceptanceByPosition

    table = AcceptanceByPosition(1, 4)
    table.hits[0][0] = math.nan  # as a state from before these checks might hold
    rates = finishes(lambda: table.rates(0, 4, random.Random(0)), seconds=10)
    assert len(rates) == 4


def _saved_state(policy: str = "ucb", arms=("lookup",)) -> dict:
    from specdraft.learning.driver import PolicyDriver
    from specdraft.learning.policies import build_policy

    driver = PolicyDriver(build_policy(policy, {}, list(arms), seed=0, draft_tokens=4, horizon=32), 4, 32)
    return json.loads(json.dumps(driver.state_dict()))


@pytest.mark.parametrize("policy, damage, field", [
    ("ucb", lambda s: s["state"]["acceptance"]["hits"][0].__setitem__(0, math.nan), "acceptance"),
    ("ucb", lambda s: s["state"]["acceptance"]["seen"][0].__setitem__(1, -3.0), "acceptance"),
    ("ucb", lambda s: s["state"]["pulls"].__setitem__(0, -1), "pulls"),
    ("ucb", lambda s: s["state"].__setitem__("pulls", [1, 2, 3]), "pulls"),
    ("ucb", lambda s: s["state"]["means"].__setitem__(0, math.inf), "means"),
    ("normalhedge", lambda s: s["state"].__setitem__("rounds", -5), "rounds"),
    ("halving", lambda s: s["state"].__setitem__("survivors", [7]), "survivors"),
    ("swucb", lambda s: s["state"].__setitem__("history", [[9, 1.0]]), "history"),
])
def test_a_policy_state_with_nan_or_negative_counts_is_refused(policy, damage, field):
    from specdraft.learning.driver import PolicyDriver
    from specdraft.learning.policies import build_policy

    arms = ["lookup", "suffix"] if policy in ("halving", "swucb") else ["lookup"]
    saved = _saved_state(policy, arms)
    damage(saved)
    saved = json.loads(json.dumps(saved))  # NaN and Infinity survive JSON, as from a file
    driver = PolicyDriver(build_policy(policy, {}, arms, seed=0, draft_tokens=4, horizon=32), 4, 32)
    with pytest.raises(ValueError, match=field):
        driver.load_state_dict(saved)


def test_a_nan_policy_state_file_is_exit_2_before_loading(pool_file, tmp_path):
    state = tmp_path / "state.json"
    result = runner.invoke(app, ["generate", "--pool", str(pool_file), "--policy", "ucb", "--policy-state",
                                 str(state), "-n", "2", "hi"])
    assert result.exit_code == 0, result.stderr
    text = state.read_text()
    saved = json.loads(text)
    saved["state"]["acceptance"]["hits"][0][0] = float("nan")
    state.write_text(json.dumps(saved))
    result = finishes(lambda: runner.invoke(app, ["generate", "--pool", str(pool_file), "--policy", "ucb",
                                                  "--policy-state", str(state), "-n", "2", "hi"]))
    assert result.exit_code == 2 and "acceptance" in result.stderr and len(result.stderr.splitlines()) == 1


# -- 6 and 11: traces are checked before replay allocates or enumerates anything -------------------


def _header(**changes) -> "object":
    from specdraft.measurement.traces import ForwardCost, TraceHeader

    return TraceHeader(**{"draft_tokens": 3, "max_new_tokens": 8, "drafters": ["lookup"], "kinds": ["ngram"],
                          "costs": {"target": ForwardCost(0.01, 0.001, [0.01, 0.011, 0.012, 0.013]),
                                    "lookup": ForwardCost(0.0, 0.0)}, **changes})


def _trace_rows() -> list[dict]:
    header = {"type": "header", "version": 1, "draft_tokens": 3, "max_new_tokens": 8, "drafters": ["lookup"],
              "kinds": ["ngram"], "profile": "p.toml", "scored_by_own_forward": [False],
              "costs": {"target": {"fixed": 0.01, "per_token": 0.001, "by_width": [0.01, 0.011, 0.012, 0.013]},
                        "lookup": {"fixed": 0.0, "per_token": 0.0}}}
    lane = {"alpha": [1.0, 0.0, 1.0, 1.0], "drafted": [3, 0, 2, 1], "run": [2, 0, 2, 1],
            "span": [[1.0, 1.0, 0.0], [], [1.0, 1.0], [1.0]]}
    prompt = {"id": "a", "task": "copy", "prompt_tokens": 5, "tokens": [1, 2, 3, 4], "drafters": {"lookup": lane}}
    return [header, prompt, copy.deepcopy(prompt) | {"id": "b"}]


def _write_trace(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_sound_trace_replays(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", _trace_rows())
    result = runner.invoke(app, ["bench", "--replay", str(trace), "--policies", "normalhedge,fixed:lookup"])
    assert result.exit_code == 0, result.stderr


def _set(path: str, value):
    def change(rows):
        *keys, last = path.split(".")
        place = rows
        for key in keys:
            place = place[int(key)] if isinstance(place, list) else place[key]
        if isinstance(place, list):
            place[int(last)] = value
        else:
            place[last] = value
    return change


def _drop(path: str):
    def change(rows):
        *keys, last = path.split(".")
        place = rows
        for key in keys:
            place = place[int(key)] if isinstance(place, list) else place[key]
        del place[last]
    return change


@pytest.mark.parametrize("change, cause", [
    (lambda rows: rows.__setitem__(0, ["header"]), "not a specdraft trace"),
    (_set("0.draft_tokens", 10**9), "draft_tokens"),
    (_set("0.max_new_tokens", -1), "max_new_tokens"),
    (_set("0.drafters", ["lookup", "lookup"]), "appears twice"),
    (_set("0.kinds", []), "kinds"),
    (_set("0.costs.target.fixed", float("nan")), "costs.target.fixed"),
    (_set("0.costs.target.per_token", float("inf")), "costs.target.per_token"),
    (_set("0.costs.target.fixed", 1e308), "costs.target.fixed"),
    (_set("0.costs.target", {"fixed": 0, "per_token": 0}), "costs nothing"),
    (_set("0.costs.target.by_width", [0.0] * 4), "by_width"),
    (_set("0.costs.target.by_width", [0.01] * 10**4), "by_width"),
    (_drop("0.costs.lookup"), "no cost for lookup"),
    (_set("1.drafters.lookup.drafted.0", 10**9), "drafted"),
    (_set("1.drafters.lookup.run.0", 3 + 1), "run"),
    (_set("1.drafters.lookup.run", [10**9, 0, 0, 0]), "run"),
    (_set("1.drafters.lookup.alpha", [1.0, 0.0]), "one entry per generated token"),
    (_set("1.drafters.lookup.alpha.1", float("nan")), "alpha"),
    (_set("1.drafters.lookup.alpha.1", "1"), "alpha"),
    (_set("1.drafters.lookup.span.0", [1.0, 1.0, 1.0, 1.0]), "span"),
    (_set("1.drafters", {}), "not the header's"),
    (_set("1.drafters", {"lookup": [1, 2]}), "expected a JSON object"),
    (_set("1.tokens", "1234"), "tokens"),
    (lambda rows: rows.__setitem__(1, [1, 2]), "expected a JSON object"),
])
def test_a_hostile_trace_is_one_line_and_exit_2(tmp_path, change, cause):
    rows = _trace_rows()
    change(rows)
    trace = _write_trace(tmp_path / "t.jsonl", rows)
    result = finishes(lambda: runner.invoke(app, ["bench", "--replay", str(trace), "--policies", "normalhedge"]))
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"error: --replay {trace}: cannot read trace: ") and cause in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_replaying_with_another_pools_profile_is_refused(tmp_path, pool_file):
    trace = _write_trace(tmp_path / "t.jsonl", _trace_rows())
    other = tmp_path / "other.toml"
    other.write_text(pool_file.read_text().replace('name = "lookup"', 'name = "ngram"'))
    result = runner.invoke(app, ["bench", "--replay", str(trace), "--pool", str(other)])
    assert result.exit_code == 2 and "the trace's drafters (lookup) are not this profile's" in result.stderr


# -- 6 and 9: stores and profiles that are not files, or claim more than they hold -----------------


def test_a_segment_claiming_more_than_it_holds_is_skipped(tmp_path, caplog):
    from specdraft.drafters.learned_store import LearnedStore

    root = tmp_path / "store"
    store = LearnedStore(root, "abc", 8, 10**6, 300)
    store.append([5, 6, 7])
    segment = next((root / "segments").glob("*.npy"))
    raw = segment.read_bytes().replace(b"(5,)", b"(100000000000,)", 1)
    assert b"100000000000" in raw
    segment.write_bytes(raw)
    base, documents = finishes(lambda: LearnedStore(root, "abc", 8, 10**6, 300).open())
    assert documents == [] and "claims 100000000000 elements" in caplog.text


def test_a_fifo_named_like_a_segment_does_not_block(tmp_path, caplog):
    from specdraft.drafters.learned_store import LearnedStore

    root = tmp_path / "store"
    LearnedStore(root, "abc", 8, 10**6, 300).append([5, 6, 7])
    os.mkfifo(root / "segments" / "99999999999999999999-1.npy")
    base, documents = finishes(lambda: LearnedStore(root, "abc", 8, 10**6, 300).open())
    assert [list(d) for d in documents] == [[5, 6, 7]] and "not a regular file" in caplog.text


@pytest.mark.parametrize("make", [
    lambda tmp: Path("/dev/zero"),
    lambda tmp: (os.mkfifo(tmp / "fifo.toml"), tmp / "fifo.toml")[1],
    lambda tmp: (tmp / "deep.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n") and tmp / "deep.toml",
    lambda tmp: (tmp / "big.toml").write_bytes(b"#" * (5 << 20)) and tmp / "big.toml",
])
def test_a_profile_that_is_no_profile_is_one_line(tmp_path, make):
    from specdraft.profile import load_profile

    path = make(tmp_path)
    with pytest.raises(ProfileError) as caught:
        finishes(lambda: load_profile(path))
    assert "\n" not in str(caught.value) and caught.value.exit_code == 2


def test_a_model_file_given_as_the_profile_gets_a_hint(tmp_path):
    from specdraft.profile import load_profile

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes([0xC3, 0x28]) * 10)
    with pytest.raises(ProfileError, match="a model file\\? a profile is a TOML text file"):
        load_profile(path)


# -- 10: GGUF files whose header cannot describe their tensors ------------------------------------


@pytest.mark.parametrize("options, cause", [
    ({"claims": {"block_count": 100000}}, "block_count 100000 is not a layer count"),
    ({"claims": {"block_count": 3}}, "its header says 3 layers but its tensors are for 2"),
    ({"claims": {"head_count_kv": 0}}, "head_count_kv 0 does not divide"),
    ({"claims": {"head_count_kv": 3}}, "head_count_kv 3 does not divide"),
    ({"claims": {"embedding_length": 512}}, "tensor token_embd.weight is 269x256, but the header's sizes make it "
                                             "269x512"),
    ({"nan_in": "output_norm.weight"}, "tensor output_norm.weight holds NaN"),
    ({"nan_in": "blk.1.ffn_norm.weight"}, "tensor blk.1.ffn_norm.weight holds NaN"),
])
def test_a_gguf_that_cannot_be_its_model_is_one_line_exit_2(tmp_path, options, cause):
    from gguf_models import write_model

    from specdraft.models.gguf_loading import load_gguf_mapped

    path = write_model(tmp_path / "h.gguf", tied=False, **options)
    with pytest.raises(ProfileError, match=cause) as caught:
        finishes(lambda: load_gguf_mapped(path, "p.toml", "target"))
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)


def test_nan_logits_stop_decoding_instead_of_printing_token_0(pool_file):
    from specdraft.errors import NonFiniteLogits
    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime
    from specdraft.session.prompt_run import PromptRun

    runtime = build_runtime(load_profile(pool_file).with_overrides(policy="fixed:lookup"))
    with torch.no_grad():
        runtime.target.model.lm_head.weight[5].fill_(float("nan"))
    with pytest.raises(NonFiniteLogits) as caught:
        PromptRun(runtime, "hello hello hello", False).run()
    assert caught.value.exit_code == 2


# -- 12: numbers that pass the checks must not fail later -------------------------------------------


@pytest.mark.parametrize("value", ["1e-39", "1e-45", "5e-324", "0.0009"])
def test_a_temperature_that_underflows_is_refused_before_loading(pool_file, value):
    result = runner.invoke(app, ["generate", "--pool", str(pool_file), "--temperature", value, "hi"])
    assert result.exit_code == 2 and "must be 0 (greedy) or from 0.001 to 100" in result.stderr


def test_a_top_p_below_float32s_range_keeps_the_likeliest_token():
    from specdraft.core.sampling import SamplingParams, sampling_probs

    logits = torch.randn(3, 50)
    probs = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=1e-300))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(3))


# -- 13: the width-cost cache is keyed by the model, not by the path it was read from ---------------


def test_the_width_cost_key_ignores_where_the_model_was_read_from(tiny_models):
    from transformers import AutoModelForCausalLM

    from specdraft.models.cached_lm import CachedLM
    from specdraft.models.width_costs import _cache_file

    model = AutoModelForCausalLM.from_pretrained(tiny_models / "target")
    lm = CachedLM(model)
    first = _cache_file(lm, 4)
    model.config._name_or_path = "/another/path/to/the/same/entry"
    assert _cache_file(lm, 4) == first


def test_npy_reader_refuses_object_arrays_and_short_files(tmp_path):
    from specdraft.storage.regular_files import read_npy

    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="Python objects"):
        read_npy(tmp_path / "o.npy")
    np.save(tmp_path / "s.npy", np.arange(10, dtype=np.int32))
    (tmp_path / "s.npy").write_bytes((tmp_path / "s.npy").read_bytes()[:-4])
    with pytest.raises(ValueError, match="claims 10 elements"):
        read_npy(tmp_path / "s.npy")
    np.save(tmp_path / "g.npy", np.arange(10, dtype=np.int32))
    assert read_npy(tmp_path / "g.npy").tolist() == list(range(10))


@pytest.mark.parametrize("make", [
    lambda tmp: Path("/dev/zero"),
    lambda tmp: (os.mkfifo(tmp / "fifo.jsonl"), tmp / "fifo.jsonl")[1],
])
def test_a_data_file_that_is_no_file_is_one_line(tmp_path, make):
    from specdraft.measurement.datasets import load_dataset

    path = make(tmp_path)
    with pytest.raises(UsageError, match="not a regular file") as caught:
        finishes(lambda: load_dataset(path, lambda m: None))
    assert caught.value.exit_code == 2


def test_a_head_config_claiming_huge_sizes_is_refused_before_building(tmp_path, tiny_models):
    from transformers import AutoModelForCausalLM

    from specdraft.drafters.head_model import CONFIG, HeadFileError, load_head, save_head
    from tiny import random_head

    target = AutoModelForCausalLM.from_pretrained(tiny_models / "target")
    save_head(tmp_path / "head", random_head(target, list(range(0, 259, 3))))
    config = json.loads((tmp_path / "head" / CONFIG).read_text())
    for field, value in (("intermediate_size", 10**9), ("draft_vocab", 10**8), ("hidden_size", "32")):
        damaged = config | {field: value}
        (tmp_path / "head" / CONFIG).write_text(json.dumps(damaged))
        with pytest.raises(HeadFileError, match=f"unreadable head config .*{field}"):
            load_head(tmp_path / "head", target)
    (tmp_path / "head" / CONFIG).write_text("[1, 2]")
    with pytest.raises(HeadFileError, match="format None"):
        load_head(tmp_path / "head", target)


@pytest.mark.parametrize("policy", ["normalhedge", "fixed:small"])
def test_a_nan_drafter_under_soft_feedback_finishes_with_the_targets_text(pool_file, policy):
    """The issue's hang: soft feedback from a drafter whose outputs are NaN. Its alignments
    count as rejections, its confidence as 0 (fixed:small drafts with it every round: a NaN
    confidence once crashed the stop rule's calibration); the text is still plain decoding's."""
    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime
    from specdraft.session.prompt_run import PromptRun

    text = pool_file.read_text().replace("[decode]\n", '[decode]\nfeedback = "soft"\n')
    pool_file.write_text(text)
    profile = load_profile(pool_file).with_overrides(policy=policy)
    runtime = build_runtime(profile)
    small = next(d for d in runtime.drafters if d.name == "small")
    with torch.no_grad():
        for parameter in small.causal_lm.parameters():
            parameter.fill_(float("nan"))
    run = finishes(lambda: PromptRun(runtime, "the cat sat on the mat, the cat sat", False).run())
    plain = PromptRun(build_runtime(profile, runtime.target, plain=True), "the cat sat on the mat, the cat sat",
                      False).run()
    assert run.detokenizer.ids == plain.detokenizer.ids


def test_metadata_of_another_architecture_over_llama_tensors_is_one_line(tmp_path, monkeypatch):
    """`phi3` metadata over llama tensors: transformers cannot build it (its report went to a
    silenced log); the user gets one line naming the file, exit 2."""
    from gguf_models import write_model

    from specdraft.models.gguf_loading import load_gguf

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_model(tmp_path / "p.gguf", architecture="phi3", tied=False, layout="llama")
    with pytest.raises(ProfileError, match="transformers cannot build a model from p.gguf") as caught:
        load_gguf(path, torch.float32, {}, "p.toml", "target")
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)
