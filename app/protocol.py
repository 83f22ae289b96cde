"""OpenAI request bodies → `GenerationRequest` (token ids + `SamplingParams`), or a 400.

Validation names the offending field in `param`. Fields the server does not implement
(legacy functions, audio …) are refused, not silently ignored; fields that change nothing
here (user, metadata …) are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from tandem.app.chat_output import ChatOutputOptions
from tandem.app.errors import APIError
from tandem.app.harmony import template_is_harmony
from tandem.app.reasoning import OPEN as THINK_OPEN
from tandem.app.reasoning import template_reasons
from tandem.app.structured import (
    STRUCTURED_FIELDS,
    TOOL_FIELDS,
    ToolRequest,
    output_grammar,
    parse_tools,
    tool_grammar,
)
from tandem.app.tool_parsers import parser_for_template
from tandem.runtime.limits import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_NAME_CHARS,
    MAX_PROMPTS,
    MAX_SEQUENCES,
)
from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError

Kind = Literal["chat", "completion"]

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
)
_COMMON = {
    "model",
    "max_tokens",
    "n",
    "stop",
    "stream",
    "stream_options",
    "priority",
    *_SAMPLING_FIELDS,
}
# accepted and checked for type, but they change nothing here
_IGNORED: dict[str, tuple[tuple[type, ...], str]] = {
    "user": ((str,), "a string"),
    "store": ((bool,), "a boolean"),
    "metadata": ((dict,), "an object"),
    "service_tier": ((str,), "a string"),
}
_CHAT_FIELDS = (
    _COMMON
    | set(_IGNORED)
    | STRUCTURED_FIELDS
    | TOOL_FIELDS
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias"}
    | {"chat_template_kwargs"}
)
_COMPLETION_FIELDS = (
    _COMMON | set(_IGNORED) | STRUCTURED_FIELDS | {"prompt", "logprobs", "logit_bias"}
)
# chat_template_kwargs a client may set (never arbitrary template variables)
CHAT_TEMPLATE_KWARGS = {"enable_thinking": bool, "thinking": bool}

# field -> predicate saying the value is harmless (a default) and may be accepted
_UNSUPPORTED: dict[str, Any] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v is None,
    "best_of": lambda v: v in (None, 1),
}
_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int = 0
    chat_output: ChatOutputOptions = ChatOutputOptions()
    grammar_param: str | None = None  # the field that set params.grammar


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"Invalid JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    return body


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name, value in body.items():
        if name in _UNSUPPORTED:
            if not _UNSUPPORTED[name](value):
                raise APIError(
                    400,
                    f"'{name}' is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
        elif name not in allowed:
            raise APIError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )
        elif name in _IGNORED:
            _opt(body, name, *_IGNORED[name])
    _check_metadata(body.get("metadata"))


def _check_metadata(metadata: Any) -> None:
    """OpenAI's shape: at most 16 string keys (64 characters) to strings (512 characters)."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise _bad("metadata", f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise _bad(
                "metadata", f"metadata keys may hold at most {MAX_METADATA_KEY_CHARS} characters"
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise _bad(
                f"metadata.{key}",
                f"metadata values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters",
            )


