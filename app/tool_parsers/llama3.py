"""Llama 3.x JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), or several such objects separated by `;`."""

from __future__ import annotations

import json

from tandem.app.tool_parsers.base import ParsedOutput, call_from_json

_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"
    markers = ("{", _TAG)
    at_start = True
    needs_special_tokens = False

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG) :].lstrip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        try:
            while pos < len(body):
                obj, end = decoder.raw_decode(body, pos)
                call = call_from_json(obj, "parameters")
                if call is None:
                    return ParsedOutput(text)
                calls.append(call)
                pos = end
                while pos < len(body) and body[pos] in " \t\r\n;":
                    pos += 1
        except (json.JSONDecodeError, RecursionError):
            return ParsedOutput(text)
        return ParsedOutput("", tuple(calls))
