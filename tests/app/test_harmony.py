"""GPT-OSS harmony output split into reasoning_content and content (app/harmony.py), whole
and streamed in every chunking, and chosen for a harmony chat template."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.app.chat_output import ChatOutput, ChatOutputOptions
from tandem.app.harmony import HarmonyStream, template_is_harmony
from tandem.app.protocol import _chat_output

THOUGHT = "The user asks 2+2. <b>Easy</b>: 4."
ANSWER = "2 + 2 = 4 (a <|partial tag in text stays)."
OUTPUT = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
TEMPLATE = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{% endfor %}"


def _run(text: str, sizes: list[int]) -> tuple[str, str]:
    stream, reasoning, content, at, i = HarmonyStream(), "", "", 0, 0
    while at < len(text):
        n = sizes[i % len(sizes)]
        r, c = stream.feed(text[at : at + n])
        reasoning, content, at, i = reasoning + r, content + c, at + n, i + 1
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("sizes", [[len(OUTPUT)], [1], [2, 5], [3, 1, 7], [11]])
def test_channels_split_in_any_chunking(sizes: list[int]) -> None:
    assert _run(OUTPUT, sizes) == (THOUGHT, ANSWER)


def test_output_without_channels_is_content_and_commentary_is_content() -> None:
    assert _run("  just text", [1]) == ("", "  just text")  # as it came
    commentary = (
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>final<|message|>done"
    )
    assert _run(commentary, [1]) == ("", "{}done")


def test_cut_off_output_keeps_what_was_said() -> None:
    assert _run("<|channel|>analysis<|message|>thinking hard", [4]) == ("thinking hard", "")
    assert _run(OUTPUT[: OUTPUT.index(ANSWER) + 5], [3]) == (THOUGHT, ANSWER[:5])
    assert _run("<|channel|>analysis<|mess", [2]) == ("", "")  # a header only: framing


def test_chat_output_sends_reasoning_then_content_deltas() -> None:
    out = ChatOutput(ChatOutputOptions(harmony=True))
    deltas = [d for ch in OUTPUT for d in out.feed(ch)]
    rest, reason = out.finish("stop")
    assert reason == "stop" and not rest
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    assert (out.reasoning_text, out.content) == (THOUGHT, ANSWER)


def test_a_harmony_template_keeps_special_tokens_unless_a_grammar_constrains() -> None:
    assert template_is_harmony(TEMPLATE) and not template_is_harmony("{{ '<think>' }}")
    tok = SimpleNamespace(
        chat_template=TEMPLATE, eos_token_ids=(7,), decode=lambda ids, **_: "<|return|>"
    )
    kwargs: dict = {}
    opts = _chat_output(tok, None, "<|start|>assistant", kwargs, constrained=False)
    assert opts.harmony and opts.active and kwargs["skip_special_tokens"] is False
    assert opts.end_texts == ("<|return|>",)
    kwargs = {}
    opts = _chat_output(tok, None, "<|start|>assistant", kwargs, constrained=True)
    assert not opts.harmony and "skip_special_tokens" not in kwargs
