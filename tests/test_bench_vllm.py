"""`bench --engine vllm` without vLLM: its flag checks (before anything loads) and how it
pools interleaved runs of one configuration. The runs themselves need vLLM
(tests/test_vllm.py runs the engine)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.errors import SpecdraftError
from specdraft.measurement.vllm_bench import PLAIN, SPECDRAFT, cpu_kv_cache_bytes, memory_fraction, pool_repeats, summarize, table_rows
from specdraft.ui.tables import vllm_table

runner = CliRunner()


def run(concurrency, config, tokens, latency, seconds, built_in=False):
    return {"concurrency": concurrency, "config": config, "built_in": built_in, "tokens": tokens,
            "latency": latency, "seconds": seconds, "tasks": ["code"] * len(tokens), "wall_with_start": seconds + 1}


def test_interleaved_runs_pool_into_one_row_per_configuration_compared_run_by_run():
    same, other = [[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]
    runs = [run(8, PLAIN, same, [1.0, 2.0], 2.0), run(8, "vllm ngram k=3", same, [1.0, 1.0], 1.0, True),
            run(8, SPECDRAFT, same, [0.5, 0.5], 1.0),
            run(8, PLAIN, same, [3.0, 4.0], 3.0), run(8, "vllm ngram k=3", same, [2.0, 2.0], 4.0, True),
            run(8, SPECDRAFT, other, [0.5, 1.5], 1.5)]  # its second run differs in one output
    rows = {r["config"]: r for r in summarize(pool_repeats(runs))}
    assert list(rows) == [PLAIN, "vllm ngram k=3", SPECDRAFT]  # first-run order
    mine = rows[SPECDRAFT]
    assert mine["output_tokens"] == 10 and mine["seconds"] == 2.5 and mine["tokens_per_s"] == 4.0
    assert mine["per_run"] == [5.0, 5.0 / 1.5] and mine["latency"] == [0.5, 0.5, 0.5, 1.5]
    assert mine["differing"] == 1 and rows["vllm ngram k=3"]["differing"] == 0  # run by run against plain's
    assert mine["vs_plain"] == pytest.approx(4.0 / 2.0) and mine["vs_best_built_in"] == pytest.approx(4.0 / 2.0)
    assert mine["wall_with_start"] == 4.5
    console = Console(record=True, width=240, file=io.StringIO())
    console.print(vllm_table(table_rows(list(rows.values())), "t"))
    shown = console.export_text()
    assert "tokens/s per run" in shown and "5.0 / 3.3" in shown
    single = summarize(pool_repeats(runs[:3]))
    console = Console(record=True, width=240, file=io.StringIO())
    console.print(vllm_table(table_rows(single), "t"))
    assert "per run" not in console.export_text()  # one run: no spread to show


@pytest.mark.parametrize("flags, message", [(["--skip", "1"], "--skip is not available with --engine vllm"),
                                            (["--repeat", "0"], "--repeat: must be at least 1"),
                                            (["--concurrency", "8,x"], "--concurrency 8,x: expected whole numbers"),
                                            (["--baseline", "transformers"], "--baseline is not available")])
def test_bench_engine_vllm_refuses_what_it_cannot_do_before_anything_starts(pool_file, tmp_path, flags, message):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n')
    result = runner.invoke(app, ["bench", "--engine", "vllm", "--pool", str(pool_file), "--data", str(data), *flags])
    assert result.exit_code == 2 and message in result.output


def test_vllm_on_a_cpu_gets_an_explicit_kv_cache_size(monkeypatch):
    """A fraction of the NUMA node less what the worker holds can leave vLLM no KV cache on a
    node of a few GiB: the bench asks for a size, 1 GiB unless SPECDRAFT_VLLM_KV_GIB says."""
    monkeypatch.delenv("SPECDRAFT_VLLM_KV_GIB", raising=False)
    assert cpu_kv_cache_bytes() == 2**30
    monkeypatch.setenv("SPECDRAFT_VLLM_KV_GIB", "0.25")
    assert cpu_kv_cache_bytes() == 2**28
    monkeypatch.setenv("SPECDRAFT_VLLM_KV_GIB", "0")
    assert cpu_kv_cache_bytes() is None  # vLLM's own fraction
    for garbage in ("lots", "-1", "nan"):
        monkeypatch.setenv("SPECDRAFT_VLLM_KV_GIB", garbage)
        with pytest.raises(SpecdraftError, match="SPECDRAFT_VLLM_KV_GIB"):
            cpu_kv_cache_bytes()


def test_vllms_memory_fraction_is_checked(monkeypatch):
    monkeypatch.setattr("specdraft.serving.launch.cuda_available", lambda: False)
    monkeypatch.delenv("SPECDRAFT_VLLM_MEMORY", raising=False)
    assert memory_fraction() == 0.15
    monkeypatch.setenv("SPECDRAFT_VLLM_MEMORY", "0.5")
    assert memory_fraction() == 0.5
    for garbage in ("half", "0", "1.5", "nan"):
        monkeypatch.setenv("SPECDRAFT_VLLM_MEMORY", garbage)
        with pytest.raises(SpecdraftError, match="SPECDRAFT_VLLM_MEMORY"):
            memory_fraction()
