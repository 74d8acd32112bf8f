"""The suffix drafter: its index finds exactly the longest earlier occurrences, its drafts
follow the most frequent continuation with a length that adapts to the evidence, it drafts
from earlier prompts of the run and from stores on disk, and output stays plain greedy."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, SuffixDrafter
from specdraft.drafters.datastore import StoreError, open_store, write_store
from specdraft.drafters.learned_store import LearnedStore
from specdraft.drafters.options import SuffixOptions
from specdraft.drafters import suffix_index
from specdraft.drafters.suffix_index import (MAX_OCCURRENCES, ContextIndex, Occurrences, SuffixIndex, concatenate,
                                             continue_occurrences)
from specdraft.learning.policies import build_policy
from specdraft.models.cached_lm import CachedLM
from tiny import VOCAB, plain_greedy, tiny_llama

CTX = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)


def brute_force(text: list[int], pattern: list[int], depth: int, self_overlap: bool) -> tuple[int, set[int]]:
    """Longest suffix of `pattern` found in `text` (up to depth) and the positions after it."""
    best, after = 0, set()
    limit = min(depth, len(pattern) - (1 if self_overlap else 0))
    for m in range(1, limit + 1):
        end = len(text) - (1 if self_overlap else 0)  # in the context itself: an occurrence needs a successor
        found = {i + m for i in range(0, end - m + 1) if text[i:i + m] == pattern[-m:]}
        if not found:
            break
        best, after = m, found
    return best, after


@pytest.mark.parametrize("seed", range(4))
def test_index_finds_exactly_the_longest_match_and_every_occurrence(seed):
    rng = random.Random(seed)
    for _ in range(60):
        docs = [[rng.randrange(3) for _ in range(rng.randrange(0, 25))] for _ in range(rng.randrange(1, 4))]
        depth = rng.choice([1, 2, 3, 5, 8, 16])
        index = SuffixIndex.from_documents(docs, depth)
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        found = index.longest_match(context, 32)
        length, after = brute_force(index.text.tolist(), context, depth, self_overlap=False)
        assert found.length == length
        assert set(found.after) == after
        scan = ContextIndex()
        scan.sync(context)
        found = scan.longest_match(len(context), 32)
        length, after = brute_force(context, context, 32, self_overlap=True)
        assert (found.length, set(found.after)) == (length, after)


def repeated_text(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens with chunks of themselves copied in: long matches among many candidates."""
    text = [rng.randrange(vocab) for _ in range(length // 4)]
    while len(text) < length:
        start = rng.randrange(len(text))
        text += text[start:start + rng.randrange(1, 80)]
    return text[:length]


@pytest.mark.parametrize("seed", range(3))
def test_long_texts_match_as_brute_force_does_however_often_asked(seed):
    # Past the tiny cases above: ranges wide enough for every narrowing path (binary search,
    # whole-range reads, the last few candidates read as one block), matches up to the depth,
    # more occurrences than a source keeps, and each query asked twice (remembered ranges).
    rng = random.Random(seed)
    text = repeated_text(rng, 3000, rng.choice([2, 4, 30]))
    index = SuffixIndex.from_documents([text[:1700], text[1700:]], 32)
    scan = ContextIndex()
    scan.sync(text)
    for _ in range(40):
        end = rng.randrange(2, len(text) + 1)
        window = text[max(0, end - 32):end]
        length, after = brute_force(index.text.tolist(), window, 32, self_overlap=False)
        for _ in range(2):
            found = index.longest_match(window, 32)
            assert found.length == length
            if len(after) <= MAX_OCCURRENCES:
                assert set(found.after) == after
            else:  # spread evenly over the range: a subset of the right size
                assert len(found.after) == MAX_OCCURRENCES and set(found.after) <= after
        for cap in (2, 3, 32):  # (capped short: every occurrence of the last two or three tokens)
            length, after = brute_force(text[:end], text[:end], cap, self_overlap=True)
            for _ in range(2):
                found = scan.longest_match(end, cap)
                assert found.length == length
                assert found.after == sorted(after)[-MAX_OCCURRENCES:]  # the latest occurrences


def test_an_index_remembers_a_bounded_number_of_ranges_and_answers_the_same(monkeypatch):
    monkeypatch.setattr(suffix_index, "MEMO_RANGES", 5)
    monkeypatch.setattr(suffix_index, "MEMO_SPREADS", 3)
    rng = random.Random(7)
    text = repeated_text(rng, 3000, 30)
    index = SuffixIndex.from_documents([text], 32)
    for end in range(40, 3000, 41):
        window = text[end - 32:end]
        length, after = brute_force(index.text.tolist(), window, 32, self_overlap=False)
        found = index.longest_match(window, 32)
        assert found.length == length and set(found.after) <= after
        assert len(index._ranges) <= 5 and len(index._spread) <= 3


def test_a_continuation_reads_a_list_and_an_array_alike():
    rng = random.Random(5)
    text = repeated_text(rng, 2000, 6)
    scan = ContextIndex()
    scan.sync(text)
    for end in range(50, 2000, 97):
        found = scan.longest_match(end, 32)
        as_array = Occurrences(found.length, np.asarray(text, dtype=np.int32), found.after, end)
        for rank in (1, 2):
            a = continue_occurrences([found], 10, 0.05, rank)
            b = continue_occurrences([as_array], 10, 0.05, rank)
            assert (a.tokens, a.chances, a.score) == (b.tokens, b.chances, b.score)


def test_documents_never_match_across_their_boundary():
    index = SuffixIndex.from_documents([[1, 2], [3, 4]], 8)
    assert index.longest_match([2, 3], 8).length == 1  # "2 3" spans the boundary: only "3" matches


def test_continuation_follows_the_most_frequent_and_stops_when_unlikely():
    # after "7 8": 9 10 three times, 9 11 once, 5 once
    index = SuffixIndex.from_documents([[7, 8, 9, 10]] * 3 + [[7, 8, 9, 11], [7, 8, 5]], 8)
    found = index.longest_match([1, 7, 8], 8)
    assert found.length == 2
    draft = continue_occurrences([found], 5, 0.1)
    assert draft.tokens == [9, 10]
    assert draft.chances == pytest.approx([4 / 5, 4 / 5 * 3 / 4])
    assert draft.score == pytest.approx(4 / 6 + 4 / 6 * 3 / 5)
    assert continue_occurrences([found], 5, 0.7).tokens == [9]  # 0.6 < 0.7: the second token is not drafted


def test_a_lower_rank_starts_from_the_next_most_frequent_token_then_follows_the_most_frequent():
    # after "7 8": 9 10 three times, 9 11 once, 5 6 once
    index = SuffixIndex.from_documents([[7, 8, 9, 10]] * 3 + [[7, 8, 9, 11], [7, 8, 5, 6]], 8)
    found = index.longest_match([1, 7, 8], 8)
    assert continue_occurrences([found], 5, 0.0, first_rank=1).tokens == [9, 10]
    second = continue_occurrences([found], 5, 0.0, first_rank=2)
    assert second.tokens == [5, 6] and second.chances == pytest.approx([1 / 5, 1 / 5])
    assert continue_occurrences([found], 5, 0.0, first_rank=3).tokens == []  # only two tokens ever followed
    assert continue_occurrences([found], 5, 0.3, first_rank=2).tokens == []  # 1/5 is below min_prob
    context = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 5, 6, 7, 8]
    assert drafter(min_prob=0.0).propose(context, 3).tokens.tolist() == [9, 10, 7]
    assert drafter(min_prob=0.0, rank=2).propose(context, 3).tokens.tolist() == [5, 6, 7]


def test_the_source_more_occurrences_agree_on_wins_over_a_longer_lone_match():
    d = drafter(min_prob=0.0)
    for _ in range(4):  # the run's history: "5 6" went on with 7 8 four times
        d.end_prompt([5, 6, 7, 8])
    d.reset()
    # this prompt: "4 5 6" once went on with 9 9 (a longer match, seen once)
    assert d.propose([4, 5, 6, 9, 9, 1, 4, 5, 6], 2).tokens.tolist() == [7, 8]
    d.reset()
    # as many times as the history's: equal support, and the longer match decides
    context = [token for lead in (11, 12, 13, 14) for token in (lead, 4, 5, 6, 9, 9)] + [15, 4, 5, 6]
    assert d.propose(context, 2).tokens.tolist() == [9, 9]


def drafter(**options) -> SuffixDrafter:
    return SuffixDrafter("sfx", CTX, SuffixOptions(**options))


def test_draft_length_grows_with_the_match():
    d = drafter(spec_factor=1.0, min_prob=0.0)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 3, 4]
    assert d.propose(context, 8).tokens.tolist() == [5, 6]  # a 2-token match drafts 2 with spec_factor 1
    d.reset()
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2, 3, 4]
    assert d.propose(context, 8).tokens.tolist() == [5, 6, 7, 8]
    assert d.propose(context, 3).tokens.tolist() == [5, 6, 7]  # never beyond the plan's K


