"""GPT-OSS's harmony output (`<|channel|>analysis<|message|>...<|end|><|start|>assistant
<|channel|>final<|message|>...`): the analysis channel goes to `reasoning_content`, the final
(and commentary) channels to `content`, messages addressed to a function to tool calls, the
framing tokens to none of them, in whole responses and in stream deltas. Needs the special
tokens kept in the decoded text."""

from __future__ import annotations

import json
import re

from tandem.app.reasoning import partial_tag
from tandem.app.tool_parsers.base import ToolCall, load_json

CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
REASONING_CHANNELS = ("analysis",)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def template_is_harmony(template: str | None) -> bool:
    """Whether a chat template frames messages in harmony channels (GPT-OSS)."""
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


class HarmonyStream:
    """`feed(delta) -> (reasoning, content)` to send now, as `ReasoningStream` does. Text that
    may still be part of a framing token is held back until it can tell; text outside any
    message (a header, `<|start|>assistant`) is dropped. Output that never opens a channel is
    content, as it came. With `capture_calls`, a message addressed `to=functions.NAME` whose
    body is a JSON object becomes a tool call (`calls`) rather than content."""

    def __init__(self, capture_calls: bool = False) -> None:
        self._state = "start"  # start | header | body | between | plain
        self._buf = ""
        self._channel = ""
        self._capture = capture_calls
        self._call: str | None = None  # the function the message in hand is addressed to
        self._args = ""
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        out: tuple[list[str], list[str]] = ([], [])
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(CHANNEL):
                    self._state, self._buf = "header", head
                elif CHANNEL.startswith(head):
                    break  # blank or a partial token: wait
                else:
                    self._state = "plain"
            if self._state == "plain":
                out[1].append(self._buf)
                self._buf = ""
                break
            if self._state in ("header", "between"):
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break
                self._open(self._buf[:at])
                self._state, self._buf = "body", self._buf[at + len(MESSAGE) :]
            if self._state == "body":
                end, tag = _first(self._buf, ENDS)
                if end < 0:
                    keep = max(partial_tag(self._buf, t) for t in ENDS)
                    self._take(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._take(self._buf[:end], out)
                self._close(out)
                self._state, self._buf = "between", self._buf[end + len(tag) :]
        return "".join(out[0]), "".join(out[1])

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        out: tuple[list[str], list[str]] = ([], [])
        if self._state == "body":
            self._take(rest, out)
            self._close(out)
        elif self._state in ("start", "plain"):
            out[1].append(rest.strip() if self._state == "start" else rest)
        # an unfinished header is framing, not text
        return "".join(out[0]), "".join(out[1])

    def _open(self, header: str) -> None:
        name = header.rsplit(CHANNEL, 1)[-1] if CHANNEL in header else ""
        self._channel = name.split("<|", 1)[0].split(" ", 1)[0].strip()
        to = _RECIPIENT.search(header) if self._capture else None
        self._call, self._args = (to.group(1) if to else None), ""

    def _take(self, text: str, out: tuple[list[str], list[str]]) -> None:
        if self._call is not None:
            self._args += text
        else:
            out[0 if self._channel in REASONING_CHANNELS else 1].append(text)

    def _close(self, out: tuple[list[str], list[str]]) -> None:
        """An addressed message ended: a call if its body is a JSON object, else content."""
        if self._call is None:
            return
        args = load_json(self._args)
        if isinstance(args, dict):
            self.calls.append(ToolCall(self._call, json.dumps(args, ensure_ascii=False)))
        else:
            out[1].append(self._args)
        self._call, self._args = None, ""


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    found = [(i, t) for t in tags if (i := text.find(t)) >= 0]
    return min(found) if found else (-1, "")
