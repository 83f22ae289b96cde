"""Incremental detokenization with stop strings.

Turns one request's growing list of output token ids into text deltas. Correct for characters
split across tokens (a trailing U+FFFD from an incomplete UTF-8 sequence is held back until the
next token completes it) and for stop strings that span tokens (text that could still be the
start of a stop string is held back; a matched stop string is not emitted).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

# Context tokens decoded before the new ones, so that tokenizers which merge or strip
# spaces by context (byte-level BPE, SentencePiece) give the same text as a full decode.
_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@functools.lru_cache(maxsize=64)
def _failure_table(stop: str) -> tuple[int, ...]:
    """fail[i]: the longest proper border of stop[: i + 1]. Cached: the sequences of one
    request (n, prompt lists) share their stop strings, and a table costs a Python loop over
    the string."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class _StopPrefix:
    """The longest tail of a growing text that is a prefix of one stop string, kept by a KMP
    automaton fed only the new characters: linear in the text, whatever the string's length."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self._fail = _failure_table(stop)
        self.length = 0  # of the tail matched so far

    def feed(self, text: str) -> None:
        stop, fail, k = self.stop, self._fail, self.length
        for ch in text:
            while k and (k == len(stop) or stop[k] != ch):
                k = fail[k - 1]
            if stop[k] == ch:
                k += 1
        self.length = k


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._prefixes = [_StopPrefix(s) for s in self._stop]
        # With stop strings: all output text decoded so far (stop string excluded once
        # matched); without, text is emitted as decoded and not kept.
        self.text = ""
        self._emitted = 0  # characters of self.text already returned
        self.stop_matched: str | None = None

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Feed new output tokens; return newly decodable text (may be empty)."""
        if self.stop_matched is not None:
            return ""
        if not self._stop:  # nothing to search or hold back: emit each piece as decoded
            pieces = []
            for tid in new_ids:
                self._ids.append(tid)
                piece = self._decode_step()
                if piece:
                    pieces.append(piece)
            return pieces[0] if len(pieces) == 1 else "".join(pieces)
        for tid in new_ids:
            self._ids.append(tid)
            piece = self._decode_step()
            if piece:
                self._append(piece)
                if self._check_stop():
                    break
        return self._take(final=self.stop_matched is not None)

    def flush(self) -> str:
        """The request finished: return whatever is still held back."""
        piece = ""
        if self.stop_matched is None and self._read_offset < len(self._ids):
            # An incomplete character at the very end: emit what the tokenizer makes of it.
            prefix = self._tok.decode(
                self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
            )
            full = self._tok.decode(
                self._ids[self._prefix_offset :], skip_special_tokens=self._skip
            )
            piece = full[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        if not self._stop:
            return piece
        self._append(piece)
        return self._take(final=True)

    def _append(self, piece: str) -> None:
        self.text += piece
        for p in self._prefixes:
            p.feed(piece)

    def _decode_step(self) -> str:
        """Decode the newest token in context; return the text it completes ("" while a
        character is incomplete)."""
        ids, skip = self._ids, self._skip
        prefix = self._tok.decode(
            ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip
        )
        full = self._tok.decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            # Only the last few tokens are ever decoded again: keep the list short.
            if self._prefix_offset > 4 * _CONTEXT_TOKENS:
                del ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return full[len(prefix) :]
        return ""

    def _check_stop(self) -> bool:
        if not self._stop:
            return False
        # Only the tail can contain a newly completed stop string.
        window_start = max(0, self._emitted - self._hold)
        best: tuple[int, str] | None = None
        for s in self._stop:
            pos = self.text.find(s, window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.stop_matched = best[1]
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        return max(min(p.length, len(p.stop) - 1) for p in self._prefixes)

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._held_back())
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
