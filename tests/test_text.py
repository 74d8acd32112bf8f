"""Streaming text: incremental detokenization equals a one-shot decode; stop strings cut
exactly and are never half-printed."""

from __future__ import annotations

import random

from specdraft.session.text import Detokenizer, StopStringFilter
from tiny import byte_tokenizer


def test_incremental_text_equals_one_shot_decode_even_across_split_utf8():
    tok = byte_tokenizer()
    ids = tok("héllo → wörld 日本語 ok", add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    for _ in range(20):
        detok, pieces, i = Detokenizer(tok), [], 0
        while i < len(ids):
            step = rng.randint(1, 4)
            piece = detok.add(ids[i : i + step])
            assert "\ufffd" not in piece
            pieces.append(piece)
            i += step
        pieces.append(detok.flush())
        assert "".join(pieces) == tok.decode(ids)


def test_stop_string_cuts_and_holds_back_possible_prefixes():
    stops = StopStringFilter(["END", "\n\n"])
    out = [stops.push(t) for t in ["abc E", "N", "Xd", "ef EN", "D tail"]]
    assert "".join(out) == "abc ENXdef "
    assert stops.stopped and stops.push("more") == "" and stops.flush() == ""
    assert out[0] == "abc"  # " E" might start "END": held back, never printed then retracted


def test_no_stop_strings_passes_text_through():
    stops = StopStringFilter([])
    assert stops.push("abc") == "abc" and stops.flush() == ""
