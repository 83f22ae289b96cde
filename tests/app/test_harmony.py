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
    assert out.message() == {
        "role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT,
    }  # fmt: skip


CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    "<|call|>"
)


def test_a_message_to_a_function_is_a_tool_call_when_tools_are_offered() -> None:
    from tandem.app.structured import ToolRequest

    tools = ToolRequest(({"type": "function", "function": {"name": "get_weather"}},), "auto")
    out = ChatOutput(ChatOutputOptions(harmony=True, tools=tools))
    deltas = [d for ch in CALL for d in out.feed(ch)]
    rest, reason = out.finish("stop")
    assert reason == "tool_calls"
    assert not any("content" in d for d in deltas + rest)
    (call,) = [d["tool_calls"][0] for d in rest if "tool_calls" in d]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    msg = out.message()
    assert msg["reasoning_content"] == "Need the weather." and msg["content"] is None
    stream = HarmonyStream(capture_calls=True)
    text = CALL.replace('{"city": "Oslo"}', "not json")
    assert (stream.feed(text), stream.finish(), stream.calls) == (
        ("Need the weather.", "not json"),
        ("", ""),
        [],
    )
    assert _run(CALL, [1]) == ("Need the weather.", '{"city": "Oslo"}')  # no tools: content


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
