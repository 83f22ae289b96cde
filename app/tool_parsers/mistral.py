"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers), or
`[TOOL_CALLS]name[ARGS]{...}` repeated (v11 and later)."""

from __future__ import annotations

from tandem.app.tool_parsers.base import ParsedOutput, call_from_json, load_json

_TAG, _ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser:
    name = "mistral"
    markers = (_TAG,)
    at_start = False
    needs_special_tokens = True

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(_TAG)
        if start < 0:
            return ParsedOutput(text)
        content = text[:start].rstrip()
        calls = []
        for part in text[start:].split(_TAG)[1:]:
            part = part.strip().removesuffix("</s>").strip()
            if _ARGS in part:
                name, _, args = part.partition(_ARGS)
                call = call_from_json({"name": name.strip(), "arguments": load_json(args)})
                found = [call]
            else:
                items = load_json(part)
                items = items if isinstance(items, list) else [items]
                found = [call_from_json(item) for item in items]
            if not found or any(c is None for c in found):
                return ParsedOutput(text)
            calls.extend(found)
        return ParsedOutput(content, tuple(calls)) if calls else ParsedOutput(text)
