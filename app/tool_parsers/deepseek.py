"""DeepSeek-V3 tool tokens: `<｜tool▁calls▁begin｜>` then per call either
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a ```json fenced object (V3, R1) or
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}` (V3.1), each closed by `<｜tool▁call▁end｜>`."""

from __future__ import annotations

import re

from tandem.app.tool_parsers.base import ParsedOutput, call_from_json, load_json

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCED = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


class DeepSeekV3Parser:
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALL_BEGIN)
    at_start = False
    needs_special_tokens = True

    def parse(self, text: str) -> ParsedOutput:
        starts = [i for i in (text.find(CALLS_BEGIN), text.find(CALL_BEGIN)) if i >= 0]
        if not starts:
            return ParsedOutput(text)
        start = min(starts)
        body = text[start:].replace(CALLS_BEGIN, "").split(CALLS_END)[0]
        calls = []
        for chunk in body.split(CALL_BEGIN)[1:]:
            chunk = chunk.split(CALL_END)[0]
            head, sep, rest = chunk.partition(SEP)
            if not sep:
                return ParsedOutput(text)
            if head.strip() == "function" and "\n" in rest:  # V3: type, then name, then fence
                name, _, args = rest.partition("\n")
            else:
                name, args = head, rest
            fenced = _FENCED.match(args)
            args_obj = load_json(fenced.group(1) if fenced else args.strip())
            call = call_from_json({"name": name.strip(), "arguments": args_obj})
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start].rstrip(), tuple(calls)) if calls else ParsedOutput(text)
