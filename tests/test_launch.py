"""The command's start: when it runs itself again under glibc's huge-page tunable, with what
environment and arguments, and that the second start runs the command line as the first would."""

from __future__ import annotations

import os
import subprocess
import sys

from specdraft import launch

LINUX, GLIBC = "linux", (2, 36)


def test_the_tunable_is_added_only_where_the_heap_would_not_get_huge_pages_otherwise():
    env = launch.huge_page_environment({"PATH": "/bin"}, LINUX, "madvise", GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # "always" gives the heap huge pages already, "never" gives none; unknown: leave it
    for mode in ("always", "never", None):
        assert launch.huge_page_environment({}, LINUX, mode, GLIBC) is None
    assert launch.huge_page_environment({}, "darwin", "madvise", GLIBC) is None
    assert launch.huge_page_environment({}, LINUX, "madvise", (2, 34)) is None  # no such tunable yet
    assert launch.huge_page_environment({}, LINUX, "madvise", None) is None  # musl, or no glibc
    assert launch.huge_page_environment({"SPECDRAFT_HUGE_PAGES": "0"}, LINUX, "madvise", GLIBC) is None


def test_the_users_tunables_are_kept_and_a_set_one_is_not_overridden():
    env = launch.huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, LINUX, "madvise", GLIBC)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # the second start (or a user who chose a value, 0 included) runs as it is: no loop
    for tunables in ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=0", "a=1:glibc.malloc.hugetlb=2"):
        assert launch.huge_page_environment({"GLIBC_TUNABLES": tunables}, LINUX, "madvise", GLIBC) is None


def test_the_mode_is_read_from_the_bracketed_choice(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(launch, "THP_SETTING", setting)
    assert launch.huge_page_mode() is None  # no such file: not Linux, or no THP
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never"), ("garbage\n", None)]:
        setting.write_text(text)
        assert launch.huge_page_mode() == mode


def test_the_command_runs_again_with_its_own_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "huge_page_mode", lambda: "madvise")
    monkeypatch.setattr(launch, "glibc_version", lambda: GLIBC)
    monkeypatch.setattr(launch.sys, "platform", LINUX)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("SPECDRAFT_HUGE_PAGES", raising=False)
    monkeypatch.setattr(launch.sys, "orig_argv", ["python3", "/venv/bin/specdraft", "generate", "-p", "x.toml", "hi"])
    monkeypatch.setattr(launch.os, "execve", lambda path, args, env: calls.append((path, args, env)))
    launch.run_with_huge_pages()
    (path, args, env), = calls
    assert path == sys.executable and args == [sys.executable, "/venv/bin/specdraft", "generate", "-p", "x.toml", "hi"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["PATH"] == os.environ["PATH"]

    def refused(path, args, env):
        raise OSError("exec refused")

    monkeypatch.setattr(launch.os, "execve", refused)
    launch.run_with_huge_pages()  # an exec that fails runs the command as started


def test_a_real_start_runs_again_under_the_tunable_where_this_machine_takes_it():
    """A process that starts as the command does, on this machine: it prints the tunable only
    if it ran itself again under it, which it must exactly where the machine's settings say so."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SPECDRAFT_HUGE_PAGES")}
    code = "import os; from specdraft import launch; launch.run_with_huge_pages(); print(os.environ.get('GLIBC_TUNABLES'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    expected = launch.huge_page_environment(env, sys.platform, launch.huge_page_mode(), launch.glibc_version())
    assert out.stdout.strip() == (str(None) if expected is None else expected["GLIBC_TUNABLES"])
    off = subprocess.run([sys.executable, "-c", code], env={**env, "SPECDRAFT_HUGE_PAGES": "0"},
                         capture_output=True, text=True, timeout=60)
    assert off.stdout.strip() == "None"


def test_the_command_line_answers_after_the_second_start():
    entry = ["-m", "specdraft"]
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, *entry, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().startswith("specdraft "), out.stderr
    usage = subprocess.run([sys.executable, *entry, "generate"], env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2  # exit codes come back through the exec (a missing --pool)
