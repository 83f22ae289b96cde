"""The OpenAPI 3 document served at /openapi.json: the REST endpoints and their request schemas.

Request schemas mirror what `app/protocol.py` accepts (and forbid other fields, as it does),
so a generator such as schemathesis can produce valid and invalid requests from it.
"""

from __future__ import annotations

from typing import Any

from tandem.runtime.limits import (
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_N,
    MAX_NAME_CHARS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)


def _num(lo: float, hi: float, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi, "nullable": True, **extra}


def _int(lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer", "nullable": True}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


_STOP = {
    "nullable": True,
    "description": f"at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all",
    "oneOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
            "maxItems": MAX_STOP_STRINGS,
        },
    ],
}

_COMMON: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": _int(1),
    "n": _int(1, MAX_N),
    "stop": _STOP,
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {
        "type": "object",
        "nullable": True,
        "additionalProperties": False,
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "temperature": _num(0, 100),  # SamplingParams accepts up to 100 (OpenAI documents 2)
    "top_p": _num(0, 1, exclusiveMinimum=True),
    "top_k": _int(-1),
    "min_p": _num(0, 1),
    "seed": _int(-(2**63), 2**64 - 1),  # the range SamplingParams accepts
    "presence_penalty": _num(-2, 2),
    "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(1e-6, 10),  # smaller ones are 0 in float32
    "ignore_eos": {"type": "boolean", "nullable": True},
    "min_tokens": _int(0),
    "stop_token_ids": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0},
        "maxItems": MAX_STOP_TOKEN_IDS,
        "nullable": True,
        "description": "token ids in the model's vocabulary",
    },
    "user": {"type": "string", "nullable": True},
    # accepted and checked, but they change nothing here
    "store": {"type": "boolean", "nullable": True},
    "service_tier": {"type": "string", "nullable": True},
    "parallel_tool_calls": {"type": "boolean", "nullable": True},
    "metadata": {
        "type": "object",
        "nullable": True,
        "maxProperties": MAX_METADATA_PAIRS,
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS},
        "description": "string keys of at most 64 characters to strings",
    },
}

_LOGIT_BIAS = {
    "type": "object",
    "nullable": True,
    "maxProperties": MAX_LOGIT_BIAS,
    "propertyNames": {"pattern": "^[0-9]{1,6}$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
}
_RESPONSE_FORMAT = {
    "nullable": True,
    "oneOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"type": "string", "enum": ["json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": "boolean", "nullable": True},
                    },
                },
            },
        },
    ],
}
# vLLM's constraint kinds: each a `guided_<kind>` field and a member of `structured_outputs`
_CONSTRAINTS: dict[str, Any] = {
    "json": {"type": "object", "nullable": True},
    "regex": {"type": "string", "minLength": 1, "nullable": True},
    "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}, "nullable": True},
    "grammar": {"type": "string", "minLength": 1, "nullable": True},
}
_GUIDED: dict[str, Any] = {
    **{f"guided_{kind}": schema for kind, schema in _CONSTRAINTS.items()},
    "structured_outputs": {
        "type": "object",
        "nullable": True,
        "additionalProperties": False,
        "maxProperties": 1,
        # a null member is ignored by the server (app/structured.py), as vLLM does
        "properties": {**_CONSTRAINTS, "json_object": {"type": "boolean", "nullable": True}},
    },
}
_TOOLS = {
    "type": "array",
    "nullable": True,
    "items": {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                },
            },
        },
    },
}
_TOOL_CHOICE = {
    "nullable": True,
    "oneOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
    ],
}

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {
            "type": "string",
            "enum": ["system", "developer", "user", "assistant", "tool"],
        },
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "maxItems": MAX_CONTENT_PARTS,
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"type": "string", "enum": ["text"]},
                            "text": {"type": "string"},
                        },
                    },
                },
            ]
        },
        "name": {"type": "string", "maxLength": MAX_NAME_CHARS},
        "tool_call_id": {"type": "string"},
    },
}

CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "additionalProperties": False,
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _MESSAGE},
        "max_completion_tokens": _int(1),
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": _int(0, MAX_TOP_LOGPROBS),
        "logit_bias": _LOGIT_BIAS,
        "response_format": _RESPONSE_FORMAT,
        **_GUIDED,
        "tools": _TOOLS,
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": {"type": "boolean", "nullable": True},
        "chat_template_kwargs": {
            "type": "object",
            "nullable": True,
            "additionalProperties": False,
            "properties": {"enable_thinking": {"type": "boolean"}, "thinking": {"type": "boolean"}},
        },
    },
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
        **_COMMON,
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                    "items": {"type": "string", "minLength": 1},
                },
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                    "items": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "integer", "minimum": 0},
                    },
                },
            ]
        },
        "logprobs": _int(0, MAX_TOP_LOGPROBS),
        "logit_bias": _LOGIT_BIAS,
        "response_format": _RESPONSE_FORMAT,
        **_GUIDED,
    },
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}


# One server-sent event: `data:` holds a JSON chunk, or `[DONE]` last.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


def _responses(ok: str, *errors: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "200": {
            "description": ok,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": _SSE_EVENT},
            },
        }
    }
    for status in errors:
        out[str(status)] = {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    return out


def _post(summary: str, schema_ref: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}
                },
            },
            "responses": _responses(
                "a response, or an SSE stream when stream is true",
                400,
                401,
                404,
                408,
                413,
                415,
                429,
                500,
                503,
            ),
        }
    }


def _with_model(request_schema: dict[str, Any], model_names: tuple[str, ...]) -> dict[str, Any]:
    props = {**request_schema["properties"], "model": {"type": "string", "enum": list(model_names)}}
    return {**request_schema, "properties": props}


def build_openapi(model_names: tuple[str, ...], secured: bool) -> dict[str, Any]:
    """The document for a server answering to `model_names` (the served name first)."""
    model_name = model_names[0]
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "Tandem",
            "version": "0.1.0",
            "description": f"OpenAI-compatible inference server serving {model_name}.",
        },
        "paths": {
            "/v1/chat/completions": _post("Create a chat completion", "ChatCompletionRequest"),
            "/v1/completions": _post("Create a completion", "CompletionRequest"),
            "/v1/models": {
                "get": {"summary": "List models", "responses": _responses("models", 401)}
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "Retrieve a model",
                    "parameters": [
                        {
                            "name": "model_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": _responses("the model", 401, 404),
                }
            },
            "/version": {
                "get": {"summary": "Tandem's version", "responses": _responses("version", 401)}
            },
            "/tokenize": _post("Tokenize a prompt or chat messages", "TokenizeRequest"),
            "/detokenize": _post("Text of token ids", "DetokenizeRequest"),
            "/v1/requests/{request_id}/cancel": {
                "post": {
                    "summary": "Cancel a running request by its completion id",
                    "parameters": [
                        {
                            "name": "request_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": _responses("cancelled", 401, 404),
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness",
                    "security": [],
                    "responses": {
                        **_responses("healthy"),
                        "503": {"description": "draining or dead"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Prometheus text",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "ChatCompletionRequest": _with_model(CHAT_REQUEST, model_names),
                "CompletionRequest": _with_model(COMPLETION_REQUEST, model_names),
                "Error": _ERROR,
                "TokenizeRequest": {
                    "type": "object",
                    "properties": {
                        "model": {"type": "string", "enum": list(model_names)},
                        "prompt": {"type": "string"},
                        "messages": CHAT_REQUEST["properties"]["messages"],
                        "add_special_tokens": {"type": "boolean"},
                    },
                    "additionalProperties": False,
                },
                "DetokenizeRequest": {
                    "type": "object",
                    "required": ["tokens"],
                    "properties": {
                        "model": {"type": "string", "enum": list(model_names)},
                        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    },
                    "additionalProperties": False,
                },
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    if secured:
        doc["security"] = [{"bearer": []}]
    return doc