def test_earlier_prompts_of_the_run_are_drafted_from_and_a_new_prompt_forgets_its_own_text():
    d = drafter()
    assert d.propose([10, 11, 12], 4).tokens.tolist() == []
    d.end_prompt([10, 11, 12, 13, 14, 15])
    d.reset()
    assert d.propose([9, 10, 11, 12], 4).tokens.tolist() == [13, 14, 15]
    off = drafter(history=False)
    off.end_prompt([10, 11, 12, 13, 14, 15])
    off.reset()
    assert off.propose([9, 10, 11, 12], 4).tokens.tolist() == []


def test_history_stays_whole_while_its_two_levels_fold():
    d = drafter(prompt=False, min_prob=0.0)
    rng = random.Random(1)
    documents = [[rng.randrange(40, 60) for _ in range(rng.randrange(5, 30))] for _ in range(40)]
    for document in documents:
        d.end_prompt(document)
    assert sum(i.tokens for i in d.history.indexes) == sum(len(x) for x in documents)
    for document in documents:
        proposal = d.propose(document[:4], 1).tokens.tolist()
        assert proposal and proposal[0] in {x[i + 4] for x in documents for i in range(len(x) - 4)
                                            if x[i:i + 4] == document[:4]}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_equals_plain_decoding_over_a_run_of_prompts(target, k):
    d = drafter()
    policy = build_policy("fixed", {"drafter": "sfx", "draft_length": "fixed"}, ["sfx"], seed=0, draft_tokens=k,
                          horizon=30)  # K from the drafter alone, not from timings
    engine = SpeculativeEngine(CachedLM(target), [d], policy, EngineSettings(k, 30, SamplingParams()))
    prompts = [[5, 9, 11, 3, 7, 5, 9], [5, 9, 11, 3], [17], [5, 9, 11, 3, 7, 5, 9]]
    drafted = 0
    for prompt in prompts:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 30)
        drafted += sum(r.drafted for r in records)
    assert drafted > 0
    # the last prompt repeats the first: its whole answer comes from the run's history
    assert records[0].accepted == min(k, records[0].drafted) and records[0].accepted > 0


