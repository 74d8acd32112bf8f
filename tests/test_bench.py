"""bench, trace and calibrate-beta from the command line, on the tiny models."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdraft.config.edit import write_policy_option
from specdraft.measurement.sweeps import SweepRow, best_row
from specdraft.cli import app
from specdraft.profile import load_profile

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
    assert "specdraft bench" in result.stdout  # the table is the output; progress and warnings on stderr
    assert "data.jsonl:3: skipped" in result.stderr and "speedup" in result.stdout
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


def test_an_optional_drafter_left_out_is_warned_about_once_per_bench(pool_file, data_file, tmp_path):
    # bench builds a pool per configuration; the warning is the user's, once
    pool_file.write_text(pool_file.read_text() + f"""
[[drafters]]
name = "gone"
kind = "head"
path = "{tmp_path / 'no-head'}"
optional = true
""")
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                                 "normalhedge,fixed:lookup", "--limit", "1", "-n", "4"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count('drafter "gone" left out of the pool') == 1


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
    written = json.loads((tmp_path / "rep.json").read_text())
    summary = written["summary"]
    assert {r["config"] for r in summary} == {"plain", "ucb", "normalhedge", "fixed:lookup"}
    assert all(r["speedup"] > 0 for r in summary)
    # The hindsight bound beside the table (stderr) and in the file: no replayed policy above it.
    assert "in hindsight" in replayed.stdout and "in hindsight" not in replayed.stderr
    bounds = {b["task"]: b for b in written["hindsight"]}
    assert set(bounds) >= {"all"} and set(bounds["all"]["drafters"]) >= {"lookup"}
    for row in summary:
        assert row["speedup"] <= bounds[row["task"]]["pool"] + 1e-9
    assert bounds["all"]["pool"] >= max(bounds["all"]["drafters"].values())

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


# -- calibrate-beta never corrupts the profile --------------------------------------


def test_bad_grid_is_refused_before_any_work(pool_file, data_file, tmp_path):
    pool_file.write_text(pool_file.read_text().replace('name = "random"', 'name = "ucb"'))
    before = pool_file.read_text()
    trace = tmp_path / "t.jsonl"
    result = runner.invoke(app, ["calibrate-beta", "--pool", str(pool_file), "--data", str(data_file), "--trace",
                                 str(trace), "--grid", "-1,-0.5", "--write"])
    assert result.exit_code == 2 and "--grid: ucb.beta = -1: must be >= 0" in result.stderr
    assert pool_file.read_text() == before and not trace.exists()
    window = runner.invoke(app, ["calibrate-beta", "--pool", str(pool_file), "--policy", "swucb", "--param", "window",
                                 "--data", str(data_file), "--grid", "10,2.5"])
    assert window.exit_code == 2 and "takes whole numbers" in window.stderr


def test_an_edit_that_would_be_invalid_is_not_written(tmp_path):
    file = tmp_path / "p.toml"
    file.write_text('[policy]\nname = "ucb"\nbeta = 0.01\n')

    def refuse(text):
        assert "beta = -1.0" in text
        raise ValueError("invalid")

    with pytest.raises(ValueError):
        write_policy_option(file, "beta", -1.0, validate=refuse)
    assert file.read_text() == '[policy]\nname = "ucb"\nbeta = 0.01\n'


def test_a_failed_write_leaves_the_profile_whole(tmp_path, monkeypatch):
    import os

    from specdraft.errors import UsageError

    file = tmp_path / "p.toml"
    file.write_text('[policy]\nname = "ucb"\nbeta = 0.01\n')
    monkeypatch.setattr(os, "replace", lambda *args: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(UsageError, match="cannot write the profile: No space left on device"):
        write_policy_option(file, "beta", 0.5)
    assert file.read_text() == '[policy]\nname = "ucb"\nbeta = 0.01\n'
    assert [p.name for p in tmp_path.iterdir()] == ["p.toml"]


def test_write_updates_a_comment_that_credits_the_paper(tmp_path):
    file = tmp_path / "p.toml"
    file.write_text('policy.name = "ucb"\npolicy.beta = 0.01  # the paper\'s value\n\n[target]\nhub = "a/b"\r\n')
    write_policy_option(file, "beta", 0.3, note="calibrated by specdraft calibrate-beta on 2026-01-01")
    assert file.read_bytes().decode() == ('policy.name = "ucb"\npolicy.beta = 0.3  # calibrated by specdraft calibrate-beta on '
                                '2026-01-01\n\n[target]\nhub = "a/b"\r\n')


# -- outputs are checked first and kept when a run stops -----------------------------


@pytest.fixture
def no_model_loads(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the output paths were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("args, flag", [
    (["trace", "--out", "{missing}/t.jsonl"], "--out"),
    (["bench", "--out", "{tmp}/ok.json", "--csv", "{missing}/r.csv"], "--csv"),
    (["bench", "--plot", "{missing}/p.png"], "--plot"),
    (["bench", "--out", "{tmp}"], "--out"),
    (["bench", "--out", "{tmp}/same.csv", "--csv", "{tmp}/same.csv"], "--csv"),
    (["calibrate-beta", "--trace", "{missing}/t.jsonl"], "--trace"),
    (["trace", "--out", "{data}"], "--out"),
])
def test_bad_output_paths_fail_before_any_model_loads(pool_file, data_file, tmp_path, no_model_loads, args, flag):
    values = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path), "data": str(data_file)}
    args = [a.format(**values) for a in args]
    result = runner.invoke(app, args[:1] + ["--pool", str(pool_file), "--data", str(data_file)] + args[1:])
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), result.stderr


def test_interrupted_trace_keeps_the_prompts_traced(pool_file, data_file, tmp_path, monkeypatch):
    from specdraft.measurement import traces

    real, calls = traces.trace_prompt, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(traces, "trace_prompt", second_fails)
    out = tmp_path / "t.jsonl"
    result = runner.invoke(app, ["trace", "--pool", str(pool_file), "--data", str(data_file), "--out", str(out)])
    assert result.exit_code == 130 and "1 of 3 prompts traced and kept" in result.stderr
    assert "trace: prompt 1/3 (1) traced" in result.stderr  # a plain progress line off a terminal
    assert [p.id for p in traces.Trace.load(out).prompts] == ["1"]


def test_interrupted_bench_keeps_what_it_measured(pool_file, data_file, tmp_path, monkeypatch):
    from specdraft.decoding.engine import SpeculativeEngine

    original, runs = SpeculativeEngine.generate, []

    def stop_on_third_prompt(self, prompt_ids, budget=None):
        runs.append(1)
        if len(runs) == 2 * 2 + 1:  # warm-up (2 configs) + first prompt (2 configs), then Ctrl-C
            raise KeyboardInterrupt
        yield from original(self, prompt_ids, budget)

    monkeypatch.setattr(SpeculativeEngine, "generate", stop_on_third_prompt)
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                                 "fixed:lookup", "--out", str(out), "--csv", str(table)])
    assert result.exit_code == 130, result.stderr
    streamed = [json.loads(line) for line in (tmp_path / "r.samples.jsonl").read_text().splitlines()]
    assert sorted((s["id"], s["config"]) for s in streamed) == [("1", "fixed:lookup"), ("1", "plain")]
    assert len(json.loads(out.read_text())["samples"]) == 2 and table.read_text().startswith("task,config")
    assert "prompt 1/3 (1, repeat 1)" in result.stderr  # plain progress lines off a terminal


# -- usage errors and noisy numbers --------------------------------------------------


@pytest.mark.parametrize("limit", ["-1", "0"])
def test_bench_limit_must_be_positive(pool_file, data_file, limit, no_model_loads):
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--limit", limit])
    assert result.exit_code == 2 and f"--limit: must be at least 1 (got {limit})" in result.stderr


def test_replay_errors_name_the_replay_flag(tmp_path):
    result = runner.invoke(app, ["bench", "--replay", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: --replay {tmp_path / 'nope.jsonl'}: ")


def test_summarize_marks_noise_and_implausible_speedups():
    from specdraft.measurement.benchmark import Sample
    from specdraft.measurement.summary import noise_warnings, summarize
    from specdraft.ui.tables import bench_table
    from rich.console import Console
    import io

    samples = []
    for rep, (plain_s, fast_s) in enumerate([(1.0, 0.3), (1.0, 0.9)], start=1):
        samples.append(Sample("a", "t", "plain", rep, 10, 10, plain_s))
        samples.append(Sample("a", "t", "fixed:x", rep, 10, 10, fast_s))  # mean accepted 1.0
    rows = {r["config"]: r for r in summarize(samples) if r["task"] == "all"}
    assert rows["fixed:x"]["repeat_spread"] == 3.0 and rows["fixed:x"]["noisy"]
    assert rows["fixed:x"]["implausible"] and not rows["plain"]["implausible"] and not rows["plain"]["noisy"]
    warnings = noise_warnings(list(rows.values()))
    assert any(w.startswith("noisy timing: repeats of one prompt differ by up to 3.0x") for w in warnings)
    assert any(w.startswith("implausible speedup: fixed:x (all) 1.67x with mean accepted 1.00") for w in warnings)
    console = Console(file=io.StringIO(), width=250)
    console.print(bench_table(list(rows.values()), "t [x]"))
    assert "1.67x?" in console.file.getvalue() and "t [x]" in console.file.getvalue()


def test_policies_side_by_side_share_each_drafters_weights(pool_file, monkeypatch):
    """bench builds one runtime per policy: each model drafter is loaded once, not once per
    policy (a 0.5B drafter in float32 is 2 GB; four copies did not fit in this machine)."""
    from specdraft.measurement.benchmark import policy_configs
    from specdraft.models import loading
    from specdraft.runtime import build_runtime

    loads = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda spec, *a: loads.append(spec) or real(spec, *a))
    profile = load_profile(pool_file)
    base = build_runtime(profile)
    policy_configs(profile, ["fixed:small", "random", "ucb"], base, None)
    assert [spec.path.name for spec in loads] == ["drafter"]  # "small", once for four runtimes
    again = build_runtime(profile, base.target, models=base.models)
    small = [d for d in (base.drafters + again.drafters) if d.name == "small"]
    assert small[0].lm.model is small[1].lm.model and small[0].lm is not small[1].lm  # own caches


def test_bench_samples_at_a_temperature_without_comparing_outputs(pool_file, data_file, tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                                 "fixed:small", "--temperature", "1", "--seed", "3", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    assert "sampled at T = 1" in result.stdout and "differ from plain" not in result.stderr
    report = json.loads(out.read_text())
    assert all(r["mismatches"] is None for r in report["summary"])
    refused = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--temperature", "1",
                                  "--baseline", "transformers"])
    assert refused.exit_code == 2 and "greedy" in refused.stderr


def test_a_runtime_plans_with_the_targets_measured_width_costs(pool_file, tmp_path, monkeypatch):
    """The target's forward cost by width is measured once (kept in the cache folder) and
    installed in the round planner's cost model; the plain baseline and `verify_costs = "line"`
    measure nothing."""
    from specdraft.models import width_costs
    from specdraft.runtime import build_runtime

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    steady = lambda lm, n, **k: measured.append(n) or [[0.001 * (1 + w / 8)] * 3 for w in range(n)]  # noqa: E731
    monkeypatch.setattr(width_costs, "timed_widths", steady)  # (a tiny model's timings are mostly noise)
    monkeypatch.setattr(width_costs, "_quick_step", lambda lm: 0.001)
    profile = load_profile(pool_file)
    runtime = build_runtime(profile)
    curve = runtime.engine.driver.planner.costs.verify.shape
    assert measured == [profile.decode.draft_tokens + 1] and len(curve) == profile.decode.draft_tokens + 2
    again = build_runtime(profile, runtime.target, models=runtime.models)
    assert measured == [5] and again.engine.driver.planner.costs.verify.shape == curve  # read back from disk
    assert build_runtime(profile, runtime.target, plain=True).engine.driver.planner.costs.verify.shape is None
    line = profile.with_overrides(verify_costs="line")
    assert build_runtime(line, runtime.target, models=runtime.models).engine.driver.planner.costs.verify.shape is None


def test_transformers_baselines_on_stock_and_packed_kernels(pool_file, data_file, tmp_path):
    """`--baseline transformers,transformers-packed` times transformers' generation twice: on
    the stock kernels and over the packed target; both stay plain greedy decoding."""
    float32_pool = tmp_path / "pool32.toml"
    # (on the CPU also where CUDA is there: packing is the CPU's)
    float32_pool.write_text(pool_file.read_text().replace('dtype = "float64"', 'dtype = "float32"\ndevice = "cpu"'))
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--pool", str(float32_pool), "--data", str(data_file), "--policies",
                                 "fixed:lookup", "--baseline", "transformers,transformers-packed", "-n", "8",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    configs = {s["config"] for s in json.loads(out.read_text())["samples"]}
    assert {"transformers greedy", "transformers greedy [packed]", "transformers prompt-lookup [packed]",
            "transformers assisted:small [packed]"} <= configs
    assert "not packed" not in result.stderr  # a float32 target on a CPU is packed
    report = json.loads(out.read_text())
    assert all(not s["mismatch"] for s in report["samples"])


@pytest.mark.parametrize("flag, message", [("vllm", 'unknown "vllm"'),
                                           ("transformers,transformers", "twice")])
def test_a_bad_baseline_is_a_usage_error_before_anything_loads(pool_file, data_file, flag, message):
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--baseline", flag])
    assert result.exit_code == 2 and message in result.stderr


def test_a_summary_can_leave_out_the_first_prompts_and_compare_with_any_configuration():
    from specdraft.measurement.benchmark import Sample
    from specdraft.measurement.summary import add_versus, after_warmup, summarize

    samples = []
    for prompt, (plain_s, lookup_s, hedge_s) in enumerate([(1.0, 1.0, 4.0), (1.0, 0.5, 0.25)]):
        for config, seconds in (("plain", plain_s), ("fixed:lookup", lookup_s), ("hedge", hedge_s)):
            samples.append(Sample(str(prompt), "t", config, 1, 10, 10 if config == "plain" else 4, seconds))
    everything = {r["config"]: r for r in summarize(samples) if r["task"] == "all"}
    assert everything["hedge"]["speedup"] == pytest.approx(2.0 / 4.25)
    kept = after_warmup(samples, 1)
    assert {s.id for s in kept} == {"1"} and len(kept) == 3
    rows = summarize(kept)
    add_versus(rows, "fixed:lookup")
    overall = {r["config"]: r for r in rows if r["task"] == "all"}
    assert overall["hedge"]["speedup"] == pytest.approx(4.0)
    assert overall["hedge"]["versus"] == pytest.approx(2.0) and overall["fixed:lookup"]["versus"] == pytest.approx(1.0)
    assert overall["plain"]["versus"] == pytest.approx(0.5)


def test_replay_with_skip_and_versus_from_the_command_line(pool_file, data_file, tmp_path):
    trace = tmp_path / "t.jsonl"
    assert runner.invoke(app, ["trace", "--pool", str(pool_file), "--data", str(data_file), "--out", str(trace),
                               "-n", "8"]).exit_code == 0
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--replay", str(trace), "--policies", "ucb,fixed:lookup", "--skip", "1",
                                 "--versus", "fixed:lookup", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    flat = " ".join(result.stdout.replace("│", " ").split())  # the table wraps its title and headers at 100 columns
    assert "vs" in flat and "fixed:lookup" in flat and "leaves out the first 1" in flat
    report = json.loads(out.read_text())
    assert {r["prompts"] for r in report["summary"] if r["task"] == "all"} == {2}  # of 3 prompts
    assert len({s["id"] for s in report["samples"]}) == 3  # the samples keep every prompt
    lookup = [r for r in report["summary"] if r["config"] == "fixed:lookup"]
    assert lookup and all(r["versus"] == pytest.approx(1.0) for r in lookup)


@pytest.mark.parametrize("args, message", [
    (["--skip", "-1"], "--skip: must be 0 or more (got -1)"),
    (["--skip", "3"], "--skip 3 leaves none of the 3 prompts to summarize"),
    (["--versus", "fixed:nothing", "--policies", "ucb"], '--versus: no configuration "fixed:nothing" in this bench '
                                                        '(plain, ucb)'),
])
def test_skip_and_versus_are_checked_before_anything_runs(pool_file, data_file, tmp_path, args, message):
    trace = tmp_path / "t.jsonl"
    assert runner.invoke(app, ["trace", "--pool", str(pool_file), "--data", str(data_file), "--out", str(trace),
                               "-n", "4"]).exit_code == 0
    result = runner.invoke(app, ["bench", "--replay", str(trace), *args])
    assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_live_bench_refuses_an_unknown_versus_before_measuring(pool_file, data_file, monkeypatch):
    from specdraft.measurement import benchmark

    monkeypatch.setattr(benchmark, "run_bench", lambda *a, **k: pytest.fail("measured before checking --versus"))
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                                 "fixed:lookup", "--versus", "ucb", "-n", "4"])
    assert result.exit_code == 2 and '--versus: no configuration "ucb"' in result.stderr, result.stderr


def test_a_killed_bench_leaves_the_finished_prompts_in_out(pool_file, data_file, tmp_path, monkeypatch):
    """Not Ctrl-C (which reports): a kill. --out and --csv are rewritten whole after every
    prompt, so what was measured is there, readable, whatever stops the process."""
    from specdraft.decoding.engine import SpeculativeEngine

    original, runs = SpeculativeEngine.generate, []

    def die_on_third_prompt(self, prompt_ids, budget=None):
        runs.append(1)
        if len(runs) == 2 * 2 + 1:
            raise SystemExit(137)  # as good as SIGKILL here: no report runs after it
        yield from original(self, prompt_ids, budget)

    monkeypatch.setattr(SpeculativeEngine, "generate", die_on_third_prompt)
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies", "fixed:lookup",
                        "--out", str(out), "--csv", str(table)])
    written = json.loads(out.read_text())
    assert sorted((s["id"], s["config"]) for s in written["samples"]) == [("1", "fixed:lookup"), ("1", "plain")]
    assert {r["config"] for r in written["summary"]} == {"plain", "fixed:lookup"}


def test_the_table_fits_100_columns_and_the_csv_is_flat(pool_file, data_file, tmp_path):
    import csv

    table = tmp_path / "r.csv"
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                                 "normalhedge,fixed:lookup", "--versus", "fixed:lookup", "--csv", str(table)])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100 and not any("…" in line for line in lines), result.stdout
    assert "normalhedge" in result.stdout and "regret" not in result.stdout and "differ" in result.stdout
    rows = list(csv.DictReader(table.open()))
    cells = [value for row in rows for value in row.values()]
    assert not any(value.startswith(("{", "[")) for value in cells)  # no Python reprs in cells
    assert "time_share.verify" in rows[0] and any(key.startswith("acceptance_at.") for key in rows[0])
    wide = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data_file), "--policies",
                               "normalhedge", "--verbose"])
    assert "regret" in wide.stdout and "acceptance by position" in wide.stdout


def test_quick_runs_a_few_short_prompts_against_the_profiles_policy(pool_file, tmp_path):
    data = tmp_path / "many.txt"
    data.write_text("".join(f"prompt {i} hello hello\n" for i in range(20)))
    out = tmp_path / "q.json"
    result = runner.invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data), "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    samples = json.loads(out.read_text())["samples"]
    assert {s["config"] for s in samples} == {"plain", "random"}  # the profile's policy, not every drafter fixed
    assert len({s["id"] for s in samples}) == 4 and max(s["tokens"] for s in samples) <= 32
