"""Tool-call and reasoning parsers on recorded outputs of each format, malformed ones included:
what does not parse is plain content, never an exception; streamed and whole parses agree."""

from __future__ import annotations

import json

import pytest

from tandem.app.chat_output import ChatOutput, ChatOutputOptions
from tandem.app.reasoning import ReasoningStream
from tandem.app.structured import ToolRequest
from tandem.app.tool_parsers import (
    PARSERS,
    ToolCallStream,
    parser_for_template,
)
from tandem.app.tool_parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

W = {"city": "Paris", "unit": "c"}
WJ = json.dumps(W)

# (parser, output, expected content, expected [(name, args)])
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WJ}}}\n</tool_call>', "",
     [("get_weather", W)]),
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n'
     f'<tool_call>\n{{"name": "b", "arguments": {WJ}}}\n</tool_call>', "Let me check.",
     [("a", {}), ("b", W)]),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1</tool_call>',  # truncated JSON
     '<tool_call>\n{"name": "a", "arguments": {"x": 1</tool_call>', []),
    ("hermes", '<tool_call>\n["not", "a", "call"]\n</tool_call>',
     '<tool_call>\n["not", "a", "call"]\n</tool_call>', []),
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>', "",
     [("a", {"x": 2})]),  # arguments as a JSON string
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WJ}}}', "", [("get_weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "f", "parameters": {{}}}}; {{"name": "g", '
     f'"parameters": {WJ}}}', "", [("f", {}), ("g", W)]),
    ("llama3_json", "The answer is {not json}", "The answer is {not json}", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),
    ("llama3_json", '{"title": "no name key"}', '{"title": "no name key"}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WJ}}}]</s>', "",
     [("get_weather", W)]),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "a", "arguments": {{}}}}, {{"name": "b", '
     f'"arguments": {WJ}}}]', "Sure.", [("a", {}), ("b", W)]),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{WJ}[TOOL_CALLS]a[ARGS]{{}}", "",
     [("get_weather", W), ("a", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {', '[TOOL_CALLS] [{"name": "a", "arguments": {', []),
    ("deepseek_v3", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{WJ}\n```"
     f"{CALL_END}{CALLS_END}", "", [("get_weather", W)]),
    ("deepseek_v3", f"Checking.{CALLS_BEGIN}{CALL_BEGIN}a{SEP}{{}}{CALL_END}{CALL_BEGIN}b{SEP}"
     f"{WJ}{CALL_END}{CALLS_END}", "Checking.", [("a", {}), ("b", W)]),
    ("deepseek_v3", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{\"a\": ",
     f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{\"a\": ", []),
    ("deepseek_v3", f"{CALLS_BEGIN}{CALL_BEGIN}no separator{CALL_END}",
     f"{CALLS_BEGIN}{CALL_BEGIN}no separator{CALL_END}", []),
]  # fmt: skip


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_output(name: str, text: str, content: str, calls: list) -> None:
    parsed = PARSERS[name]().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_in_pieces_matches_whole(name, text, content, calls, step) -> None:
    stream = ToolCallStream(PARSERS[name]())
    sent = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    tail, got = stream.finish()
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if calls:
        assert (sent + tail).rstrip() == content
    else:
        assert sent + tail == text  # unparsed: every character comes through as content


def test_parser_chosen_from_the_template() -> None:
    assert parser_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for_template("[TOOL_CALLS] {{ x }}").name == "mistral"
    assert parser_for_template("<｜tool▁calls▁begin｜>").name == "deepseek_v3"
    llama = "<|start_header_id|>ipython<|end_header_id|>{% if tools %}{% endif %}"
    assert parser_for_template(llama).name == "llama3_json"
    assert parser_for_template("{{ messages }}") is None
    assert parser_for_template(None) is None


@pytest.mark.parametrize("step", [1, 2, 5, 100])
@pytest.mark.parametrize(
    "text, starts_in, reasoning, content",
    [
        ("<think>\nI add.\n</think>\n\nIt is 4.", False, "\nI add.\n", "It is 4."),
        ("It is 4.", False, "", "It is 4."),
        ("I add.\n</think>\n\nIt is 4.", True, "I add.\n", "It is 4."),  # R1: prompt opened it
        ("<think>still thinking when cut", False, "still thinking when cut", ""),
        ("<thin", False, "", "<thin"),
        ("a < b </thin and more", True, "a < b </thin and more", ""),
    ],
)
def test_reasoning_split(step, text, starts_in, reasoning, content) -> None:
    rs = ReasoningStream(starts_in)
    got_r, got_c = "", ""
    for i in range(0, len(text), step):
        r, c = rs.feed(text[i : i + step])
        got_r, got_c = got_r + r, got_c + c
    r, c = rs.finish()
    assert (got_r + r, got_c + c) == (reasoning, content)


def _tools(choice: str = "auto") -> ToolRequest:
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    return ToolRequest(({"type": "function", "function": fn},), choice)


def test_chat_output_auto_with_reasoning_and_calls() -> None:
    opts = ChatOutputOptions(
        reasoning=True, tools=_tools(), parser=PARSERS["hermes"](), end_texts=("<|im_end|>",)
    )
    out = ChatOutput(opts)
    text = f'<think>need weather</think>\n\n<tool_call>{{"name": "get_weather", "arguments": {WJ}}}</tool_call><|im_end|>'
    deltas = [
        d for i in range(0, len(text), 4) for d in out.feed(text[i : i + 4], i + 4 >= len(text))
    ]
    more, finish = out.finish("stop")
    deltas += more
    assert finish == "tool_calls"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
    assert not any(d.get("content") for d in deltas)
    (call,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert call["index"] == 0 and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == W
    msg = out.message()
    assert msg["content"] is None and msg["reasoning_content"] == "need weather"
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_chat_output_required_cut_by_length_falls_back_to_content() -> None:
    out = ChatOutput(ChatOutputOptions(tools=_tools("required")))
    out.feed('[{"name": "get_weather", "param')
    deltas, finish = out.finish("length")
    assert finish == "length"
    assert deltas == [{"content": '[{"name": "get_weather", "param'}]
    assert out.message() == {"role": "assistant", "content": '[{"name": "get_weather", "param'}


def test_chat_output_named_streams_argument_fragments() -> None:
    out = ChatOutput(ChatOutputOptions(tools=_tools("get_weather")))
    first = out.feed('{"city": ')
    second = out.feed('"Paris"}')
    _, finish = out.finish("stop")
    assert finish == "tool_calls"
    assert first[0]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": ',
    }
    assert second[0]["tool_calls"][0] == {"index": 0, "function": {"arguments": '"Paris"}'}}
    assert out.message()["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