def test_sampled_drafts_are_deterministic_proposals():
    d = SuffixDrafter("sfx", DraftContext(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0),
                                          torch.device("cpu"), VOCAB), SuffixOptions())
    draft = d.propose([1, 2, 3, 1, 2], 3)
    assert draft.probs is None and draft.tokens.tolist() == [3, 1, 2]


def test_full_information_scores_a_position_by_its_fresh_proposal():
    d = drafter()
    context = [1, 2, 3, 1, 2, 3]
    probs = torch.full((3, VOCAB), 0.01)
    probs[:, 3] = 0.5
    scores = d.score(context, 3, 3, probs)  # at 3 "3" is new: nothing; at 4 "1" -> 2; at 5 "1 2" -> 3
    assert scores.tolist() == pytest.approx([0.0, 0.01, 0.5])
    assert not drafter().awake_at([1, 2, 3], 3) and drafter().awake_at(context, 5)


def test_a_store_loads_memory_mapped_and_refuses_another_tokenizer(tmp_path):
    write_store(tmp_path / "s", concatenate([[1, 2, 3, 4], [1, 2, 5]]), 8, "abc")
    store = open_store(tmp_path / "s", "abc")
    assert isinstance(store.order, np.memmap)
    assert store.longest_match([9, 1, 2], 8).length == 2
    with pytest.raises(StoreError, match="another tokenizer"):
        open_store(tmp_path / "s", "xyz")
    with pytest.raises(StoreError, match="not a datastore"):
        open_store(tmp_path / "nothing", "abc")
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    (tmp_path / "s" / "meta.json").write_text(json.dumps({**meta, "tokens": 99}))
    with pytest.raises(StoreError, match="damaged"):
        open_store(tmp_path / "s", "abc")


