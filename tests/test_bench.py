"""bench, trace and calibrate-beta from the command line, on the tiny models."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdraft.config.edit import write_policy_option
from specdraft.measurement.sweeps import SweepRow, best_row
from specdraft.cli import app
from specdraft.config.profile import load_profile

runner = CliRunner()


@pytest.fixture
def data_file(tmp_path):
    file = tmp_path / "data.jsonl"
    file.write_text('{"prompt": "hello hello hello", "task": "copy"}\n{"prompt": "abc", "task": "open"}\n'
                    'broken line\n{"prompt": "the cat the cat the", "task": "copy"}\n')
    return file


def test_bench_runs_every_config_interleaved_and_reports_no_mismatch(pool_file, data_file, tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                                 "normalhedge,fixed:lookup", "--baseline", "transformers", "--repeat", "2",
                                 "--out", str(out), "--csv", str(tmp_path / "r.csv")])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert "data.jsonl:3: skipped" in result.stderr and "speedup" in result.stderr
    report = json.loads(out.read_text())
    configs = {s["config"] for s in report["samples"]}
    assert configs == {"plain", "normalhedge", "fixed:lookup", "transformers greedy", "transformers prompt-lookup",
                       "transformers assisted:small", "transformers assisted:half"}
    assert len(report["samples"]) == len(configs) * 3 * 2
    assert all(not s["mismatch"] for s in report["samples"])
    overall = {r["config"]: r for r in report["summary"] if r["task"] == "all"}
    assert overall["plain"]["speedup"] == pytest.approx(1.0) and overall["plain"]["mean_accepted"] == 1.0
    assert overall["normalhedge"]["regret"] is not None and overall["fixed:lookup"]["regret"] is None
    assert len(overall["normalhedge"]["acceptance_at"]) == 4
    assert (tmp_path / "r.csv").read_text().startswith("task,config,prompts,speedup")


def test_plot_draws_a_png(pool_file, data_file, tmp_path):
    png = tmp_path / "p.png"
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                                 "normalhedge", "--plot", str(png), "-n", "8"])
    assert result.exit_code == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_then_replay_and_calibrate(pool_file, data_file, tmp_path):
    trace = tmp_path / "t.jsonl"
    result = runner.invoke(app, ["trace", "--pool", str(pool_file), "--data", str(data_file), "--out", str(trace)])
    assert result.exit_code == 0, result.stderr
    replayed = runner.invoke(app, ["bench", "--replay", str(trace), "--policies", "ucb,normalhedge,fixed:lookup",
                                   "--out", str(tmp_path / "rep.json")])
    assert replayed.exit_code == 0, replayed.stderr
    summary = json.loads((tmp_path / "rep.json").read_text())["summary"]
    assert {r["config"] for r in summary} == {"plain", "ucb", "normalhedge", "fixed:lookup"}
    assert all(r["speedup"] > 0 for r in summary)

    text = pool_file.read_text().replace('[policy]\nname = "random"', '[policy]\n# learner\nname = "ucb"  # MetaSD\n')
    pool_file.write_text(text)
    calibrated = runner.invoke(app, ["calibrate-beta", "--pool", str(pool_file), "--trace", str(trace),
                                     "--grid", "0.001,0.01,0.1", "--write"])
    assert calibrated.exit_code == 0, calibrated.stderr
    assert "best beta" in calibrated.stderr and "wrote [policy] beta" in calibrated.stderr
    edited = pool_file.read_text()
    assert edited.replace(edited[edited.index("beta = "):].split("\n")[0] + "\n", "") == text
    assert load_profile(pool_file).policy.options["beta"] in (0.001, 0.01, 0.1)


def test_calibrate_refuses_what_it_cannot_explain(pool_file, tmp_path):
    result = runner.invoke(app, ["calibrate-beta", "--pool", str(pool_file), "--policy", "normalhedge",
                                 "--param", "beta", "--trace", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "cannot calibrate normalhedge.beta" in result.stderr


def test_bench_usage_errors(pool_file, tmp_path):
    missing = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(tmp_path / "x.jsonl")])
    assert missing.exit_code == 2 and "file not found" in missing.stderr
    bad = runner.invoke(app, ["bench", "--replay", str(pool_file)])
    assert bad.exit_code == 2 and "cannot read trace" in bad.stderr


def test_write_policy_option_keeps_everything_else(tmp_path):
    file = tmp_path / "p.toml"
    original = '# top\n[target]\nhub = "a/b"\n\n[policy]  # learner\nname = "ucb"\nbeta = 0.01   # keep me\n\n[[drafters]]\nname = "x"\n'
    file.write_text(original)
    write_policy_option(file, "beta", 0.003)
    assert file.read_text() == original.replace("beta = 0.01   # keep me", "beta = 0.003   # keep me")
    write_policy_option(file, "reward", 1.5)
    assert file.read_text().replace('reward = 1.5\n', "") == original.replace("0.01", "0.003")
    assert '\nbeta = 0.003   # keep me\nreward = 1.5\n\n[[drafters]]' in file.read_text()


def test_best_row_prefers_the_published_value_on_a_tie():
    rows = [SweepRow(0.001, 2.0, 1.5, None), SweepRow(0.01, 2.0, 1.5, None), SweepRow(0.1, 1.9, 1.4, None)]
    assert best_row(rows, prefer=0.01).value == 0.01
    assert best_row(rows[:1] + rows[2:], prefer=0.01).value == 0.001
