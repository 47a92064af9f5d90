"""Streaming text with stop strings: held-back tails, cuts, multi-byte characters."""
from __future__ import annotations

from protocol.tokenizer import ByteTokenizer
from worker.detokenizer import IncrementalDetokenizer


def feed(text_or_ids, stop=()):
    tok = ByteTokenizer()
    ids = list(text_or_ids.encode()) if isinstance(text_or_ids, str) else text_or_ids
    d = IncrementalDetokenizer(tok, None, stop)
    out = []
    for i in ids:
        out.append(d.add(i))
        if d.stopped_on:
            break
    out.append(d.flush())
    return out, d


def test_no_stop_streams_every_character_and_waits_for_whole_utf8():
    out, d = feed("hé!")
    # 'é' is two bytes: nothing is released after the first one
    assert out == ["h", "", "é", "!", ""] and d.text == "hé!"


def test_stop_string_is_cut_and_never_leaks_partially():
    out, d = feed("xxabyy", stop=("aby",))
    assert d.stopped_on == "aby"
    # two characters (len("aby") - 1) are held back while they could still start the stop string
    assert out == ["", "", "x", "x", "", ""]


def test_held_back_text_is_released_when_the_stop_does_not_match():
    out, d = feed("abcabd", stop=("abd!", "zz"))
    assert d.stopped_on is None and "".join(out) == "abcabd"


def test_earliest_of_several_stop_strings_wins():
    out, d = feed("hello world", stop=("world", "lo"))
    assert d.stopped_on == "lo" and "".join(out) == "hel"
