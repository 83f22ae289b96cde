"""Reasoning output (Qwen3 and DeepSeek-R1 `<think>` ... `</think>`): the thought goes to
`reasoning_content`, the rest to `content`, in whole responses and in stream deltas."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(template: str | None) -> bool:
    """Whether a chat template belongs to a model that thinks in `<think>` tags."""
    return bool(template) and CLOSE in template  # type: ignore[operator]


class ReasoningStream:
    """`feed(delta) -> (reasoning, content)` to send now; text that may still be part of a
    tag is held back until `finish()`. `in_reasoning`: the prompt already opened the thought
    (DeepSeek-R1's template ends with `<think>`)."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self._state, self._buf = "reasoning", head[len(OPEN) :]
            elif OPEN.startswith(head):
                return "", ""  # blank or a partial tag: wait
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buf.find(CLOSE)
            if end < 0:
                keep = partial_tag(self._buf, CLOSE)
                reasoning, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[-keep:] if keep else "",
                )
                return reasoning, ""
            reasoning = self._buf[:end]
            self._state, self._buf = "after", self._buf[end + len(CLOSE) :]
        if self._state == "after":  # drop the blank lines the model puts after the tag
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return reasoning, ""
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return rest, ""
        return "", rest.lstrip() if self._state == "start" else rest


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
