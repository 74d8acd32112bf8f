"""Building and loading the C kernels (models/kernels/build.py): a compiler given as a command
(`ccache gcc`), a missing compiler, an unusable cache folder and two first builds at once all
end in a working build or a one-line error; a library planted under a build's name, or a
damaged build, is built again and the planted code never runs; killed compiles leave nothing
behind. A tiny C source stands in for the kernels (the same code path, a fraction of a second
to compile)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdraft.models.kernels import build as kernel_build
from specdraft.models.kernels.build import KernelBuildError, load_library, record_of, trusted

pytestmark = pytest.mark.skipif(kernel_build.shutil.which("cc") is None and kernel_build.shutil.which("gcc") is None,
                                reason="no C compiler")

SOURCE = "int kernel_probe(void) { return 42; }\n"
PLANTED = ('#include <stdio.h>\n#include <stdlib.h>\n'
           '__attribute__((constructor)) static void planted(void) {\n'
           '    FILE *f = fopen(getenv("SPECDRAFT_TEST_MARKER"), "w"); if (f) fclose(f); }\n'
           'int kernel_probe(void) { return 7; }\n')
FLAGS = ["-O1", "-shared", "-fPIC"]


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    kernel_build._private_folder.cache_clear()
    path = tmp_path / "probe.c"
    path.write_text(SOURCE)
    return path


def planted_library(tmp_path: Path, at: Path) -> Path:
    code = tmp_path / "planted.c"
    code.write_text(PLANTED)
    subprocess.run(["cc", "-shared", "-fPIC", str(code), "-o", str(at)], check=True)
    return at


def test_a_build_is_loaded_and_recorded(source, tmp_path):
    library = load_library("probe", [source], FLAGS, "d1")
    assert library.kernel_probe() == 42
    target = tmp_path / "cache" / "kernels" / "probe-d1.so"
    assert trusted(target) and record_of(target).exists()
    assert not [p for p in target.parent.iterdir() if ".partial" in p.name]


def test_a_compiler_given_as_a_command_is_split_like_a_shell(source, tmp_path, monkeypatch):
    wrapper = tmp_path / "bin" / "ccache"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\nexec "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CC", "ccache cc")
    assert load_library("probe", [source], FLAGS, "d2").kernel_probe() == 42
    assert "probe.c" in (tmp_path / "calls").read_text()


@pytest.mark.parametrize("cc", ["/no/such/compiler", "no-such-compiler-xyz", "'unbalanced"])
def test_a_missing_compiler_is_one_line(source, monkeypatch, cc):
    monkeypatch.setenv("CC", cc)
    with pytest.raises(KernelBuildError) as caught:
        load_library("probe", [source], FLAGS, "d3")
    assert "\n" not in str(caught.value) and "CC=" in str(caught.value)


def test_a_source_that_does_not_compile_is_one_line(source):
    source.write_text("this is not C\n")
    with pytest.raises(KernelBuildError, match="compiling probe.c failed") as caught:
        load_library("probe", [source], FLAGS, "d4")
    assert "\n" not in str(caught.value)
    assert not [p for p in (source.parent / "cache" / "kernels").iterdir() if ".partial" in p.name]


def load_in_another_process(source: Path, digest: str) -> subprocess.CompletedProcess:
    """`load_library` run by a new process: a build damaged on disk must never be one this
    process has loaded (rewriting a loaded library in place kills its process with SIGBUS)."""
    return subprocess.run([sys.executable, "-c",
                           "from pathlib import Path\nfrom specdraft.models.kernels.build import load_library\n"
                           f"print(load_library('probe', [Path({str(source)!r})], {FLAGS!r}, {digest!r}).kernel_probe())"],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=120)


def test_a_library_planted_under_a_builds_name_never_runs(source, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("SPECDRAFT_TEST_MARKER", str(marker))
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    target = planted_library(tmp_path, folder / "probe-d5.so")
    done = load_in_another_process(source, "d5")
    assert done.stdout.strip() == "42", done.stderr  # rebuilt: no record of ours
    assert not marker.exists()
    planted_library(tmp_path, target)  # swapped in after a build: its hash is not the recorded one
    assert not trusted(target)
    done = load_in_another_process(source, "d5")
    assert done.stdout.strip() == "42", done.stderr
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "random"])
def test_a_damaged_build_is_built_again(source, tmp_path, damage):
    target = tmp_path / "cache" / "kernels" / "probe-d6.so"
    assert load_in_another_process(source, "d6").stdout.strip() == "42"
    data = target.read_bytes()
    target.write_bytes({"truncated": data[: len(data) // 3], "empty": b"", "random": os.urandom(4096)}[damage])
    assert not trusted(target)
    done = load_in_another_process(source, "d6")
    assert done.returncode == 0 and done.stdout.strip() == "42", done.stderr
    assert trusted(target)


def test_a_build_that_loads_badly_under_a_matching_record_is_built_again_once(source, tmp_path):
    # written so by a crash between the rename and the first load, or by a bad disk
    target = tmp_path / "cache" / "kernels" / "probe-d7.so"
    target.parent.mkdir(parents=True, mode=0o700)
    target.write_bytes(b"\x7fELF garbage")
    record_of(target).write_text(kernel_build._sha256(target))
    assert trusted(target)
    assert load_library("probe", [source], FLAGS, "d7").kernel_probe() == 42
    assert trusted(target) and target.read_bytes() != b"\x7fELF garbage"


def test_a_folder_others_may_write_is_not_used(source, tmp_path, caplog):
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with caplog.at_level("WARNING", logger="specdraft"):
        assert load_library("probe", [source], FLAGS, "d8").kernel_probe() == 42
    assert "may be written by other users" in caplog.text and not list(folder.glob("probe-*"))


def test_a_cache_that_cannot_hold_a_folder_builds_privately(source, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level("WARNING", logger="specdraft"):
        assert load_library("probe", [source], FLAGS, "d9").kernel_probe() == 42
    assert "building in" in caplog.text


def test_two_first_builds_at_once_compile_once_and_both_load(source, tmp_path):
    wrapper = tmp_path / "slowcc"
    wrapper.write_text(f'#!/bin/sh\necho x >> {tmp_path / "compiles"}\nsleep 1\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CC": str(wrapper)}
    code = ("from pathlib import Path\nfrom specdraft.models.kernels.build import load_library\n"
            f"print(load_library('probe', [Path({str(source)!r})], {FLAGS!r}, 'd10').kernel_probe())")
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env) for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [out.strip() for out, _ in outputs] == ["42", "42"], outputs
    assert (tmp_path / "compiles").read_text().count("x") == 1


def test_what_killed_compiles_left_is_removed(source, tmp_path):
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    from specdraft.storage.atomic_files import host

    dead = folder / f".probe-d11.so.partial-{host()}-999999999-abc"
    dead.write_bytes(b"half")
    old = folder / ".partial-xyz.so"  # specdraft 0.1's name
    old.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    load_library("probe", [source], FLAGS, "d11")
    assert not dead.exists() and not old.exists()
