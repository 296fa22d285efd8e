"""Tool-call text: parsing finished replies, hiding markup while streaming, the fed-back messages."""

import json

import pytest

from agent.tools.calls import (
    ToolCall,
    ToolCallStreamFilter,
    parse_tool_calls,
    tool_result_message,
    tools_system_prompt,
)
from agent.tools.result import ToolResult


def test_one_well_formed_call() -> None:
    block = '<tool_call>{"name": "read_file", "arguments": {"path": "a.txt"}}</tool_call>'
    text, calls, errors = parse_tool_calls(block)
    assert text == ""
    assert calls == [ToolCall(name="read_file", arguments={"path": "a.txt"}, raw=block)]
    assert errors == []


def test_several_calls_in_order_with_text_around_them() -> None:
    reply = (
        "Let me look.\n"
        '<tool_call>\n  {"name": "list_dir",\n   "arguments": {}}\n</tool_call>\n'
        "and then\n"
        '<tool_call>{"name": "read_file", "arguments": {"path": "b"}}</tool_call>\n'
        "done.  "
    )
    text, calls, errors = parse_tool_calls(reply)
    assert [c.name for c in calls] == ["list_dir", "read_file"]
    assert calls[1].arguments == {"path": "b"}
    assert calls[0].raw.startswith("<tool_call>\n") and calls[0].raw.endswith("</tool_call>")
    assert text == "Let me look.\n\nand then\n\ndone."
    assert errors == []


def test_arguments_as_a_json_string_and_missing_arguments() -> None:
    reply = (
        '<tool_call>{"name": "recall", "arguments": "{\\"query\\": \\"cats\\"}"}</tool_call>'
        '<tool_call>{"name": "list_dir"}</tool_call>'
    )
    _, calls, errors = parse_tool_calls(reply)
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("recall", {"query": "cats"}), ("list_dir", {})]


def test_a_list_of_calls_in_one_block() -> None:
    """SmolLM2's own tool format puts a JSON list of calls inside one block."""
    block = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>'
    _, calls, errors = parse_tool_calls(block)
    assert errors == []
    assert [(c.name, c.arguments, c.raw) for c in calls] == [("a", {}, block), ("b", {"x": 1}, block)]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('{"name": "read_file", "arguments": {"path": }}', "invalid JSON"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": "  ", "arguments": {}}', 'missing "name"'),
        ('{"name": "x", "arguments": [1, 2]}', '"arguments" must be an object, got a list'),
        ('{"name": "x", "arguments": "not json"}', '"arguments" is a string but not valid JSON'),
        ('{"name": "x", "arguments": "[1]"}', '"arguments" must be an object'),
        ('"read_file"', "expected an object"),
        ("[]", "empty list"),
    ],
)
def test_malformed_blocks_are_reported_and_the_rest_still_parse(body: str, fragment: str) -> None:
    reply = f'before <tool_call>{body}</tool_call> <tool_call>{{"name": "ok"}}</tool_call> after'
    text, calls, errors = parse_tool_calls(reply)
    assert [c.name for c in calls] == ["ok"]
    assert len(errors) == 1
    assert errors[0].startswith("tool call 1: ") and fragment in errors[0]
    assert "\n" not in errors[0]
    assert text == "before   after"


def test_unterminated_final_block_is_an_error_not_dropped() -> None:
    """The model hit max tokens mid-call: the loop must hear about it, and no half call runs."""
    reply = 'Sure.<tool_call>{"name": "read_file"}</tool_call>\n<tool_call>{"name": "shell", "argu'
    text, calls, errors = parse_tool_calls(reply)
    assert [c.name for c in calls] == ["read_file"]
    assert errors == ["tool call 2: <tool_call> was never closed with </tool_call>"]
    assert text == "Sure."


def test_text_without_calls_passes_unchanged() -> None:
    assert parse_tool_calls("  a < b and c > d  ") == ("a < b and c > d", [], [])


def _stream(chunks: list[str]) -> str:
    f = ToolCallStreamFilter()
    return "".join(f.feed(c) for c in chunks) + f.flush()


REPLY = 'Looking.\n<tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call>\nThen a < b.'


@pytest.mark.parametrize("split", range(1, len(REPLY)))
def test_filter_hides_a_block_split_at_any_position(split: int) -> None:
    shown = _stream([REPLY[:split], REPLY[split:]])
    assert shown == "Looking.\n\nThen a < b."


def test_filter_hides_a_block_streamed_one_character_at_a_time() -> None:
    f = ToolCallStreamFilter()
    shown: list[str] = []
    for ch in REPLY:
        out = f.feed(ch)
        assert "<tool" not in "".join(shown) + out
        shown.append(out)
    shown.append(f.flush())
    assert "".join(shown) == "Looking.\n\nThen a < b."


def test_filter_output_equals_parsed_text() -> None:
    reply = 'a<tool_call>{"name": "x"}</tool_call>b<tool_call>{"name": "y"}</tool_call>c'
    assert _stream(list(reply)) == parse_tool_calls(reply)[0] == "abc"


def test_filter_holds_only_what_could_be_a_tag() -> None:
    f = ToolCallStreamFilter()
    assert f.feed("a <") == "a "  # could be the start of <tool_call>
    assert f.feed(" b") == "< b"  # it was not
    assert f.feed("x <tool_") == "x "
    assert f.feed("kit>") == "<tool_kit>"
    assert f.feed("<<tool") == "<"
    assert f.feed("_call>{") == ""
    assert f.in_tool_call
    assert f.feed('"name": "x"}</tool_') == ""
    assert f.feed("call> after") == " after"
    assert not f.in_tool_call


def test_filter_flush_releases_a_false_alarm_but_not_an_open_block() -> None:
    f = ToolCallStreamFilter()
    assert f.feed("ends with <tool_c") == "ends with "
    assert f.flush() == "<tool_c"
    g = ToolCallStreamFilter()
    assert g.feed('ok <tool_call>{"name": "shell", "arg') == "ok "
    assert g.flush() == ""


def test_tool_result_message_is_a_hermes_tool_response() -> None:
    call = ToolCall(name="read_file", arguments={"path": "a"}, raw="")
    message = tool_result_message(call, ToolResult(ok=True, content='line "1"\nline 2 — ok'))
    assert message["role"] == "tool"
    content = message["content"]
    assert content.startswith("<tool_response>\n") and content.endswith("\n</tool_response>")
    inner = content.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
    assert json.loads(inner) == {"name": "read_file", "content": 'line "1"\nline 2 — ok'}


def test_tools_system_prompt_lists_each_spec_and_the_call_format() -> None:
    specs = [
        {
            "type": "function",
            "function": {"name": "a", "description": "A.", "parameters": {"type": "object"}},
        },
        {
            "type": "function",
            "function": {"name": "b", "description": "B.", "parameters": {"type": "object"}},
        },
    ]
    prompt = tools_system_prompt(specs)
    listed = prompt[prompt.index("<tools>\n") + len("<tools>\n") : prompt.index("\n</tools>")]
    assert [json.loads(line) for line in listed.splitlines()] == specs
    assert "<tool_call>" in prompt and "</tool_call>" in prompt and "<tool_response>" in prompt
    assert tools_system_prompt([]) == ""