def test_the_learned_store_grows_across_runs_compacts_and_evicts_the_oldest(tmp_path, monkeypatch):
    import specdraft.drafters.learned_store as learned_store

    monkeypatch.setattr(learned_store, "COMPACT_MIN_TOKENS", 50)
    store = LearnedStore(tmp_path / "learned", "abc", depth=8, max_tokens=1000)
    assert store.open() == (None, [])
    for i in range(6):  # six runs of 10 tokens each: not enough to compact
        store.append(list(range(100 * i, 100 * i + 10)))
    base, pending = store.open()  # 60 >= 50: folded into an indexed base
    assert base is not None and base.tokens == 60 and pending == []
    store.append([7, 7, 7])
    base, pending = store.open()
    assert base.tokens == 60 and [p.tolist() for p in pending] == [[7, 7, 7]]
    small = LearnedStore(tmp_path / "learned", "abc", depth=8, max_tokens=25)
    for i in range(5):
        small.append([900 + i] * 10)
    base, _ = small.open()
    assert base.tokens == 20  # only the newest 2 documents of 10 fit in 25 tokens
    assert base.text[1:11].tolist() == [903] * 10


POOL = """
[target]
path = "{root}/target"
dtype = "float64"

[decode]
draft_tokens = 4
max_new_tokens = 12

[policy]
name = "fixed"
drafter = "suffix"

[[drafters]]
name = "suffix"
kind = "suffix"
{extra}
"""


def test_datastore_build_and_generate_from_it(tiny_models, tmp_path):
    from specdraft.cli import app

    pool = tmp_path / "pool.toml"
    pool.write_text(POOL.format(root=tiny_models, extra=""))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "x", "completion": "y = 1"}\nnot json\n"just text"\n')
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    runner = CliRunner()
    built = runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(tmp_path / "src"),
                                str(tmp_path / "rows.jsonl"), str(tmp_path / "bin.txt"), "--out", str(tmp_path / "store")])
    assert built.exit_code == 0, built.stderr
    assert built.stdout == ""
    assert "rows.jsonl:2: skipped: not JSON" in built.stderr and "bin.txt: skipped: not UTF-8" in built.stderr
    assert json.loads((tmp_path / "store" / "meta.json").read_text())["documents"] == 3
    with_store = tmp_path / "with-store.toml"
    with_store.write_text(POOL.format(root=tiny_models, extra=f'store = "{tmp_path / "store"}"'))
    done = runner.invoke(app, ["generate", "--pool", str(with_store), "--raw", "def add(a"])
    plain = runner.invoke(app, ["generate", "--pool", str(pool), "--raw", "--policy", "fixed:suffix", "def add(a"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout == plain.stdout


def test_datastore_mistakes_are_usage_or_profile_errors(tiny_models, tmp_path):
    from specdraft.cli import app

    pool = tmp_path / "pool.toml"
    pool.write_text(POOL.format(root=tiny_models, extra=""))
    runner = CliRunner()
    missing = runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(tmp_path / "nope"),
                                  "--out", str(tmp_path / "s")])
    assert missing.exit_code == 2 and "nope: no such file or folder" in missing.stderr
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "precious.txt").write_text("mine")
    (tmp_path / "in.txt").write_text("hello")
    refused = runner.invoke(app, ["datastore", "build", "--pool", str(pool), str(tmp_path / "in.txt"),
                                  "--out", str(tmp_path / "keep")])
    assert refused.exit_code == 2 and "is not a datastore; refusing" in refused.stderr
    assert (tmp_path / "keep" / "precious.txt").exists()
    write_store(tmp_path / "other", concatenate([[1, 2]]), 4, "another-tokenizer")
    bad = tmp_path / "bad.toml"
    bad.write_text(POOL.format(root=tiny_models, extra=f'store = "{tmp_path / "other"}"'))
    refused = runner.invoke(app, ["generate", "--pool", str(bad), "hi"])
    assert refused.exit_code == 2 and "drafters[0].store" in refused.stderr and "another tokenizer" in refused.stderr
    off = tmp_path / "off.toml"
    off.write_text(POOL.format(root=tiny_models, extra="prompt = false\nhistory = false"))
    refused = runner.invoke(app, ["generate", "--pool", str(off), "hi"])
    assert refused.exit_code == 2 and "every source is off" in refused.stderr


