"""One chat choice's output shaped as OpenAI returns it: reasoning split from content, tool
calls parsed (auto) or read from the JSON a grammar forced (required, named), as stream deltas
and as the final message. Never raises on model output: what does not parse is content."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from tandem.app.harmony import HarmonyStream
from tandem.app.reasoning import ReasoningStream
from tandem.app.structured import ToolRequest
from tandem.app.tool_parsers import ToolCall, ToolCallStream, ToolParser, new_call_id


@dataclass(frozen=True)
class ChatOutputOptions:
    reasoning: bool = False  # split <think> ... </think> out
    harmony: bool = False  # GPT-OSS: split the analysis channel out, drop the framing
    starts_in_reasoning: bool = False  # the prompt opened the thought already
    tools: ToolRequest | None = None
    parser: ToolParser | None = None  # for tool_choice "auto"
    end_texts: tuple[str, ...] = ()  # EOS texts to cut where special tokens are kept
    call_id_style: str = "openai"  # "mistral": the 9-character ids its templates check

    @property
    def active(self) -> bool:
        return (
            self.reasoning
            or self.harmony
            or (self.tools is not None and self.tools.choice != "none")
        )


class ChatOutput:
    def __init__(self, options: ChatOutputOptions) -> None:
        self.o = options
        tools = options.tools
        self.mode = "plain"
        if tools is not None and tools.named is not None:
            self.mode = "named"
        elif tools is not None and tools.choice == "required":
            self.mode = "required"
        elif tools is not None and tools.choice == "auto" and options.parser is not None:
            self.mode = "auto"
        self._reasoning: ReasoningStream | HarmonyStream | None = None
        if options.harmony:
            calls = options.tools is not None and options.tools.choice == "auto"
            self._reasoning = HarmonyStream(capture_calls=calls)
        elif options.reasoning:
            self._reasoning = ReasoningStream(options.starts_in_reasoning)
        self._tools = ToolCallStream(options.parser) if self.mode == "auto" else None  # type: ignore[arg-type]
        self.reasoning_text = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self._raw = ""  # required/named: the forced JSON
        self._named_id = new_call_id(options.call_id_style)

    # -- streaming ------------------------------------------------------------------------

    def feed(self, text: str, last: bool = False) -> list[dict[str, Any]]:
        """New output text -> the deltas to send (each a chat `delta` object)."""
        if last:
            text = self._cut_end(text)
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._route(reasoning, content)

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The output ended -> the last deltas and the finish_reason to report."""
        out: list[dict[str, Any]] = []
        if self._reasoning is not None:
            out += self._route(*self._reasoning.finish())
        if isinstance(self._reasoning, HarmonyStream):
            out += self._new_calls(self._reasoning.calls)
        if self.mode == "auto":
            assert self._tools is not None
            tail, calls = self._tools.finish()
            out += self._content(tail)
            out += self._new_calls(calls)
        elif self.mode == "required":
            calls = _required_calls(self._raw)
            if calls is None:
                out += self._content(self._raw)
            out += self._new_calls(calls or ())
        if self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return out, finish_reason

    def _route(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reasoning:
            self.reasoning_text += reasoning
            out.append({"reasoning_content": reasoning})
        if not content:
            return out
        if self.mode == "auto":
            assert self._tools is not None
            out += self._content(self._tools.feed(content))
        elif self.mode == "required":
            self._raw += content
        elif self.mode == "named":
            out.append(self._named_fragment(content))
        else:
            out += self._content(content)
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content += text
        return [{"content": text}]

    def _named_fragment(self, text: str) -> dict[str, Any]:
        assert self.o.tools is not None and self.o.tools.named is not None
        first = not self._raw
        self._raw += text
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if first:
            call.update(id=self._named_id, type="function")
            call["function"]["name"] = self.o.tools.named
        if first or not self.calls:
            self.calls = [ToolCall(self.o.tools.named, self._raw, self._named_id)]
        else:
            self.calls[0] = ToolCall(self.o.tools.named, self._raw, self._named_id)
        return {"tool_calls": [call]}

    def _new_calls(self, calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            call = replace(call, id=new_call_id(self.o.call_id_style))
            index = len(self.calls)
            self.calls.append(call)
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ]
                }
            )
        return out

    def _cut_end(self, text: str) -> str:
        for end in self.o.end_texts:
            if end and text.endswith(end):
                return text[: -len(end)]
        return text

    # -- whole response -------------------------------------------------------------------

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        else:
            msg["content"] = self.content
        if self.o.reasoning or self.o.harmony:
            msg["reasoning_content"] = self.reasoning_text or None
        return msg


def _required_calls(raw: str) -> list[ToolCall] | None:
    """The forced `[{"name", "parameters"}, ...]` -> calls; None if it does not parse (cut by
    max_tokens)."""
    try:
        items = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(items, list):
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("parameters", {})
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls
