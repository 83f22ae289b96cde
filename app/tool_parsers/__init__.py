"""Tool-call parsers per model family, chosen from the chat template, and the streaming
wrapper that emits content until a call may begin and parses the calls when the output ends."""

from __future__ import annotations

from tandem.app.tool_parsers.base import ParsedOutput, ToolCall, ToolParser, new_call_id
from tandem.app.tool_parsers.deepseek import DeepSeekV3Parser
from tandem.app.tool_parsers.hermes import HermesParser
from tandem.app.tool_parsers.llama3 import Llama3JsonParser
from tandem.app.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser)
}

__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolCallStream", "ToolParser", "new_call_id",
           "parser_for_template"]  # fmt: skip


def parser_for_template(template: str | None) -> ToolParser | None:
    """The parser for the tool-call format a chat template teaches, or None."""
    if not template:
        return None
    if "tool▁calls▁begin" in template or "tool▁call▁begin" in template:
        return DeepSeekV3Parser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<tool_call>" in template:
        return HermesParser()
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or "tool" in template):
        return Llama3JsonParser()
    return None


class ToolCallStream:
    """Feeds on content deltas: returns the content that can be sent now, holding back text
    from where a call may begin; `finish` parses the whole output -> (content still to send,
    calls). Unparseable output is content, sent in full by `finish`."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._emitted = 0
        self._holding = False
        self._free = False  # at_start parsers: the output did not begin with a call

    def feed(self, delta: str) -> str:
        self.text += delta
        if self._holding:
            return ""
        if self._free:
            return self._emit(len(self.text))
        markers = self.parser.markers
        if self.parser.at_start:
            head = self.text.lstrip()
            if not head:
                return ""
            if any(head.startswith(m) for m in markers):
                self._holding = True
                return ""
            if any(m.startswith(head) for m in markers):
                return ""  # still could be a marker
            self._free = True
            return self._emit(len(self.text))
        hits = [i for i in (self.text.find(m, self._emitted) for m in markers) if i >= 0]
        if hits:
            self._holding = True
            return self._emit(min(hits))
        return self._emit(len(self.text) - _partial_marker(self.text, markers))

    def _emit(self, upto: int) -> str:
        out = self.text[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        parsed = self.parser.parse(self.text) if self._holding else ParsedOutput(self.text)
        if parsed.calls:
            return parsed.content[self._emitted :], parsed.calls
        return self.text[self._emitted :], ()


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best
