"""tools/results_table.py: the README's results table from `specdraft bench --out` files.
The bench files here are built as bench builds them (samples summarized by bench's own
summary, written as `{"summary", "samples"}`), with times chosen so every ratio is known."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from specdraft.measurement.benchmark import Sample
from specdraft.measurement.summary import summarize

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_table", ROOT / "tools" / "results_table.py")
results_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_table)

TOKENS = 64
# config -> (seconds per prompt, rounds per prompt, a peer engine's run): plain decoding at
# 64 tokens/s; rounds keep every speedup below what its accepted tokens allow.
RUNS = {"transformers greedy": (4.0, 0, True), "plain": (1.0, 64, False), "normalhedge": (0.5, 32, False),
        "llama.cpp plain": (2.0, 0, True), "fixed:lookup": (0.8, 48, False)}
EXPECTED = [("specdraft plain", "64.0", "1.00x"), ("specdraft normalhedge", "128.0", "2.00x"),
            ("specdraft fixed:lookup", "80.0", "1.25x"), ("transformers greedy", "16.0", "0.25x"),
            ("llama.cpp plain", "32.0", "0.50x")]


def bench_file(path: Path, runs: dict = RUNS, **top) -> Path:
    """A bench --out file over two prompts of two tasks, configurations in `runs`' order."""
    samples = []
    for i, task in enumerate(("code", "math")):
        for config, (seconds, rounds, peer) in runs.items():
            samples.append(Sample(id=f"{task}-{i}", task=task, config=config, repeat=1, tokens=TOKENS,
                                  rounds=rounds, elapsed_s=seconds, peer=peer, identical=True if peer else None))
    data = {"summary": summarize(samples), "samples": [s.as_dict() for s in samples]} | top
    path.write_text(json.dumps(data, indent=1))
    return path


def table_rows(table: str) -> list[list[str]]:
    """The body rows of the Markdown table in `table`, as cells."""
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]


def test_rows_and_ratios(tmp_path, capsys):
    path = bench_file(tmp_path / "demo.json")
    assert results_table.main([str(path)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [tuple(r[1:4]) for r in rows] == EXPECTED
    assert {r[0] for r in rows} == {"demo"}
    assert out.splitlines()[2] == "| run | configuration | tokens/s | x specdraft plain |"  # no machine or commit known


def test_machine_and_commit(tmp_path):
    given = bench_file(tmp_path / "a.json")
    recorded = bench_file(tmp_path / "b.json", machine="2-core Xeon", commit="abc1234")
    text = results_table.block([str(given), str(recorded)], "EPYC", "def5678")
    assert "| run | configuration | tokens/s | x specdraft plain | machine | commit |" in text
    rows = table_rows(text)
    assert {tuple(r[4:]) for r in rows if r[0] == "a"} == {("EPYC", "def5678")}  # from the options
    assert {tuple(r[4:]) for r in rows if r[0] == "b"} == {("2-core Xeon", "abc1234")}  # the file's own win


def test_each_run_against_its_own_plain(tmp_path):
    slower = {config: (seconds * 2, rounds, peer) for config, (seconds, rounds, peer) in RUNS.items()}
    files = [bench_file(tmp_path / "fast.json"), bench_file(tmp_path / "slow.json", slower)]
    rows = table_rows(results_table.block([str(f) for f in files], None, None))
    assert [r[0] for r in rows] == ["fast"] * 5 + ["slow"] * 5
    assert [r[2] for r in rows if r[0] == "slow"] == ["32.0", "64.0", "40.0", "8.0", "16.0"]
    assert [r[3] for r in rows if r[0] == "slow"] == [e[2] for e in EXPECTED]


def test_untrusted_ratio_is_marked(tmp_path):
    runs = dict(RUNS, **{"fixed:lookup": (0.8, 64, False)})  # 1.25x at 1.0 accepted tokens a round
    text = results_table.block([str(bench_file(tmp_path / "x.json", runs))], None, None)
    assert ["specdraft fixed:lookup", "80.0", "1.25x ?"] in [r[1:4] for r in table_rows(text)]
    assert "not to be trusted" in text


def test_not_a_bench_file(tmp_path, capsys):
    other = tmp_path / "trace.json"
    other.write_text(json.dumps({"rows": []}))
    assert results_table.main([str(other)]) == 2
    assert "specdraft bench --out" in capsys.readouterr().err


def test_write_replaces_only_the_marked_block(tmp_path):
    bench = bench_file(tmp_path / "demo.json")
    readme = tmp_path / "README.md"
    before = "# Title\n\nText before.\n\n<!-- results:begin -->\n"
    after = "<!-- results:end -->\n\nText after, with | a pipe |.\n"
    readme.write_text(before + "(generated at release; see the commands above)\n" + after)
    assert results_table.main([str(bench), "--check", str(readme)]) == 1
    assert results_table.main([str(bench), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(before) and text.endswith(after)
    assert text[len(before):-len(after)] == results_table.block([str(bench)], None, None)
    assert results_table.main([str(bench), "--check", str(readme)]) == 0
    assert results_table.main([str(bench), "--write", str(readme)]) == 0
    assert readme.read_text() == text  # writing again changes nothing


def test_write_needs_one_pair_of_markers(tmp_path, capsys):
    bench = bench_file(tmp_path / "demo.json")
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    assert results_table.main([str(bench), "--write", str(readme)]) == 2
    assert readme.read_text() == "no markers here\n"
    assert "results:begin" in capsys.readouterr().err


def test_readme_block_is_the_tools_output(monkeypatch):
    """README's table is what the JSON files in docs/results/ give, regenerated by the
    command recorded in the block (skipped until the files exist)."""
    readme = (ROOT / "README.md").read_text()
    block = results_table.current_block(readme, "README.md")  # exactly one pair of markers
    found = sorted((ROOT / "docs" / "results").glob("*.json"))
    if not found:
        pytest.skip("no docs/results/*.json yet: the maintainer generates the table at release")
    first = block.splitlines()[0] if block else ""
    assert first.startswith("<!-- generated by: ") and first.endswith(" -->"), \
        "README's results block was not written by tools/results_table.py --write README.md"
    argv = shlex.split(first[len("<!-- generated by: "):-len(" -->")])[2:]  # after "python tools/results_table.py"
    files = [a for a in argv if a.endswith(".json")]
    assert sorted((ROOT / f).resolve() for f in files) == [f.resolve() for f in found], \
        "README's table is not built from every docs/results/*.json file"
    write = argv.index("--write")
    argv[write:write + 2] = []
    options = [a for a in argv if a not in files]
    monkeypatch.chdir(ROOT)  # the files as the recorded command names them, from the repo root
    assert block == results_table.block(files, *_machine_commit(options)), \
        "README's results table differs from the JSON files: python tools/results_table.py docs/results/*.json " \
        "--write README.md"


def _machine_commit(options: list[str]) -> tuple[str | None, str | None]:
    values = dict(zip(options[::2], options[1::2]))
    return values.get("--machine"), values.get("--commit")
