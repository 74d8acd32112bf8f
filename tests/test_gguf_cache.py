"""The GGUF conversion cache (models/gguf/cache.py, with gguf/key.py, gguf/entry.py and
gguf/leftovers.py): entries keyed by the file's content, and entry writes that a kill at
any line leaves whole or absent, never half-written.

The GGUF files are real (gguf.GGUFWriter: a header, metadata and a tensor); reading them into
a model is replaced by a tiny llama seeded from the file's bytes, so what an entry holds
follows the file's content and a conversion takes milliseconds. Kills run in forked children
(tests/crash_harness.py)."""

from __future__ import annotations

import os
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from crash_harness import kill_points, run_killed
from specdraft.models.gguf import cache as gguf_cache
from specdraft.models.gguf import key as gguf_key
from specdraft.models.gguf.leftovers import legacy_host
from specdraft.models.gguf.cache import converted_gguf, entry_folder
from specdraft.models.gguf.entry import MANIFEST, verify_entry


def write_gguf(path: Path, seed: int = 0, extra: int = 0) -> Path:
    """A tiny but real GGUF file: architecture, a vocabulary, a float tensor; `extra` bytes of
    zeros appended (sparse) stand in for a large file's tensor data."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    writer.add_uint32("llama.block_count", 2)
    writer.add_tensor("t", np.random.default_rng(seed).standard_normal((8, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if extra:
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size + extra)
    return path


class Reader:
    """Stands in for transformers' GGUF reading: (model, tokenizer) whose weights are seeded by
    the file's bytes; `calls` counts conversions in this process, `delay` slows each."""

    def __init__(self):
        self.calls: list[Path] = []
        self.delay = 0.0
        self.started: Path | None = None  # touched when a conversion begins (seen across processes)
        self._models: dict[int, object] = {}

    def __call__(self, path: Path, dtype: str):
        from tiny import byte_tokenizer, tiny_llama

        self.calls.append(path)
        if self.started is not None:
            self.started.touch()
        time.sleep(self.delay)
        seed = zlib.crc32(path.read_bytes())
        if seed not in self._models:  # built once in the parent: the forked writers never build torch models
            tok = byte_tokenizer()
            model = tiny_llama(seed=seed, vocab=len(tok)).float()
            model.config.eos_token_id = tok.eos_token_id
            self._models[seed] = (model, tok)
        return self._models[seed]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the writers
    return tmp_path / "cache" / "gguf"


def convert(path: Path, reader: Reader) -> Path:
    folder = converted_gguf(path, "p.toml", "target", reader)
    assert folder is not None
    return folder


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".partial-" in n or ".replaced-" in n)