def _opt(body: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise _bad(name, f"'{name}' must be {what}, got {type(value).__name__}")
    return value


class JsonArguments(dict):
    """Tool-call arguments for a chat template: a mapping (`| tojson`, `is mapping`, as
    transformers' templates expect) that also reads as its JSON text where a template
    concatenates it as a string (DeepSeek-V3's `'```json\n' + arguments`)."""

    def __str__(self) -> str:
        return orjson.dumps(self).decode()

    def __add__(self, other: Any) -> str:
        return str(self) + other

    def __radd__(self, other: Any) -> str:
        return other + str(self)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with arguments as objects (templates expect them)."""
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", f"'{where}.tool_calls' must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.tool_calls[{j}]", "a tool call needs function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = orjson.loads(args or "{}")
            except orjson.JSONDecodeError:
                raise _bad(
                    f"{where}.tool_calls[{j}].function.arguments", "arguments must be JSON"
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": JsonArguments(args) if isinstance(args, dict) else args,
                },
            }
        )
    return out


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = _opt(body, "chat_template_kwargs", (dict,), "an object") or {}
    for name, value in kwargs.items():
        kind = CHAT_TEMPLATE_KWARGS.get(name)
        if kind is None:
            raise APIError(
                400,
                f"chat_template_kwargs.{name} is not allowed "
                f"(allowed: {', '.join(sorted(CHAT_TEMPLATE_KWARGS))})",
                param=f"chat_template_kwargs.{name}",
                code="unsupported_parameter",
            )
        if not isinstance(value, kind):
            raise _bad(f"chat_template_kwargs.{name}", f"'{name}' must be a {kind.__name__}")
    return kwargs


def _messages_to_prompt(
    messages: Any,
    tokenizer: Any,
    tools: ToolRequest | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], str]:
    """-> the prompt's token ids and its text."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise _bad("messages", f"at most {MAX_MESSAGES} messages per request, got {len(messages)}")
    norm: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"'{where}' must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in _CHAT_ROLES:
            got = repr(role)[:64] if isinstance(role, str) else f"a {type(role).__name__}"
            raise _bad(
                f"{where}.role", f"'{where}.role' must be one of {sorted(_CHAT_ROLES)}, got {got}"
            )
        name = m.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
            raise _bad(
                f"{where}.name",
                f"'{where}.name' must be a string of at most {MAX_NAME_CHARS} characters",
            )
        if m.get("function_call"):
            raise APIError(
                400,
                "legacy function_call messages are not supported; use tool_calls",
                param=f"{where}.function_call",
                code="unsupported_parameter",
            )
        calls = None
        if m.get("tool_calls"):
            if role != "assistant":
                raise _bad(f"{where}.tool_calls", "only assistant messages carry tool_calls")
            calls = _tool_calls(m["tool_calls"], where)
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            if len(content) > MAX_CONTENT_PARTS:
                raise _bad(
                    f"{where}.content", f"at most {MAX_CONTENT_PARTS} content parts per message"
                )
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise _bad(
                        f"{where}.content[{j}]",
                        "only {'type': 'text', 'text': str} content parts are supported",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(
                f"{where}.content", f"'{where}.content' must be a string or a list of text parts"
            )
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role}
        entry["content"] = content
        if calls is not None:
            entry["tool_calls"] = calls
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.tool_call_id", "a tool message needs 'tool_call_id'")
            entry["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                entry["name"] = m["name"]
        norm.append(entry)
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools is not None and tools.choice != "none":
        extra["tools"] = [dict(t) for t in tools.tools]
    try:
        text = tokenizer.apply_chat_template(norm, add_generation_prompt=True, **extra)
    except Exception as exc:  # a template may reject a role order it does not support
        raise _bad("messages", f"the chat template rejected the messages: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False)), text


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object of token id -> bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        out[tid] = bias
    return out


def _chat_output(
    tokenizer: Any,
    tools: ToolRequest | None,
    prompt_text: str,
    kwargs: dict[str, Any],
    constrained: bool,
) -> ChatOutputOptions:
    template = getattr(tokenizer, "chat_template", None)
    family = parser_for_template(template) if tools is not None else None
    parser = None
    if tools is not None and tools.choice == "auto":
        parser = family
        if parser is not None and parser.needs_special_tokens:
            kwargs["skip_special_tokens"] = False
    harmony = template_is_harmony(template) and not constrained
    if harmony:  # the channels are told apart by special tokens
        kwargs["skip_special_tokens"] = False
    end_texts: tuple[str, ...] = ()
    if kwargs.get("skip_special_tokens") is False:
        eos = getattr(tokenizer, "eos_token_ids", ())
        end_texts = tuple(tokenizer.decode([i], skip_special_tokens=False) for i in eos)
    reasons = template_reasons(template) and not constrained  # a grammar leaves no room to think
    return ChatOutputOptions(
        reasoning=reasons,
        harmony=harmony,
        starts_in_reasoning=reasons and prompt_text.rstrip().endswith(THINK_OPEN),
        tools=tools,
        parser=parser,
        end_texts=end_texts,
        call_id_style="mistral" if family is not None and family.name == "mistral" else "openai",
    )


def _prompt_to_ids(prompt: Any, tokenizer: Any) -> list[list[int]]:
    def token_list(x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        )

    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt, add_special_tokens=False)]
    elif token_list(prompt) and prompt:
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(token_list(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise _bad(
            "prompt",
            "'prompt' must be a string, a list of strings, a list of token "
            "ids or a list of token id lists (non-empty)",
        )
    if len(prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    vocab = getattr(tokenizer, "vocab_size", None)
    for ids in prompts:
        if not ids:
            raise _bad("prompt", "a prompt must contain at least one token")
        if vocab is not None and any(t < 0 or t >= vocab for t in ids):
            raise _bad("prompt", f"token ids must be in [0, {vocab})")
    return prompts


def parse_generation(
    kind: Kind,
    body: dict[str, Any],
    tokenizer: Any,
    max_model_len: int,
    model_names: tuple[str, ...],
    max_tokens_default: int | None = None,
) -> GenerationRequest:
    """Validate one chat or completions body and tokenize its prompt(s). A request without
    max_tokens (absent, or null) gets `max_tokens_default`, at most what the context leaves
    (None: up to the end of the context)."""
    _check_fields(body, _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS)
    model = _opt(body, "model", (str,), "a string")
    if model is None:  # absent or null: the served model
        model = model_names[0]
    if model not in model_names:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{model_names[0]}'",
            param="model",
            code="model_not_found",
        )
    stream = bool(_opt(body, "stream", (bool,), "a boolean"))
    options = _opt(body, "stream_options", (dict,), "an object") or {}
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise _bad(
            f"stream_options.{unknown[0]}", f"unknown field {unknown[0]!r} in stream_options"
        )
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", "'include_usage' must be a boolean")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise _bad("stop", "'stop' must be a string or a list of strings")
    priority = _opt(body, "priority", (int,), "an integer") or 0

    kwargs: dict[str, Any] = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    kwargs["stop"] = stop
    if body.get("n") is not None:
        kwargs["n"] = body["n"]
    kwargs["logit_bias"] = _logit_bias(body.get("logit_bias")) or ()
    found = output_grammar(body)
    grammar_param, grammar = found if found is not None else (None, None)
    chat_output = ChatOutputOptions()
    if kind == "chat":
        tools = parse_tools(body)
        forced = tool_grammar(tools) if tools is not None else None
        if forced is not None and grammar is not None:
            raise _bad("response_format", "tool_choice required or named sets the output format")
        if forced is not None:
            grammar_param, grammar = "tool_choice", forced
        ids, prompt_text = _messages_to_prompt(
            body.get("messages"), tokenizer, tools, _template_kwargs(body)
        )
        prompts = [ids]
        chat_output = _chat_output(tokenizer, tools, prompt_text, kwargs, grammar is not None)
        # both are checked; the newer name wins when both are set (a null one counts as unset)
        newer = _opt(body, "max_completion_tokens", (int,), "an integer")
        older = _opt(body, "max_tokens", (int,), "an integer")
        if newer is not None and older is not None and older < 1:  # the loser is checked too
            raise _bad("max_tokens", f"max_tokens must be an integer >= 1, got {older!r}")
        max_tokens = newer if newer is not None else older
        max_param = "max_completion_tokens" if newer is not None else "max_tokens"
        logprobs = _opt(body, "logprobs", (bool,), "a boolean") or False
        top = _opt(body, "top_logprobs", (int,), "an integer")
        if top is not None and not logprobs:
            raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        kwargs.update(logprobs=logprobs, top_logprobs=top or 0)
    else:
        prompts = _prompt_to_ids(body.get("prompt"), tokenizer)
        max_tokens = _opt(body, "max_tokens", (int,), "an integer")
        if "max_tokens" not in body:
            max_tokens = 16  # OpenAI's completions default; an explicit null means "to the limit"
        max_param = "max_tokens"
        top = _opt(body, "logprobs", (int,), "an integer")
        if top is not None:
            kwargs.update(logprobs=True, top_logprobs=top)
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = max(1, max_model_len - longest)
        if max_tokens_default is not None:
            max_tokens = min(max_tokens, max_tokens_default)
    kwargs["max_tokens"] = max_tokens
    kwargs["grammar"] = grammar
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        param = {"max_tokens": max_param}.get(exc.param, exc.param)
        if kind == "completion" and param == "top_logprobs":
            param = "logprobs"
        raise _bad(param, str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise _bad("body", f"invalid sampling parameters: {exc}") from None
    if len(prompts) * params.n > MAX_SEQUENCES:
        raise _bad(
            "n", f"prompts x n must be at most {MAX_SEQUENCES}, got {len(prompts) * params.n}"
        )
    if longest + params.max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {longest + params.max_tokens} tokens ({longest} in the "
            f"{'messages' if kind == 'chat' else 'prompt'}, {params.max_tokens} for the "
            "completion). Please reduce the length of the prompt or of max_tokens.",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    return GenerationRequest(
        kind, model, prompts, params, stream, include_usage, priority, chat_output, grammar_param
    )
