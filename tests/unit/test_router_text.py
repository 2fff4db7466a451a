"""Router-side text handling: tokenization equal to Hugging Face's, incremental detokenization
that never splits a character, and stop strings that never leak a partial match."""

from __future__ import annotations

import pytest

from router.stop_strings import StopStringMatcher
from router.tokenizer import IncrementalDetokenizer, RouterTokenizer

TEXTS = ["def f(x):\n    return x * 2", "héllo wörld, 你好世界 🚀🚀 done", "  leading spaces\tand\ttabs  "]


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return RouterTokenizer(tiny_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hugging_face(tok, tiny_dir, text):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.decode(tok.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_one_token_at_a_time_reassembles_the_text(tok, text):
    ids = tok.encode(text)[1:]  # without BOS, as generated tokens come
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([t]) for t in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_split_character_is_held_until_complete(tok):
    ids = tok.encode("🚀")[1:]
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in ids] == [""] * (len(ids) - 1) + ["🚀"]


def test_invalid_bytes_at_the_end_are_flushed_not_lost(tok):
    ids = tok.encode("🚀")[1:]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == "\ufffd"


def stream(stop: list[str], chunks: list[str]) -> tuple[list[str], str, bool]:
    matcher = StopStringMatcher(stop)
    released = [matcher.push(c) for c in chunks]
    return released, matcher.flush(), matcher.stopped


@pytest.mark.parametrize(
    ("stop", "chunks", "released", "tail", "stopped"),
    [
        (["o w"], ["Hel", "lo wo", "rld"], ["Hel", "l", ""], "", True),
        (["END"], ["abcE", "N", "Dxyz"], ["abc", "", ""], "", True),
        (["END"], ["abcE", "Nx"], ["abc", "ENx"], "", False),
        (["END"], ["abE"], ["ab"], "E", False),
        (["\n\n", "###"], ["a\n", "#", "##b"], ["a", "\n", ""], "", True),
        ([], ["any", "thing"], ["any", "thing"], "", False),
        (["x"], ["xyz"], [""], "", True),
    ],
)
def test_stop_strings(stop, chunks, released, tail, stopped):
    assert stream(stop, chunks) == (released, tail, stopped)


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
