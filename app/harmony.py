"""GPT-OSS's harmony output (`<|channel|>analysis<|message|>...<|end|><|start|>assistant
<|channel|>final<|message|>...`): the analysis channel goes to `reasoning_content`, the final
(and commentary) channels to `content`, the framing tokens to neither, in whole responses and
in stream deltas. Needs the special tokens kept in the decoded text."""

from __future__ import annotations

from tandem.app.reasoning import partial_tag

CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
REASONING_CHANNELS = ("analysis",)


def template_is_harmony(template: str | None) -> bool:
    """Whether a chat template frames messages in harmony channels (GPT-OSS)."""
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


class HarmonyStream:
    """`feed(delta) -> (reasoning, content)` to send now, as `ReasoningStream` does. Text that
    may still be part of a framing token is held back until it can tell; text outside any
    message (a header, `<|start|>assistant`) is dropped. Output that never opens a channel is
    content, as it came."""

    def __init__(self) -> None:
        self._state = "start"  # start | header | body | between | plain
        self._buf = ""
        self._channel = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
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
                content.append(self._buf)
                self._buf = ""
                break
            if self._state in ("header", "between"):
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break
                header = self._buf[:at]
                name = header.rsplit(CHANNEL, 1)[-1] if CHANNEL in header else ""
                self._channel = name.split("<|", 1)[0].split(" ", 1)[0].strip()
                self._state, self._buf = "body", self._buf[at + len(MESSAGE) :]
            if self._state == "body":
                end, tag = _first(self._buf, ENDS)
                if end < 0:
                    keep = max(partial_tag(self._buf, t) for t in ENDS)
                    text = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(text) :]
                    (reasoning if self._in_reasoning else content).append(text)
                    break
                (reasoning if self._in_reasoning else content).append(self._buf[:end])
                self._state, self._buf = "between", self._buf[end + len(tag) :]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "body":
            return (rest, "") if self._in_reasoning else ("", rest)
        if self._state in ("start", "plain"):
            return "", rest.strip() if self._state == "start" else rest
        return "", ""  # an unfinished header: framing, not text

    @property
    def _in_reasoning(self) -> bool:
        return self._channel in REASONING_CHANNELS


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    found = [(i, t) for t in tags if (i := text.find(t)) >= 0]
    return min(found) if found else (-1, "")
