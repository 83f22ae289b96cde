"""Qwen2/Qwen2.5/Qwen3 and Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, after optional content."""

from __future__ import annotations

import re

from tandem.app.tool_parsers.base import ParsedOutput, call_from_json, load_json

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser:
    name = "hermes"
    markers = ("<tool_call>",)
    at_start = False
    needs_special_tokens = False

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for body in _BLOCK.findall(text[start:]):
            call = call_from_json(load_json(body.strip()))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start].rstrip(), tuple(calls))
