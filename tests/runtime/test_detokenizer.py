from __future__ import annotations

import random

import pytest

from tandem.runtime.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! The quick brown fox.",
    "日本語のテキスト and emoji 🎉🚀👍🏽 mixed in.",
    "def f(x):\n    return x * 2\n",
    "naïve café — “quotes” … ½",
]


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> str:
    out = ""
    for i in range(0, len(ids), chunk):
        out += detok.add_tokens(ids[i : i + chunk])
        if detok.stop_matched is not None:
            break
    return out + detok.flush()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_text_equals_full_decode(byte_bpe, text, chunk):
    prompt = byte_bpe.encode("Prompt: ")
    ids = byte_bpe.encode(text)
    detok = IncrementalDetokenizer(byte_bpe, prompt)
    assert stream(detok, ids, chunk) == byte_bpe.decode(ids) == text


def test_split_multibyte_character_is_held_back(byte_bpe):
    ids = byte_bpe.encode("🎉")
    assert len(ids) > 1, "the tiny vocabulary must split the emoji across byte tokens"
    detok = IncrementalDetokenizer(byte_bpe, [])
    partial = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in p for p in partial)
    assert "".join(partial) + detok.flush() == "🎉"


def test_random_token_streams_never_emit_replacement_chars_mid_stream(byte_bpe):
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choice(TEXTS))[: rng.randint(1, 40)]
        ids = byte_bpe.encode(text)
        detok = IncrementalDetokenizer(byte_bpe, [])
        assert stream(detok, ids, rng.randint(1, 3)) == byte_bpe.decode(ids)


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_spanning_tokens_is_not_emitted(byte_bpe, chunk):
    text = "Hello world! The quick brown fox jumps"
    ids = byte_bpe.encode(text)
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["brown f"])
    out = stream(detok, ids, chunk)
    assert out == "Hello world! The quick "
    assert detok.stop_matched == "brown f"


def test_earliest_stop_string_wins(byte_bpe):
    ids = byte_bpe.encode("abc ### def </s> ghi")
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["</s>", "###"])
    assert stream(detok, ids, 1) == "abc "
    assert detok.stop_matched == "###"


def test_partial_stop_prefix_is_released_when_it_does_not_complete(byte_bpe):
    ids = byte_bpe.encode("a #b")
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["###"])
    out = stream(detok, ids, 1)
    assert out == "a #b"
    assert detok.stop_matched is None