def contents(folder: Path) -> dict[str, bytes]:
    """Every file of an entry but its manifest (whose mtimes differ from write to write)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != MANIFEST}


# -- the key follows the content ------------------------------------------------------------


def test_the_same_bytes_at_two_paths_share_one_entry_and_convert_once(cache, tmp_path):
    """One GGUF installed in two environments (a copy: another path, inode and mtime), and
    renamed in a third, is converted once."""
    first = write_gguf(tmp_path / "env-a" / "site-packages" / "tiny.gguf")
    time.sleep(0.01)
    copy = tmp_path / "env-b" / "site-packages" / "tiny.gguf"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(first, copy)
    renamed = tmp_path / "models" / "my-model.gguf"
    renamed.parent.mkdir(parents=True)
    shutil.copyfile(first, renamed)
    assert entry_folder(first) == entry_folder(copy)
    reader = Reader()
    folder = convert(first, reader)
    assert convert(copy, reader) == folder
    assert convert(renamed, reader) == folder == entry_folder(renamed)
    assert len(reader.calls) == 1 and entries(cache) == [folder]
    assert folder.name.startswith("tiny-")


def test_a_file_differing_in_one_sampled_byte_gets_its_own_entry(cache, tmp_path):
    from specdraft.models.gguf.key import HEAD_BYTES, entry_key, sampled_regions

    small = write_gguf(tmp_path / "a" / "tiny.gguf", seed=0)
    other = write_gguf(tmp_path / "b" / "tiny.gguf", seed=1)  # the same header, other tensor bytes
    assert small.stat().st_size == other.stat().st_size
    reader = Reader()
    assert convert(small, reader) != convert(other, reader)
    assert len(reader.calls) == 2

    big = write_gguf(tmp_path / "c" / "big.gguf", extra=60 << 20)  # 60 MiB of tensor data, sparse
    regions = sampled_regions(big.stat().st_size)
    assert regions[0] == (0, HEAD_BYTES) and len(regions) == gguf_key.SAMPLES + 2
    before = entry_key(big)
    (start, length), (next_start, _) = regions[10], regions[11]

    def flipped(offset: int) -> str:
        with open(big, "r+b") as fh:
            fh.seek(offset)
            fh.write(b"\x01")
        try:
            return entry_key(big)
        finally:
            with open(big, "r+b") as fh:
                fh.seek(offset)
                fh.write(b"\x00")

    assert flipped(start + length // 2) != before  # a sampled byte of the tensor data
    assert flipped(HEAD_BYTES - 1) != before  # the header's last byte
    assert flipped(big.stat().st_size - 1) != before  # the tail
    assert flipped((start + length + next_start) // 2) == before  # between samples: the price of not hashing it all
    assert entry_key(big) == before
    assert entry_key(big, "bfloat16") != before  # the flavour is part of the key


def test_an_older_specdraft_entry_for_this_file_is_taken_over_without_converting(cache, tmp_path):
    path = write_gguf(tmp_path / "env" / "tiny.gguf")
    reader = Reader()
    folder = convert(path, reader)
    legacy = gguf_cache.legacy_folder(path, "float32")  # where the path-keyed versions put it
    assert legacy is not None and legacy != folder
    folder.rename(legacy)
    assert convert(path, reader) == folder
    assert len(reader.calls) == 1 and entries(cache) == [folder] and verify_entry(folder) is None
    other = write_gguf(tmp_path / "elsewhere" / "tiny.gguf", seed=5)  # a damaged old entry is not taken
    legacy = gguf_cache.legacy_folder(other, "float32")
    shutil.copytree(folder, legacy)
    (legacy / "config.json").unlink()
    rebuilt = convert(other, reader)
    assert len(reader.calls) == 2 and legacy.exists() and verify_entry(rebuilt) is None


def test_every_load_removes_what_dead_writers_left(cache, tmp_path):
    from specdraft.storage import atomic_files

    path = write_gguf(tmp_path / "tiny.gguf")
    reader = Reader()
    folder = convert(path, reader)
    host = atomic_files.host()
    dead = cache / f".{folder.name}.partial-{host}-999999999-abc"
    old_style = cache / f".partial-{legacy_host()}-999999999-def"  # specdraft before atomic_files
    other_entry = cache / f".other-0123456789abcdef.partial-{host}-999999999-ghi"
    probe = cache / f".probe.partial-{host}-999999999-jkl"
    live = cache / f".{folder.name}.partial-{host}-{os.getpid()}-mno"
    aside = cache / f".{folder.name}.replaced-{host}-999999999"
    for partial in (dead, old_style, other_entry, live, aside):
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"half")
    probe.write_bytes(b"")
    assert convert(path, reader) == folder  # the entry is whole: no conversion, still tidied
    assert len(reader.calls) == 1
    assert leftovers(cache) == [live.name]


# -- kills and concurrency ------------------------------------------------------------------


@pytest.mark.parametrize("start", ["empty", "damaged entry", "damaged entry, no atomic exchange"])
def test_a_killed_entry_write_leaves_the_next_load_a_whole_entry_and_no_leftovers(cache, tmp_path, monkeypatch,
                                                                                  start):
    """The write is killed (SIGKILL) at points spread over the whole load, and at every line
    around the one that publishes the entry (found by bisection). After each kill the next
    load succeeds with the weights an uninterrupted conversion gives, and no partial or
    aside folder remains."""
    from specdraft.storage import atomic_files

    if start.endswith("no atomic exchange"):
        monkeypatch.setattr(atomic_files, "_renameat2_fn", False)  # the rename-aside path
    path = write_gguf(tmp_path / "tiny.gguf")
    reader = Reader()
    reference = contents(convert(path, reader))
    shutil.copytree(entry_folder(path), tmp_path / "reference")

    def prepare():
        shutil.rmtree(cache.parent)
        if start != "empty":
            damaged = entry_folder(path)
            shutil.copytree(tmp_path / "reference", damaged)
            weights = damaged / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])

    def action():
        convert(path, reader)

    checked: dict[int, tuple[bool, bool]] = {}  # kill point -> (killed, the new entry was published)

    def check(at: int) -> bool:
        """Kill a write at line `at`, then load: True when the kill came after the publish."""
        if at not in checked:
            prepare()
            killed = run_killed(action, at)
            published = verify_entry(entry_folder(path)) is None
            calls = len(reader.calls)
            folder = convert(path, reader)
            assert verify_entry(folder) is None, (at, killed)
            assert contents(folder) == reference, (at, killed)
            assert leftovers(cache) == [], (at, killed, leftovers(cache))
            assert entries(cache) == [folder]
            assert len(reader.calls) == calls + (not published)
            checked[at] = (killed, published)
        return checked[at][1]

    prepare()
    spread = kill_points(action, 16 if start == "empty" else 8)
    for at in spread:
        check(at)
    # every line around the publish: bisect between the spread points that bracket it
    first = next(at for at in spread if checked[at][1])
    last_before = max((at for at in spread if not checked[at][1]), default=0)
    low, high = last_before + 1, first
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if check(middle) else (middle + 1, high)
    for at in range(max(1, low - 7), low + 7):
        check(at)
    assert len(checked) >= 20
    outcomes = set(checked.values())
    assert (True, True) in outcomes and (True, False) in outcomes  # kills landed both before and after the publish


def test_a_second_process_asking_during_a_conversion_gets_the_same_entry(cache, tmp_path):
    """While a child converts (slowly), this process asks for the same content under
    another name: it waits for the child's lock and uses the child's entry."""
    path = write_gguf(tmp_path / "env-a" / "tiny.gguf")
    copy = tmp_path / "env-b" / "renamed.gguf"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(path, copy)
    reader = Reader()
    reader(path, "float32")  # builds the model before the fork
    reader.calls.clear()
    reader.delay, reader.started = 1.0, tmp_path / "started"
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.write(write_fd, str(convert(path, reader)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        deadline = time.monotonic() + 30
        while not reader.started.exists():
            assert time.monotonic() < deadline, "the child never began converting"
            time.sleep(0.01)
        reader.started = None
        mine = convert(copy, reader)
    finally:
        child = os.read(read_fd, 4096).decode()
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert reader.calls == []  # this process converted nothing
    assert Path(child) == mine and entries(cache) == [mine]
    assert verify_entry(mine) is None and leftovers(cache) == []