def test_learn_records_each_prompt_under_the_cache_folder(tiny_models, tmp_path, monkeypatch):
    from specdraft.cli import app

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    pool = tmp_path / "pool.toml"
    pool.write_text(POOL.format(root=tiny_models, extra="learn = true"))
    result = CliRunner().invoke(app, ["generate", "--pool", str(pool), "--each-line", "--raw"], input="ab\ncd\n")
    assert result.exit_code == 0, result.stderr
    segments = list((tmp_path / "cache" / "suffix").glob("*/segments/*.npy"))
    assert len(segments) == 2


def test_a_bench_pass_never_drafts_from_the_warm_up_or_an_earlier_repeat(tiny_models, tmp_path):
    """Prompt i of a measured pass may draft only from prompts before it in that pass: the
    warm-up runs prompt 0 first, so without forgetting, prompt 0 would be copied whole."""
    from specdraft.profile import load_profile
    from specdraft.measurement.benchmark import plain_config, policy_configs, run_bench
    from specdraft.measurement.datasets import Example
    from specdraft.runtime import build_runtime

    pool = tmp_path / "pool.toml"
    text = POOL.format(root=tiny_models, extra="").replace("max_new_tokens = 12", "max_new_tokens = 24")
    pool.write_text(text.replace('drafter = "suffix"', 'drafter = "suffix"\ndraft_length = "fixed"'))
    profile = load_profile(pool)
    runtime = build_runtime(profile)
    configs = [plain_config(profile, runtime, False)] + policy_configs(profile, ["fixed:suffix"], runtime, False)
    examples = [Example("a", "ab"), Example("b", "ab")]
    samples = [s for s in run_bench(configs, examples, repeat=2) if s.config == "fixed:suffix"]
    fresh = build_runtime(profile, runtime.target)  # what a first prompt drafts with nothing before it
    from specdraft.session.prompt_run import PromptRun

    first = PromptRun(fresh, "ab", False).run()
    for rep in (1, 2):
        a, b = [s for s in samples if s.repeat == rep]
        assert a.rounds == first.stats.rounds  # as if nothing came before
        assert b.rounds < a.rounds  # the repeat of prompt a within the pass is drafted from it


def test_trajectory_scores_of_consecutive_prompts_never_mix_their_text():
    d = drafter(history=False)
    probs = torch.full((4, VOCAB), 1 / VOCAB)
    d.trajectory_scores([1] * 8, 4, probs, 3)  # its text repeats everywhere
    scores = d.trajectory_scores([7, 8, 9, 10, 11, 12, 13, 7], 4, probs, 3)
    # the second prompt's only repeat is its own "7" at the end: nothing before position 7 matches
    assert scores.drafted[:3] == [0, 0, 0]
