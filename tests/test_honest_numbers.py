"""Numbers a user reads must be measured or labelled as estimates: --stats and --json call
the cost model's comparison with plain decoding an estimate (plain was not timed), and the
verify costs stored on disk are checked against the machine as it is now."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.learning.goodput import VerifyCosts

runner = CliRunner()


def test_the_cost_model_corrects_a_curve_measured_under_load_within_a_prompt():
    truth = [0.004, 0.0042, 0.0045, 0.005, 0.0052, 0.0055]
    costs = VerifyCosts(decay=0.95)
    costs.install([3 * s for s in truth])  # timed while another job ran
    for round_ in range(12):
        width = 1 + round_ % 6
        costs.add(width, truth[width - 1])
    assert all(abs(costs(w) / truth[w - 1] - 1) < 0.1 for w in range(1, 7))


def test_one_slow_round_does_not_throw_the_costs_off():
    truth = [0.004, 0.0042, 0.0045]
    costs = VerifyCosts(decay=0.95)
    costs.install(truth)
    for round_ in range(20):
        costs.add(1, truth[0] * (5 if round_ == 10 else 1))  # a pause in one round
    assert abs(costs(1) / truth[0] - 1) < 0.25


def test_a_stored_curve_that_disagrees_with_the_machine_is_measured_again(monkeypatch, tmp_path, tiny_models):
    from transformers import AutoModelForCausalLM

    from specdraft.models import width_costs
    from specdraft.models.cached_lm import CachedLM

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    lm = CachedLM(AutoModelForCausalLM.from_pretrained(tiny_models / "target"))
    steady = [[0.01 * w] * 3 for w in range(1, 5)]
    monkeypatch.setattr(width_costs, "timed_widths", lambda *a, **k: steady)
    monkeypatch.setattr(width_costs, "_quick_step", lambda lm: 0.01)
    assert width_costs.width_costs(lm, 4) == [0.01, 0.02, 0.03, 0.04]
    file = width_costs._cache_file(lm, 4)
    stored = json.loads(file.read_text())
    stored["seconds"] = [3 * s for s in stored["seconds"]]  # as if measured under load
    file.write_text(json.dumps(stored))
    assert width_costs.width_costs(lm, 4) == [0.01, 0.02, 0.03, 0.04]  # re-measured ...
    assert json.loads(file.read_text())["seconds"] == [0.01, 0.02, 0.03, 0.04]  # ... and stored


def test_a_measurement_taken_while_busy_is_used_but_not_stored(monkeypatch, tmp_path, tiny_models, caplog):
    from transformers import AutoModelForCausalLM

    from specdraft.models import width_costs
    from specdraft.models.cached_lm import CachedLM

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    lm = CachedLM(AutoModelForCausalLM.from_pretrained(tiny_models / "target"))
    busy = [[0.01 * w, 0.02 * w, 0.015 * w] for w in range(1, 5)]
    monkeypatch.setattr(width_costs, "timed_widths", lambda *a, **k: busy)
    assert width_costs.width_costs(lm, 4) == [0.01, 0.02, 0.03, 0.04]
    assert not width_costs._cache_file(lm, 4).exists() and "busy" in caplog.text


@pytest.mark.parametrize("policy", [None, "fixed:none"])
def test_stats_and_json_never_call_an_estimate_a_speedup(pool_file, policy):
    extra = ["--policy", policy] if policy else []
    shown = runner.invoke(app, ["generate", "--pool", str(pool_file), "--stats", "-n", "12", *extra, "ab ab ab"])
    assert shown.exit_code == 0, shown.stderr
    assert "speedup" not in shown.stderr
    if policy:  # plain decoding: no comparison with plain at all
        assert "plain's speed" not in shown.stderr
    record = json.loads(runner.invoke(app, ["generate", "--pool", str(pool_file), "--json", "-n", "12", *extra,
                                            "ab ab ab"]).stdout)
    assert "achieved_speedup" not in record and "estimated_speedup" in record


def test_tiny_forwards_are_below_the_noise_floor_and_kept_as_measured(monkeypatch, tmp_path, tiny_models):
    """Microsecond forwards vary with the timer more than with load: no busy check there."""
    from transformers import AutoModelForCausalLM

    from specdraft.models import width_costs
    from specdraft.models.cached_lm import CachedLM

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    lm = CachedLM(AutoModelForCausalLM.from_pretrained(tiny_models / "target"))
    noisy = [[0.0001 * w, 0.0003 * w, 0.0002 * w] for w in range(1, 5)]
    monkeypatch.setattr(width_costs, "timed_widths", lambda *a, **k: noisy)
    width_costs.width_costs(lm, 4)
    assert width_costs._cache_file(lm, 4).exists()


def test_calibrate_costs_measures_again_and_keeps_a_quiet_curve(pool_file, tmp_path, monkeypatch):
    from specdraft.models import width_costs

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    quiet = [[0.01 * w] * 3 for w in range(1, 6)]
    monkeypatch.setattr(width_costs, "timed_widths", lambda *a, **k: quiet)
    result = runner.invoke(app, ["calibrate", "costs", "--pool", str(pool_file)])
    assert result.exit_code == 0, result.stderr
    rows = result.stdout.splitlines()
    assert rows[0] == "width\tms\tms/token" and rows[1:] == [f"{w}\t{10 * w:.3f}\t10.000" for w in range(1, 6)]
    assert "kept in" in result.stderr
    (file,) = (tmp_path / "width-costs").iterdir()
    assert json.loads(file.read_text())["seconds"] == [0.01 * w for w in range(1, 6)]
    busy = [[0.012 * w, 0.03 * w, 0.02 * w] for w in range(1, 6)]
    monkeypatch.setattr(width_costs, "timed_widths", lambda *a, **k: busy)
    again = runner.invoke(app, ["calibrate", "costs", "--pool", str(pool_file)])
    assert again.exit_code == 1 and "not kept" in again.stderr
    assert json.loads(file.read_text())["seconds"] == [0.01 * w for w in range(1, 6)]  # the quiet one stays
