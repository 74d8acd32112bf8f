"""Stores on disk behave as small databases: a kill at any point of a compaction or a
datastore build leaves a store that opens and holds every document exactly once; a second
process at the same time never fails; every byte read back is checked (a damaged store is
repaired with a warning, or refused with a one-line error); a bench leaves the learned
store as it found it."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import stat
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specdraft.storage import atomic_files
import specdraft.drafters.learned_store as learned_store
from crash_harness import kill_points, run_killed
from test_suffix import POOL
from specdraft.drafters.datastore import StoreError, documents_of, open_store, write_store
from specdraft.drafters.learned_store import CURRENT, LearnedStore
from specdraft.drafters.suffix_index import concatenate

VOCAB = 1000


def doc(i: int) -> list[int]:
    """A document no other shares (its first two tokens name it)."""
    return [i // 100 + 1, i % 100 + 1] + [(i * 7 + j) % 900 + 10 for j in range(8)]


def held(root: Path) -> Counter:
    """Every document the learned store at `root` yields, counted."""
    base, pending = LearnedStore(root, "abc", 8, 10**6, VOCAB).open()
    docs = (documents_of(base.text) if base is not None else []) + pending
    return Counter(tuple(d.tolist()) for d in docs)


def expected(ids) -> Counter:
    return Counter(tuple(doc(i)) for i in ids)


@pytest.fixture
def small_compactions(monkeypatch):
    monkeypatch.setattr(learned_store, "COMPACT_MIN_TOKENS", 100)


def make_learned(root: Path, base_docs: range, segment_docs: range) -> None:
    store = LearnedStore(root, "abc", 8, 10**6, VOCAB)
    for i in base_docs:
        store.append(doc(i))
    assert store.open()[1] == []  # folded into a base
    for i in segment_docs:
        store.append(doc(i))


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(".*") if ".partial-" in p.name or ".replaced-" in p.name)


def compaction_to_kill(tmp_path: Path):
    """(a learned store of 30 compacted and 30 pending documents, a working copy of it, a
    compaction of the copy)."""
    template = tmp_path / "template"
    make_learned(template, range(30), range(30, 60))
    root = tmp_path / "store"
    restore(template, root)
    return template, root, lambda: LearnedStore(root, "abc", 8, 10**6, VOCAB).open()


def restore(template: Path, root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)


def test_a_compaction_killed_anywhere_leaves_every_document_exactly_once(tmp_path, small_compactions):
    template, root, compact = compaction_to_kill(tmp_path)
    killed = 0
    for at in kill_points(compact, 60):
        restore(template, root)
        killed += run_killed(compact, at)
        assert held(root) == expected(range(60)), f"killed at line {at}"
        LearnedStore(root, "abc", 8, 10**6, VOCAB).append(doc(60))
        assert held(root) == expected(range(61)), f"killed at line {at}"
    assert killed >= 58


def test_a_second_process_during_a_killed_compaction_reads_and_records(tmp_path, small_compactions):
    template, root, compact = compaction_to_kill(tmp_path)
    for n, at in enumerate(kill_points(compact, 24)):
        restore(template, root)
        other = os.fork()
        if other == 0:  # the second process: opens (maybe waits on the lock), checks, records
            code = 1
            try:
                time.sleep(random.random() * 0.02)
                code = 0 if held(root) == expected(range(60)) else 4
                LearnedStore(root, "abc", 8, 10**6, VOCAB).append(doc(100 + n))
            finally:
                os._exit(code)
        run_killed(compact, at)
        _, status = os.waitpid(other, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"second process failed (kill at {at})"
        assert held(root) == expected([*range(60), 100 + n])


def test_compaction_is_published_before_segments_go_and_garbage_is_collected(tmp_path, small_compactions):
    """A kill after CURRENT moved and before the segments are deleted must not count any
    document twice."""
    root = tmp_path / "store"
    make_learned(root, range(20), range(20, 40))
    segments = sorted((root / "segments").glob("[0-9]*.npy"))
    kept = {f.name: f.read_bytes() for f in segments}
    LearnedStore(root, "abc", 8, 10**6, VOCAB).open()  # compacts
    for name, data in kept.items():  # as if killed before deleting them
        (root / "segments" / name).write_bytes(data)
    dead = dead_pid()
    (root / f".base-1.partial-{atomic_files.host()}-{dead}-x").mkdir()
    (root / f".base-1.partial-otherhost-{dead}-x").mkdir()  # another machine's: left for an hour
    (root / "segments" / f".1.npy.partial-{atomic_files.host()}-{dead}-y").write_bytes(b"half")
    (root / "segments" / ".tmp-old.npy").write_bytes(b"old style")
    assert held(root) == expected(range(40))
    LearnedStore(root, "abc", 8, 10**6, VOCAB).append(doc(40))
    for i in range(41, 60):
        LearnedStore(root, "abc", 8, 10**6, VOCAB).append(doc(i))
    assert held(root) == expected(range(60))  # compacted again: the stale copies deleted
    assert leftovers(root) == [".base-1.partial-otherhost-%d-x" % dead]
    assert not list((root / "segments").glob(".tmp-*"))
    assert len(list(root.glob("base-*"))) == 1


@pytest.mark.parametrize("pointer", [b"", b"\xff\xfe garbage", b"base-missing", b"../etc"])
def test_a_damaged_pointer_falls_back_to_the_newest_intact_base(tmp_path, small_compactions, caplog, pointer):
    """Item 3: an empty CURRENT made the next compaction drop the intact base."""
    root = tmp_path / "store"
    make_learned(root, range(30), range(30, 45))
    (root / CURRENT).write_bytes(pointer)
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        assert held(root) == expected(range(45))
    assert "names no intact base; using base-" in caplog.text
    for i in range(45, 60):
        LearnedStore(root, "abc", 8, 10**6, VOCAB).append(doc(i))
    assert held(root) == expected(range(60))  # the compaction after it kept the base


def test_a_damaged_base_with_no_other_starts_over_with_a_warning(tmp_path, small_compactions, caplog):
    root = tmp_path / "store"
    make_learned(root, range(30), range(30, 35))
    base = root / (root / CURRENT).read_text()
    (base / "meta.json").write_text("[]")
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        assert held(root) == expected(range(30, 35))
    assert "starting a new one" in caplog.text


def damage_segment(path: Path, how: str) -> None:
    if how == "2-d":
        np.save(path, np.full((3, 4), -1, dtype=np.int32))
    elif how == "out of vocabulary":
        np.save(path, concatenate([[1, 2, VOCAB + 5]]))
    elif how == "float":
        np.save(path, np.array([-1.0, 3.0, -1.0]))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    elif how == "no separators":
        np.save(path, np.array([1, 2, 3], dtype=np.int32))


@pytest.mark.parametrize("how", ["2-d", "out of vocabulary", "float", "truncated", "no separators"])
def test_a_damaged_segment_is_skipped_with_a_warning_and_deleted_at_compaction(tmp_path, small_compactions,
                                                                              caplog, how):
    """Items 7 and 8: one bad segment made every later run exit 1."""
    root = tmp_path / "store"
    make_learned(root, range(20), range(20, 25))
    victim = sorted((root / "segments").glob("[0-9]*.npy"))[2]
    damage_segment(victim, how)
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        assert held(root) == expected([*range(20), 20, 21, 23, 24])
    assert f"segment {victim.name} is damaged" in caplog.text
    for i in range(25, 45):
        LearnedStore(root, "abc", 8, 10**6, VOCAB).append(doc(i))
    assert held(root) == expected([*range(20), 20, 21, *range(23, 45)])
    assert not victim.exists()


def test_a_base_with_an_out_of_vocabulary_id_or_a_bad_order_is_not_opened(tmp_path):
    write_store(tmp_path / "s", concatenate([doc(1), doc(2)]), 8, "abc")
    assert open_store(tmp_path / "s", "abc", VOCAB).tokens == 20
    text = np.load(tmp_path / "s" / "text.npy")
    text[4] = VOCAB + 1
    np.save(tmp_path / "s" / "text.npy", text)
    with pytest.raises(StoreError, match="outside the vocabulary of 1000"):
        open_store(tmp_path / "s", "abc", VOCAB)
    write_store(tmp_path / "s", concatenate([doc(1), doc(2)]), 8, "abc")
    order = np.load(tmp_path / "s" / "order.npy")
    order[0] = 10**6
    np.save(tmp_path / "s" / "order.npy", order)
    with pytest.raises(StoreError, match="order points outside the text"):
        open_store(tmp_path / "s", "abc", VOCAB)


@pytest.mark.parametrize("meta", ["[]", '{"format": 1, "tokenizer": "abc", "depth": "abc", "tokens": 20}',
                                  '{"format": 1, "tokenizer": "abc", "depth": 8, "tokens": -3}', "not json",
                                  '{"format": 1, "tokenizer": "abc", "depth": 8, "tokens": 19}'])
def test_damaged_metadata_is_a_store_error_naming_the_folder(tmp_path, meta):
    write_store(tmp_path / "s", concatenate([doc(1), doc(2)]), 8, "abc")
    (tmp_path / "s" / "meta.json").write_text(meta)
    with pytest.raises(StoreError, match=f"{tmp_path / 's'}.*(damaged|unreadable)"):
        open_store(tmp_path / "s", "abc", VOCAB)


@pytest.mark.parametrize("exchange", [True, False])
def test_a_datastore_build_killed_anywhere_leaves_the_old_store_or_the_new(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic_files, "_renameat2_fn", False)
    old, new = concatenate([doc(i) for i in range(5)]), concatenate([doc(i) for i in range(5, 40)])
    out = tmp_path / "store"
    build = lambda: write_store(out, new, 8, "abc")  # noqa: E731
    write_store(out, old, 8, "abc")
    points = kill_points(build, 30)
    outcomes = Counter()
    for at in points:
        write_store(out, old, 8, "abc")
        run_killed(build, at)
        text = open_store(out, "abc", VOCAB).text
        outcomes["old" if np.array_equal(text, old) else "new"] += 1
        assert np.array_equal(text, old) or np.array_equal(text, new), f"killed at line {at}"
    assert outcomes["old"] >= 10 and outcomes["new"] >= 1
    write_store(out, old, 8, "abc")  # the next build clears what the killed ones left
    assert leftovers(tmp_path) == []


def test_stores_get_the_permissions_of_new_folders(tmp_path):
    """Item 13: store folders were created 0700 whatever the umask."""
    umask = os.umask(0o022)
    try:
        write_store(tmp_path / "s", concatenate([doc(1)]), 8, "abc")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "s" / "meta.json").stat().st_mode) == 0o644




def test_datastore_build_refuses_to_read_its_own_output(tiny_models, tmp_path):
    """Item 4: `datastore build STORE --out STORE` replaced a store with one built from its meta.json."""
    from specdraft.cli import app

    pool = tmp_path / "pool.toml"
    pool.write_text(POOL.format(root=tiny_models, extra=""))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def add(a, b):\n    return a + b\n")
    runner = CliRunner()
    store = tmp_path / "src" / "store"
    built = runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(tmp_path / "src"), "--out", str(store)])
    assert built.exit_code == 0, built.stderr
    before = {f.name: f.read_bytes() for f in store.iterdir()}
    again = runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(store), "--out", str(store)])
    assert again.exit_code == 2 and "is also an input" in again.stderr
    assert {f.name: f.read_bytes() for f in store.iterdir()} == before
    rebuilt = runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(tmp_path / "src"), "--out", str(store)])
    assert rebuilt.exit_code == 0, rebuilt.stderr  # the store inside the input folder is not indexed
    assert json.loads((store / "meta.json").read_text())["documents"] == 1
    if Path("/proc/self").is_dir():
        proc = runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(tmp_path / "src"),
                                   "--out", "/proc/specdraft-store"])
        assert proc.exit_code == 2 and "cannot write in /proc" in proc.stderr


def test_a_damaged_datastore_in_a_profile_is_a_profile_error(tiny_models, tmp_path):
    from specdraft.cli import app

    (tmp_path / "src.txt").write_text("def add(a, b):\n    return a + b\n")
    pool = tmp_path / "pool.toml"
    pool.write_text(POOL.format(root=tiny_models, extra=""))
    runner = CliRunner()
    assert runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(tmp_path / "src.txt"),
                               "--out", str(tmp_path / "store")]).exit_code == 0
    text = np.load(tmp_path / "store" / "text.npy")
    text[3] = 10**6  # a flipped high bit
    np.save(tmp_path / "store" / "text.npy", text)
    with_store = tmp_path / "with-store.toml"
    with_store.write_text(POOL.format(root=tiny_models, extra=f'store = "{tmp_path / "store"}"'))
    done = runner.invoke(app, ["generate", "--pool", str(with_store), "--raw", "def add(a"])
    assert done.exit_code == 2 and "drafters[0].store" in done.stderr and "outside the vocabulary" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def learned_root() -> Path:
    from specdraft.storage.cache_root import cache_dir

    return cache_dir() / "suffix"


def store_bytes() -> dict[str, bytes]:
    root = learned_root()
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "lock"} if root.exists() else {}


def test_bench_reads_the_learned_store_as_it_was_and_leaves_it(tiny_models, tmp_path):
    """Item 6: a second identical bench drafted the first one's answers."""
    from specdraft.cli import app

    shutil.rmtree(learned_root(), ignore_errors=True)
    pool = tmp_path / "pool.toml"
    fixed_length = POOL.replace('drafter = "suffix"', 'drafter = "suffix"\ndraft_length = "fixed"')
    pool.write_text(fixed_length.format(root=tiny_models, extra="learn = true\nprompt = false"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                            for i, p in enumerate(["def add(a", "hello wor", "1 + 2 ="])))
    runner = CliRunner()
    taught = runner.invoke(app, ["generate", "--pool", str(pool), "--raw", "def add(a"])
    assert taught.exit_code == 0, taught.stderr
    before = store_bytes()
    assert before
    runs = []
    for n in range(2):
        out = tmp_path / f"bench{n}.json"
        runs.append(runner.invoke(app, ["bench", "--pool", str(pool), "--data", str(data), "--repeat", "2", "--out", str(out)]))
        assert runs[-1].exit_code == 0, runs[-1].stderr
        assert "record nothing" in runs[-1].stderr
    assert store_bytes() == before
    drafted = [[(s["config"], s["id"], s["accepted_at"], s["drafted_at"])
                for s in json.loads((tmp_path / f"bench{n}.json").read_text())["samples"]] for n in range(2)]
    assert drafted[0] == drafted[1]
    assert any(sum(s[3]) for s in drafted[0])  # the store was drafted from


