"""Request fields that constrain the output, as a `GrammarSpec`: `response_format`, vLLM's
`structured_outputs` / `guided_*` extras, and the JSON that `tool_choice` "required" or a named
function forces. Also validates `tools` and `tool_choice` themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.app.errors import APIError
from tandem.runtime.sampling_params import GrammarSpec

# vLLM's extra fields (old guided_* names and the newer structured_outputs object)
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_FIELDS = {"response_format", "structured_outputs", *_GUIDED}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise _bad(param, f"'{param}' is not valid JSON") from None
    if not isinstance(schema, (dict, bool)):
        raise _bad(param, f"'{param}' must be a JSON schema object")
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict):
        raise _bad("response_format", "'response_format' must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", "'json_schema' must be an object")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad("response_format.json_schema.name", "'name' must be a string")
        schema = js.get("schema", {"type": "object"})
        return _json_schema_spec(schema, "response_format.json_schema.schema")
    raise _bad(
        "response_format.type",
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
    )


def _guided(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        return _json_schema_spec(value, param)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise _bad(param, f"'{param}' must be a non-empty string")
        return GrammarSpec(kind, value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _bad(param, f"'{param}' must be a non-empty list of strings")
        return GrammarSpec("choice", json.dumps(value))
    raise _bad(param, f"unknown structured output kind {kind!r}")


def output_grammar(body: dict[str, Any]) -> tuple[str, GrammarSpec] | None:
    """The one constraint the body asks for, with the field that set it (None: free text);
    two at once is a 400."""
    found: list[tuple[str, GrammarSpec]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _guided(kind, body[name], name)))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "'structured_outputs' must be an object")
        for kind, value in so.items():
            if kind == "json_object":
                if value not in (None, False, True):
                    raise _bad("structured_outputs.json_object", "'json_object' is a boolean")
                if value:
                    found.append(("structured_outputs.json_object", GrammarSpec("json_object")))
                continue
            if kind not in ("json", "regex", "choice", "grammar"):
                raise APIError(
                    400,
                    f"structured_outputs.{kind} is not supported "
                    "(json, json_object, regex, choice, grammar)",
                    param=f"structured_outputs.{kind}",
                    code="unsupported_parameter",
                )
            if value is not None:
                found.append((f"structured_outputs.{kind}", _guided(kind, value, kind)))
    if len(found) > 1:
        raise _bad(found[1][0], f"only one output constraint per request; also got {found[0][0]}")
    return found[0] if found else None


# -- tools ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRequest:
    """What the request says about tools. `choice`: "none", "auto", "required" or a function
    name (named). `tools` keep the client's OpenAI shape, for the chat template."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool = True

    @property
    def named(self) -> str | None:
        return None if self.choice in ("none", "auto", "required") else self.choice

    def function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "'tools' must be a list")
    names: list[str] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise _bad(where, f"'{where}' must be {{'type': 'function', 'function': {{...}}}}")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{where}.function.name", "every tool needs a function with a name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "'parameters' must be a JSON schema")
        if fn["name"] in names:
            raise _bad(f"{where}.function.name", f"duplicate tool name {fn['name']!r}")
        names.append(fn["name"])
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise _bad("tool_choice", "a named tool_choice is {'type': 'function', ...}")
        choice = fn.get("name")
        if choice not in names:
            raise _bad("tool_choice.function.name", f"no tool named {choice!r} in 'tools'")
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", "'tool_choice' must be none, auto, required or a function")
    normalized = tuple(
        {"type": "function", "function": {**t["function"], "parameters": _params(t["function"])}}
        for t in tools
    )
    return ToolRequest(normalized, choice, True if parallel is None else parallel)


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def tool_grammar(tools: ToolRequest) -> GrammarSpec | None:
    """A named function: its arguments object. "required": a JSON array of
    {"name", "parameters"} calls (one with parallel_tool_calls false). Else None."""
    if tools.named is not None:
        return _json_schema_spec(tools.function(tools.named)["parameters"], "tool_choice")
    if tools.choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"]["parameters"],
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools.tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not tools.parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))
