"""Text <-> token ids, and chat templates, over HF's fast (Rust) `tokenizers` library.

`Tokenizer` is built from an HF model directory (`tokenizer.json` + `tokenizer_config.json`), from
a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE), or made up for a vocabulary size
(`synthetic`, for random "dummy" weights of a shape that ships no tokenizer). It renders chat
templates with a sandboxed jinja2 environment, imported when the first template is compiled. It
knows nothing of requests or of incremental streaming state: the runtime's detokenizer builds on
`convert_ids_to_tokens` / `convert_tokens_to_string`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from tandem.models.config import UnsupportedModelError
from tandem.models.gguf_reader import GGUFReader

if TYPE_CHECKING:
    import jinja2

# End-of-turn markers a chat template may close a turn with; added to the eos ids when special.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`; anything else gets GPT-2's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# gpt-oss (o200k): cased words apart ("HelloWorld" -> "Hello", "World"), digits in threes
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "glm4": _LLAMA3_SPLIT,  # GLM-4.5 / 4.6 (llama.cpp's "glm4" and "chatglm-bpe")
    "chatglm-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "gpt-4o": _O200K_SPLIT,  # gpt-oss
}
_DIGIT_SPLIT = ("smollm", "starcoder", "refact")
_NO_BOS = ("glm4", "chatglm-bpe")  # GPT-2 regex after splitting every digit apart

SYNTHETIC_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes map to themselves, the other bytes
    to code points from U+0100 upward, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as `{"content": ...}`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


_GGUF_SPECIAL_TOKENS = ("bos", "eos", "unknown", "padding")


def _gguf_bpe(
    meta: Any, spelled: dict[int, str], ids: dict[str, int | None]
) -> tuple[models.BPE, list[str], list[str], dict[str, str]]:
    """The BPE model of a GGUF's `tokenizer.ggml.*` arrays, its control (special) and
    user-defined (added, matched whole) tokens, and the text of the `ids` that name a token."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(spelled.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        # a token outside the byte alphabet is stored as raw text: respell it byte by byte
        key = tok if set(tok) <= alphabet else "".join(spelled[b] for b in tok.encode())
        vocab.setdefault(key, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, dropout=None)
    # token_type 3 = control (special), 4 = user-defined (added, matched whole, not special)
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == 3 and set(t) <= alphabet]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == 4 and t in vocab]
    special = {
        k: tokens[tid] for k, tid in ids.items() if tid is not None and 0 <= tid < len(tokens)
    }
    return bpe, control, user, special


class Tokenizer:
    """A fast tokenizer plus the special tokens and chat template that come with a model."""

    def __init__(
        self,
        backend: RustTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.add_bos_token = add_bos_token
        eos: list[int] = []
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos.append(backend.token_to_id(eos_token))
        eos.extend(int(i) for i in extra_eos_ids)
        special = set(self.all_special_ids)
        for marker in _TURN_END_TOKENS:
            tid = backend.token_to_id(marker)
            if chat_template and marker in chat_template and tid in special:
                eos.append(tid)
        self._eos_token_ids = tuple(dict.fromkeys(eos))

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """From an HF directory: tokenizer.json, tokenizer_config.json (chat template, special
        tokens), optional chat_template.jinja, and eos ids from (generation_)config.json."""
        root = Path(model_dir)
        if not (root / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        backend = RustTokenizer.from_file(str(root / "tokenizer.json"))
        cfg = _read_json(root / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (root / "chat_template.jinja").exists():
            template = (root / "chat_template.jinja").read_text()
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(root / name).get("eos_token_id")
            extra_eos.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            unk_token=_token_content(cfg.get("unk_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            extra_eos_ids=extra_eos,
        )

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | GGUFReader) -> Tokenizer:
        """From a GGUF file's `tokenizer.ggml.*` metadata; only byte-level BPE ("gpt2") models."""
        reader = (
            path_or_reader if isinstance(path_or_reader, GGUFReader) else GGUFReader(path_or_reader)
        )
        meta = reader.metadata
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
            )
        spelled = byte_to_unicode()
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in _GGUF_SPECIAL_TOKENS}
        bpe, control, user, special = _gguf_bpe(meta, spelled, ids)
        # the ~100k vocabulary strings are gone: what the tokenizer keeps is allocated from here
        # on, so their memory can go back to the OS (one survivor among them pins its arena)
        special = {k: v.encode().decode() for k, v in special.items()}
        backend = RustTokenizer(bpe)
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=special.get("bos"),
            eos_token=special.get("eos"),
            unk_token=special.get("unknown"),
            pad_token=special.get("padding"),
            # GLM's chat template writes its own [gMASK]<sop>: never a BOS (as llama.cpp)
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False))
            and meta.get("tokenizer.ggml.pre") not in _NO_BOS,
            extra_eos_ids=[eot] if eot is not None else [],
        )

    @classmethod
    def synthetic(cls, vocab_size: int) -> Tokenizer:
        """A stand-in for a model without tokenizer files (random weights of a real shape), so
        text prompts, chat and streamed text work. Ids 0-255 are the bytes of UTF-8 (any text
        encodes to them); id N >= 256 reads " tN" and is never produced by `encode`. No special
        tokens, no eos; a plain "role: content" chat template."""
        if vocab_size < 256:
            raise ValueError(f"a synthetic tokenizer needs vocab_size >= 256, got {vocab_size}")
        spelled = byte_to_unicode()
        vocab = {spelled[b]: b for b in range(256)}
        space = spelled[ord(" ")]
        vocab.update((f"{space}t{i}", i) for i in range(256, vocab_size))
        backend = RustTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return cls(backend, chat_template=SYNTHETIC_CHAT_TEMPLATE)

    # -- ids ------------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        decoder = self.backend.get_added_tokens_decoder()
        return sorted(i for i, tok in decoder.items() if tok.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids.
        `add_special_tokens` prepends BOS when the model asks for it (add_bos_token)."""
        # encode_batch releases the GIL (encode does not): a long text tokenized on a worker
        # thread then leaves the server's event loop running
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        tok = self.backend.id_to_token(token_id)
        if tok is None:
            raise IndexError(f"token id {token_id} out of range (vocab size {self.vocab_size})")
        return tok

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.id_to_token(i) for i in ids]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """Join tokens into text. Byte-level tokens are turned back into bytes and decoded as
        UTF-8 with replacement, so an incomplete trailing character shows as U+FFFD."""
        if self.backend.decoder is None:
            return "".join(tokens)
        return self.backend.decoder.decode(list(tokens))

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (sandboxed jinja2).

        A message whose content is a list of `{"type": "text", "text": ...}` parts is given to
        the template with those texts joined by newlines. Extra `kwargs` reach the template.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        flat = [_flatten_content(m) for m in messages]
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
            **kwargs,
        }
        return _compile_template(self.chat_template).render(
            messages=flat, add_generation_prompt=add_generation_prompt, **context
        )


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r}; only text parts are")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "\n".join(texts)}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
