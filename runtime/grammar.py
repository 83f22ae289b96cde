"""Grammar-constrained decoding over llguidance: compiled grammars cached per (spec, tokenizer),
per-request matchers, and the batch's token masks as one int32 bitmask (bit t of row r: token t
is allowed). Knows nothing of HTTP; the app turns request fields into a `GrammarSpec`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import numpy as np
import torch

from tandem.runtime.sampling_params import GrammarSpec

# JSON is generated compactly: flexible whitespace lets a weak model emit blanks forever.
_JSON_OPTIONS = {"whitespace_flexible": False}
_CACHE_SIZE = 256


class GrammarError(ValueError):
    """The grammar or schema cannot be compiled; the message names what is wrong."""


class GrammarMatcher:
    """One request's position in its grammar. `accept` advances it by a sampled token."""

    def __init__(
        self, matcher: llguidance.LLMatcher, mask_words: int, banned: int | None = None
    ) -> None:
        self._m = matcher
        self.mask_words = mask_words  # int32 words in its bitmask row
        self.banned = banned  # a token cleared from every mask (a stand-in EOS)

    def accept(self, token_id: int) -> None:
        self._m.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """No further token can follow (the grammar is complete), or the matcher failed."""
        return self._m.is_stopped() or self._m.is_error()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @property
    def llg(self) -> llguidance.LLMatcher:
        return self._m


class CompiledGrammar:
    """A checked grammar; each request gets a copy of its template matcher."""

    def __init__(self, template: llguidance.LLMatcher, mask_words: int, banned: int | None) -> None:
        self._template = template
        self._mask_words = mask_words
        self._banned = banned

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._mask_words, self._banned)


def _grammar_text(spec: GrammarSpec) -> str:
    m = llguidance.LLMatcher
    try:
        if spec.kind == "json_object":
            return m.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if spec.kind == "json_schema":
            return m.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.grammar_from("grammar", spec.text)  # EBNF (GBNF) or Lark
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer; thread-safe, LRU-cached. Compile in a worker
    thread (llguidance drops the GIL while it builds), then `cached` is a dict lookup."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        # llguidance needs an EOS. Without one, token 0 stands in and is cleared from every
        # mask, so a grammar ends by completion only (a byte tokenizer's 0 is NUL, which JSON
        # strings cannot hold anyway).
        self.vocab_size = vocab_size
        eos: Any = list(eos_token_ids) if eos_token_ids else 0
        self.banned = None if eos_token_ids else 0
        self._tokenizer_json = tokenizer_json
        self._n_vocab, self._eos = vocab_size, eos
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()

    @property
    def mask_words(self) -> int:
        """int32 words per bitmask row."""
        return (self._n_vocab + 31) // 32

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._n_vocab, eos_token=self._eos
                )
            return self._tokenizer

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            return hit

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """-> the compiled grammar, or GrammarError naming what is unsupported or invalid."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        tok = self._llg_tokenizer()
        text = _grammar_text(spec)
        matcher = llguidance.LLMatcher(tok, text, log_level=0)  # an invalid one is in error
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error()))
        compiled = CompiledGrammar(matcher, self.mask_words, self.banned)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def _clean(message: str) -> str:
    """llguidance errors may append its grammar dump; the first line says what is wrong."""
    return message.split("\n<state>")[0].split("\n<grammar>")[0].strip()[:2000]


def grammar_compiler_for(tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> GrammarCompiler:
    """A compiler over a tokenizer that exposes its HF `tokenizers` backend (`.backend`)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise GrammarError("structured outputs need a tokenizer with a tokenizers backend")
    return GrammarCompiler(backend.to_str(), vocab_size, eos)


# -- masks ------------------------------------------------------------------------------------

_EXECUTOR: llguidance.LLExecutor | None = None
_shifts: dict[torch.device, torch.Tensor] = {}  # [32] int32 per device: 0..31


def fill_bitmask(matchers: list[GrammarMatcher], out: torch.Tensor) -> None:
    """Write row i of `out` ([>= len(matchers), words] int32, CPU, contiguous) from matcher i;
    several rows are computed in parallel on llguidance's threads (the GIL is dropped)."""
    global _EXECUTOR
    assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
    n, words = len(matchers), out.shape[1]
    if n == 1:
        matchers[0].llg.unsafe_compute_mask_ptr(out.data_ptr(), words * 4)
    else:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        pairs = [(m.llg, i) for i, m in enumerate(matchers)]
        _EXECUTOR.unsafe_compute_mask_ptr(pairs, out.data_ptr(), words * 4, out.shape[0])
    banned = matchers[0].banned
    if banned is not None:
        word, bit = divmod(banned, 32)
        keep = ~(1 << bit) & 0xFFFFFFFF
        out[:n, word] &= keep - (1 << 32) if keep >= 1 << 31 else keep


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """In place: logits `[N, V]` float32; rows `[k]` int64 on the logits' device, or None for
    all N rows; bitmask `[k, words]` int32 on the logits' device. Tokens whose bit is clear in
    their row's mask become -inf; other rows are not touched."""
    vocab = logits.shape[1]
    k = bitmask.shape[0]
    if bitmask.device.type == "cpu":  # numpy's unpackbits is a tight C loop
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        banned = torch.from_numpy(bits).view(torch.bool)[:, :vocab].logical_not()
    else:
        shifts = _shifts.get(bitmask.device)
        if shifts is None:
            shifts = _shifts[bitmask.device] = torch.arange(
                32, dtype=torch.int32, device=bitmask.device
            )
        banned = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(k, -1)[:, :vocab] == 0
    if rows is None:
        logits.masked_fill_(banned, float("-inf"))
        return
    sub = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, rows, sub)
