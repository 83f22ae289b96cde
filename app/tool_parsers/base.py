"""What every tool-call parser returns, and the JSON helpers they share.

A parser turns a model's whole output text into (content, calls). It never raises on model
output: text it cannot parse comes back as plain content with no calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


def new_call_id(style: str = "openai") -> str:
    """OpenAI's `call_` + 24 characters; Mistral's templates insist on 9 alphanumerics."""
    if style == "mistral":
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: a string
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: tuple[ToolCall, ...] = ()


class ToolParser(Protocol):
    name: str
    # where a call can begin; with `at_start`, only as the first thing in the output
    markers: tuple[str, ...]
    at_start: bool
    # the markers are special tokens that the detokenizer would drop
    needs_special_tokens: bool

    def parse(self, text: str) -> ParsedOutput: ...


def call_from_json(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """{"name": str, args_key: object or JSON string} -> a call; anything else -> None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def load_json(text: str) -> Any:
    """json.loads, None where the text is not JSON."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
