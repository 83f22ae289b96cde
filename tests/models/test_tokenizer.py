"""Tokenizer from GGUF metadata and from an HF directory, against transformers' tokenizers."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from tandem.models.hub import resolve_model
from tandem.models.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing ",
    "  two  spaces\t\ttabs\n\n\nnewlines\r\n",
    "naïve café — 日本語のテキスト, Ελληνικά, русский",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # comment\n\tif x != 0: pass",
    "12345 3.14159 1,000,000 v2.0.1",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<repo_name>y <file_sep>",
    "it's they're I'll WE'VE",
    "",
    " ",
    "\u200b zero width \u00a0 nbsp",
    "a" * 300,
    "<|im_start",
    "<|im_end|><|im_end|>",
]


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="module")
def ours(smollm_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def reference(smollm_path: Path):  # transformers' GGUF tokenizer (~10 s to build)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


def test_special_tokens(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.id_to_token(2) == "<|im_end|>"
    assert ours.eos_token_ids == (2,)  # eos from metadata is already the template's <|im_end|>
    assert ours.all_special_ids == list(range(17))  # token_type 3 (control)
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # add_bos_token is False
    with pytest.raises(IndexError):
        ours.id_to_token(10**6)


MESSAGES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 😀"},
        {"role": "user", "content": "And now?\nTwo lines."},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference, messages, add_generation_prompt
) -> None:
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    )


def test_chat_content_parts_are_joined(ours: Tokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    plain = [{"role": "user", "content": "a\nb"}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(plain)
    with pytest.raises(ValueError, match="image_url"):
        ours.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        )


def test_chat_template_sandbox_and_raise_exception(ours: Tokenizer) -> None:
    tok = Tokenizer(
        ours.backend, chat_template="{{ raise_exception('no ' + messages[0]['role']) }}"
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="no user"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    evil = Tokenizer(ours.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_includes_template_end_token(ours: Tokenizer) -> None:
    tok = Tokenizer(ours.backend, eos_token="<|endoftext|>", chat_template="{{ '<|im_end|>' }}")
    assert tok.eos_token_ids == (0, 2)
    assert Tokenizer(ours.backend, eos_token="<|endoftext|>").eos_token_ids == (0,)


def test_incremental_detokenization_leaves_partial_utf8(ours: Tokenizer) -> None:
    text = "héllo 😀 日本"
    tokens = ours.convert_ids_to_tokens(ours.encode(text))
    prefixes = [ours.convert_tokens_to_string(tokens[:i]) for i in range(len(tokens) + 1)]
    assert prefixes[-1] == text
    # the emoji's four bytes span two tokens: the first prefix ends in U+FFFD
    assert any(p.endswith("\ufffd") for p in prefixes)
    for p in prefixes:
        assert text.startswith(p.rstrip("\ufffd"))


def test_from_pretrained_matches(ours: Tokenizer, reference, tmp_path: Path) -> None:
    reference.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text), text
    assert loaded.apply_chat_template(MESSAGES[2]) == ours.apply_chat_template(MESSAGES[2])
    assert 2 in loaded.eos_token_ids and loaded.bos_token_id == 1
    assert (
        loaded.convert_tokens_to_string(loaded.convert_ids_to_tokens(loaded.encode("😀"))) == "😀"
    )
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "missing")


def test_synthetic_tokenizer_bytes_and_placeholders() -> None:
    tok = Tokenizer.synthetic(1000)
    assert tok.vocab_size == 1000 and tok.eos_token_ids == () and tok.all_special_ids == []
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))  # ids 0-255 are the bytes
        assert tok.decode(ids) == text
    assert tok.decode([256, 999, 104, 105]) == " t256 t999hi"
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens([300, 0xC3, 0xA9])) == " t300é"
    with pytest.raises(IndexError):
        tok.id_to_token(1000)
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        Tokenizer.synthetic(255)


def test_synthetic_tokenizer_chat_template() -> None:
    tok = Tokenizer.synthetic(128256)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text == "system: be brief\nuser: hi\nassistant: "
    assert tok.decode([128255]) == " t128255"


@pytest.mark.parametrize(
    "pre,pieces",
    [
        # gpt-oss (o200k): cased words apart, the contraction kept on its word, digits in threes
        ("gpt-4o", ["Hello", "World's", "Ġ", "123", "45", "Ġabc", "Ċ", "XYZfoo"]),
        # GLM-4.5 (llama.cpp's "glm4" / "chatglm-bpe"): Llama 3's split
        ("glm4", ["HelloWorld", "'s", "Ġ", "123", "45", "Ġabc", "Ċ", "XYZfoo"]),
        ("chatglm-bpe", ["HelloWorld", "'s", "Ġ", "123", "45", "Ġabc", "Ċ", "XYZfoo"]),
        (None, ["HelloWorld", "'s", "Ġ12345", "Ġabc", "Ċ", "XYZfoo"]),  # GPT-2's regex
    ],
)
def test_gguf_pre_tokenizer_splits_by_the_files_pre_name(pre, pieces) -> None:
    from tandem.models.tokenizer import _gguf_pre_tokenizer

    text = "HelloWorld's 12345 abc\nXYZfoo"
    assert [w for w, _ in _gguf_pre_tokenizer(pre).pre_tokenize_str(text)] == pieces


@pytest.mark.parametrize("pre,bos", [("glm4", False), ("llama-bpe", True)])
def test_gguf_glm_tokenizer_adds_no_bos(tmp_path, pre: str, bos: bool) -> None:
    """A GLM GGUF that says add_bos_token gets none (its template writes [gMASK]<sop>)."""
    import gguf

    from tandem.models.tokenizer import Tokenizer, byte_to_unicode

    tokens = [byte_to_unicode()[b] for b in range(256)] + ["[gMASK]"]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "glm4moe")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * 256 + [3])
    w.add_uint32("tokenizer.ggml.bos_token_id", 256)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    ids = tok.encode("hi", add_special_tokens=True)
    assert ids == ([256] if bos else []) + [ord("h"), ord("i")]
