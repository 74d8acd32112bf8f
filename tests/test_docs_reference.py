"""docs/profiles.md is generated from the code (tools/make_docs.py) and stays true: the
file is what the generator writes now, every key the code accepts is in it under its
section, and every key has a meaning. The expected keys are computed here from the
dataclasses and registries themselves, not from the generator's loops, so a key added to
the code that the generator missed fails."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
import typing
from pathlib import Path

import specdraft.commands.profile_reference as reference
import specdraft.profile as profile
from specdraft.config import model_spec
from specdraft.drafters import options, registry
from specdraft.learning import policies
from specdraft.learning.policies import OptionSpec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "profiles.md"
STALE = "docs/profiles.md is stale: run `python tools/make_docs.py` and commit the result"


def _rows(text: str) -> list[tuple[str, list[str]]]:
    """(heading, [key, type, default, meaning]) for every key row of the Markdown tables."""
    heading, rows = "", []
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("| `"):
            rows.append((heading, [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]))
    return rows


def documented(text: str) -> dict[str, set[str]]:
    """heading -> the keys its table rows name."""
    found: dict[str, set[str]] = {}
    for heading in (line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")):
        found.setdefault(heading, set())
    for heading, cells in _rows(text):
        found[heading].update(re.findall(r"`([^`]+)`", cells[0]))
    return found


def expected() -> dict[str, set[str]]:
    """heading -> the keys the code accepts there, read from the code at call time."""
    keys = {"[target]": set(model_spec.MODEL_KEYS),
            "[decode]": {f.name for f in dataclasses.fields(profile.DecodeConfig)},
            "[policy]": {"name"},
            "Options every policy takes": set(policies.COMMON_OPTIONS),
            "Keys every drafter takes": {f.name for f in dataclasses.fields(registry.DrafterConfig)} - {"options"}}
    for name, cls in policies.POLICIES.items():
        keys[f"`{name}`"] = set(cls.OPTIONS)
    for kind in registry.KINDS:
        cls = typing.get_type_hints(options.PARSERS[kind])["return"]
        hints = typing.get_type_hints(cls)
        keys[f'kind = "{kind}"'] = {key for f in dataclasses.fields(cls) for key in
                                    (model_spec.MODEL_KEYS if hints[f.name] is model_spec.ModelSpec else (f.name,))}
    return keys


def missing(text: str) -> list[str]:
    """`section: key` for every key the code accepts that `text` does not list there."""
    found = documented(text)
    return [f"{heading}: {key}" for heading, keys in expected().items()
            for key in sorted(keys - found.get(heading, set()))]


def undescribed(text: str) -> list[str]:
    """`section: key` for every row without a type or a meaning."""
    return [f"{heading}: {cells[0]}" for heading, cells in _rows(text) if not (cells[1] and cells[3])]


def test_docs_file_is_what_the_generator_writes():
    assert DOCS.read_text(encoding="utf-8") == reference.profile_reference(), STALE


def test_every_key_the_code_accepts_is_documented():
    text = reference.profile_reference()
    assert missing(text) == []
    found = documented(text)
    extra = {h: found[h] - keys for h, keys in expected().items() if found.get(h, set()) - keys}
    assert extra == {}  # a key documented that the code no longer reads


def test_every_key_has_a_type_and_a_meaning():
    text = reference.profile_reference()
    assert _rows(text)
    assert undescribed(text) == []


def test_a_field_added_to_decode_without_docs_is_caught(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Grown(profile.DecodeConfig):
        brand_new_knob: int = 3

    monkeypatch.setattr(profile, "DecodeConfig", Grown)
    assert missing(DOCS.read_text(encoding="utf-8")) == ["[decode]: brand_new_knob"]
    # The generator lists the new field by itself, and a field without a comment has no meaning.
    monkeypatch.setattr(reference, "DecodeConfig", Grown)
    text = reference.profile_reference()
    assert "brand_new_knob" in documented(text)["[decode]"]
    assert "[decode]: `brand_new_knob`" in undescribed(text)
    assert text != DOCS.read_text(encoding="utf-8")


def test_a_policy_option_added_without_help_is_caught(monkeypatch):
    monkeypatch.setitem(policies.POLICIES["ucb"].OPTIONS, "brand_new_option", OptionSpec((int,), 1))
    assert missing(DOCS.read_text(encoding="utf-8")) == ["`ucb`: brand_new_option"]
    assert undescribed(reference.profile_reference()) == ["`ucb`: `brand_new_option`"]


@dataclasses.dataclass(frozen=True)
class BrandNewOptions:
    depth: int = 2  # how deep it looks


def _parse_brand_new(table, base) -> BrandNewOptions:
    return BrandNewOptions()


def test_a_drafter_kind_added_without_docs_is_caught(monkeypatch):
    monkeypatch.setattr(registry, "KINDS", (*registry.KINDS, "brand_new"))
    monkeypatch.setitem(options.PARSERS, "brand_new", _parse_brand_new)
    assert missing(DOCS.read_text(encoding="utf-8")) == ['kind = "brand_new": depth']


def test_make_docs_check_fails_on_a_stale_file(monkeypatch, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "tools" / "make_docs.py")
    make_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_docs)
    assert make_docs.main(["--check"]) == 0
    stale = tmp_path / "docs" / "profiles.md"
    monkeypatch.setattr(make_docs, "ROOT", tmp_path)
    monkeypatch.setattr(make_docs, "TARGET", stale)
    assert make_docs.main(["--check"]) == 1  # no file yet
    assert "python tools/make_docs.py" in capsys.readouterr().err
    assert make_docs.main([]) == 0 and make_docs.main(["--check"]) == 0
    stale.write_text(stale.read_text(encoding="utf-8").replace("| `top_k` |", "| `top_kk` |"), encoding="utf-8")
    assert make_docs.main(["--check"]) == 1


def test_the_reference_never_imports_torch():
    code = ("import sys; from specdraft.commands.profile_reference import profile_reference; "
            "profile_reference(); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False"