def test_a_flipped_bit_in_a_learned_segment_never_breaks_a_prompt(tiny_models, tmp_path):
    """Item 7: one out-of-vocabulary id made every later chat prompt exit 1."""
    from specdraft.cli import app

    shutil.rmtree(learned_root(), ignore_errors=True)
    pool = tmp_path / "pool.toml"
    pool.write_text(POOL.format(root=tiny_models, extra="learn = true"))
    runner = CliRunner()
    first = runner.invoke(app, ["generate", "--pool", str(pool), "--raw", "def add(a"])
    assert first.exit_code == 0, first.stderr
    (segment,) = learned_root().rglob("segments/[0-9]*.npy")
    text = np.load(segment)
    text[2] = 10**6
    np.save(segment, text)
    again = runner.invoke(app, ["generate", "--pool", str(pool), "--raw", "def add(a"])
    assert again.exit_code == 0, again.stderr
    assert "is damaged" in again.stderr and again.stdout == first.stdout


def test_a_reader_never_mixes_two_versions_of_a_store_being_replaced(tmp_path):
    versions = [concatenate([doc(i) for i in range(n)]) for n in (3, 30)]
    out = tmp_path / "store"
    write_store(out, versions[0], 8, "abc")
    writer = os.fork()
    if writer == 0:
        code = 1
        try:
            for n in range(40):
                write_store(out, versions[n % 2], 8, "abc")
            code = 0
        finally:
            os._exit(code)
    seen = Counter()
    while True:
        finished, status = os.waitpid(writer, os.WNOHANG)
        store = open_store(out, "abc", VOCAB)  # a mixed read would fail its checks (sizes differ)
        seen[len(store.text)] += 1
        assert any(np.array_equal(store.text, v) for v in versions)
        if finished:
            break
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".store.lock", "store"]
