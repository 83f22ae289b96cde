"""OpenAI response shapes: chunks, full responses, usage and logprobs, as plain dicts.

Pure functions of accumulated choice state; no I/O. `app/generation.py` feeds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.app.state import TokenText
from tandem.runtime.types import TokenLogprob


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    role_sent: bool = False
    cached_tokens: int = 0  # prompt tokens this choice's sequence took from the prefix cache
    text_offset: int = 0  # completions logprobs: chars of token text emitted so far
    message: dict[str, Any] | None = None  # chat: shaped message (tool calls, reasoning)


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str
    kind: str  # "chat" | "completion"


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(items: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    content = []
    for lp in items:
        text, raw = token_text.get(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = token_text.get(tid)
            top.append({"token": t, "logprob": value, "bytes": b})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(
    items: Sequence[TokenLogprob], token_text: TokenText, start_offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy completions shape; returns it and the text offset after the last token."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = start_offset
    for lp in items:
        text, _ = token_text.get(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        tops.append({token_text.get(tid)[0]: value for tid, value in lp.top})
        offsets.append(offset)
        offset += len(text)
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        },
        offset,
    )


def chunk(meta: ResponseMeta, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": meta.id,
        "object": "chat.completion.chunk" if meta.kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    }
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(meta: ResponseMeta, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "chat.completion.chunk" if meta.kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage,
    }


def full_response(
    meta: ResponseMeta,
    choices: Sequence[ChoiceState],
    usage: dict[str, Any],
    token_text: TokenText,
    want_logprobs: bool,
) -> dict[str, Any]:
    out_choices = []
    for c in choices:
        if meta.kind == "chat":
            out_choices.append(
                {
                    "index": c.index,
                    "message": c.message or {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c.logprobs, token_text) if want_logprobs else None,
                    "finish_reason": c.finish_reason,
                }
            )
        else:
            lp = completion_logprobs(c.logprobs, token_text, 0)[0] if want_logprobs else None
            out_choices.append(
                {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            )
    return {
        "id": meta.id,
        "object": "chat.completion" if meta.kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": out_choices,
        "usage": usage,
    }
