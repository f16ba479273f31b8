"""Incremental detokenization: no broken UTF-8, sentencepiece spaces kept, pieces join
to the decode of the whole output."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from genlib.decoding.detok import IncrementalDecoder, token_bytes
from genlib.sampling.stopping import StopStrings
from tests.conftest import CODE_TARGET, STORIES

TEXT = "Tom said: \"héllo wörld\" 🙂 — naïve café, 3 + 4 = 7.\n    return x"


@pytest.mark.parametrize("folder", [STORIES, CODE_TARGET], ids=["sentencepiece", "byte-bpe"])
def test_pieces_are_valid_and_join_to_whole_decode(folder):
    if not folder.is_dir():
        pytest.skip(f"{folder} not present")
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt = tok("Once upon a time")["input_ids"]
    output = tok(TEXT, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(tok, prompt)
    pieces = [decoder.push(t) for t in output] + [decoder.flush()]
    assert not any("\ufffd" in p for p in pieces)
    whole = tok.decode(prompt + output, skip_special_tokens=True)
    assert tok.decode(prompt, skip_special_tokens=True) + "".join(pieces) == whole
    assert len(output) > len([p for p in pieces if p])  # some characters span tokens


@pytest.mark.parametrize("folder", [STORIES, CODE_TARGET], ids=["sentencepiece", "byte-bpe"])
def test_prompt_ending_in_byte_tokens_keeps_generated_characters(folder):
    """stories260K spells "日本" as six byte-fallback tokens: a window that started in
    the middle of them turned the generated "語です", bytes too, into U+FFFD."""
    if not folder.is_dir():
        pytest.skip(f"{folder} not present")
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt = tok("日本")["input_ids"]
    whole = tok("日本語です")["input_ids"]
    assert whole[:len(prompt)] == prompt
    output = whole[len(prompt):]
    decoder = IncrementalDecoder(tok, prompt)
    pieces = [decoder.push(t) for t in output] + [decoder.flush()]
    assert "".join(pieces) == "語です"
    assert tok.decode(output, skip_special_tokens=True) == "語です"


@pytest.mark.parametrize("folder", [STORIES, CODE_TARGET], ids=["sentencepiece", "byte-bpe"])
def test_token_bytes_join_to_the_text_s_utf8(folder):
    """OpenAI's and vLLM's `bytes`: joined over the tokens, the text's UTF-8. A token
    that is part of a character (stories260K's `<0xC3>`) had U+FFFD's three bytes."""

    from genlib.decoding.detok import token_text

    if not folder.is_dir():
        pytest.skip(f"{folder} not present")
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok(" " + TEXT + " 日本語", add_special_tokens=False)["input_ids"]
    texts = [token_text(tok, i) for i in ids]
    assert any("\ufffd" in t for t in texts)  # some tokens are parts of characters
    joined = b"".join(bytes(token_bytes(tok, i, t)) for i, t in zip(ids, texts))
    assert joined.decode("utf-8").strip() == (TEXT + " 日本語").strip()


def test_stop_strings_hold_back_possible_prefix():
    stops = StopStrings(["\n\n", "END"])
    assert stops.feed("abc\n") == "abc"  # "\n" may start "\n\n": held back
    assert stops.feed("x E") == "\nx "  # "E" may start "END"
    assert stops.feed("N") == ""
    assert stops.feed("D and more") == ""
    assert stops.stopped and stops.final_text == "abc\nx "


def test_stop_strings_release_held_text_at_the_end():
    stops = StopStrings(["END"])
    assert stops.feed("the E") == "the "
    assert stops.finish() == "E"
    assert not stops.stopped and stops.final_text == "the E"
