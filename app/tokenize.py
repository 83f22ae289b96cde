"""`POST /tokenize` and `POST /detokenize`: the server's own tokenizer and chat template, so a
client can count tokens exactly as a chat or completions request would."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tandem.app.errors import APIError, json_response
from tandem.app.protocol import _messages_to_prompt, parse_json_body
from tandem.app.state import STATE_KEY, ServerState

_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens"}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _check(state: ServerState, body: dict[str, Any], allowed: set[str]) -> Any:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(unknown[0], f"unknown field {unknown[0]!r}; allowed: {sorted(allowed)}")
    model = body.get("model")
    if model is not None and model not in state.model_names:
        raise APIError(
            404, f"The model {model!r} does not exist", param="model", code="model_not_found"
        )
    tokenizer = state.engine_loop.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", code="no_tokenizer")
    return tokenizer


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": str} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}. A prompt
    is encoded as /v1/completions does (no special tokens unless add_special_tokens), messages
    through the chat template as /v1/chat/completions does."""
    state = request.app[STATE_KEY]
    body = parse_json_body(await request.read())
    tokenizer = _check(state, body, _TOKENIZE_FIELDS)
    add_special = body.get("add_special_tokens", False)
    if not isinstance(add_special, bool):
        raise _bad("add_special_tokens", "'add_special_tokens' must be a boolean")
    if ("prompt" in body) == ("messages" in body):
        raise _bad("prompt", "give exactly one of 'prompt' (a string) or 'messages'")
    if "messages" in body:
        tokens, _ = _messages_to_prompt(body["messages"], tokenizer)
    elif isinstance(body["prompt"], str):
        tokens = list(tokenizer.encode(body["prompt"], add_special_tokens=add_special))
    else:
        raise _bad("prompt", "'prompt' must be a string")
    max_len = state.engine_loop.max_model_len
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": max_len})


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [int]} -> {"prompt": str}; ids outside the vocabulary are refused."""
    state = request.app[STATE_KEY]
    body = parse_json_body(await request.read())
    tokenizer = _check(state, body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise _bad("tokens", "'tokens' must be a list of integers")
    vocab = tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise _bad("tokens", f"token id {bad} is outside the vocabulary [0, {vocab})")
    return json_response({"prompt": tokenizer.decode(tokens, skip_special_tokens=False)})
