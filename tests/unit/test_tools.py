"""Tool calling's pure parts: the tools and tool_choice fields, the forced-call schemas, the
Hermes parser and the messages templates read."""

import json

import pytest

from services.router.tools import ToolError, ToolStream, hermes, message, parse_tools, template_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_choice_defaults_to_auto_and_a_named_choice_must_exist():
    assert parse_tools({}) is None and parse_tools({"tool_choice": "none"}) is None
    assert parse_tools({"tools": [WEATHER]}).choice == "auto"
    named = parse_tools(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    assert (named.choice, named.name, named.names) == ("named", "get_time", ["get_weather", "get_time"])
    for body, match in (
        ({"tool_choice": "auto"}, "needs `tools`"),
        ({"tools": []}, "list of 1 to"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, r"tools\[0\]"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "no tool is named 'x'"),
    ):
        with pytest.raises(ToolError, match=match):
            parse_tools(body)


def test_forced_choices_constrain_the_output_to_the_call():
    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert json.loads(named.constraint().json_schema) == WEATHER["function"]["parameters"]
    required = json.loads(parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).constraint().json_schema)
    assert required["type"] == "array" and required["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}  # no parameters given
    assert parse_tools({"tools": [WEATHER]}).constraint() is None


def test_outputs_become_calls_by_choice():
    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    content, calls, called = message(named, '{"city": "Oslo"}')
    assert (
        content is None
        and not called
        and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    )
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    content, calls, called = message(
        required, '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    )
    assert called and content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"}
    assert message(parse_tools({"tools": [WEATHER], "tool_choice": "none"}), "<tool_call>x") == (
        "<tool_call>x",
        [],
        False,
    )


def test_hermes_reads_tool_call_blocks_and_keeps_the_text_before_them():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls, called = hermes(text, {"get_weather", "get_time"})
    assert called and content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert hermes("<tool_call>{not json}</tool_call>", {"get_time"}) == ("<tool_call>{not json}</tool_call>", [], False)
    assert hermes('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', {"get_time"})[2] is False  # not offered
    assert hermes("plain answer", {"get_time"}) == ("plain answer", [], False)


def test_templates_read_an_assistants_call_arguments_as_objects():
    msgs = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
    ]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and out[1] == msgs[1]
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the request is not changed


def stream(tools, pieces):
    ts, content, deltas = ToolStream(tools), [], []
    for p in pieces:
        c, d = ts.feed(p)
        content.append(c)
        deltas += d
    c, d, called = ts.finish()
    return content + [c], deltas + d, called


def test_an_auto_stream_sends_content_at_once_and_holds_only_a_possible_tag():
    auto = parse_tools({"tools": [WEATHER, TIME]})
    content, deltas, called = stream(
        auto, ["Let me ", "check.<tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    )
    assert content[:2] == ["Let me ", "check."] and "".join(content) == "Let me check."
    assert called and [d["function"]["name"] for d in deltas] == ["get_time"] and deltas[0]["index"] == 0
    content, deltas, called = stream(auto, ["a < b and x", " <tool", " is not a tag"])
    assert "".join(content) == "a < b and x <tool is not a tag" and content[1] == " " and not deltas and not called
    content, _, called = stream(auto, ["<tool_call>{broken"])
    assert "".join(content) == "<tool_call>{broken" and not called  # an unreadable call stays content


def test_a_named_stream_sends_the_arguments_as_they_come_and_required_at_the_end():
    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    content, deltas, called = stream(named, ['{"city"', ': "Oslo"}'])
    assert "".join(content) == "" and not called
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"city"'} and deltas[0]["id"]
    assert deltas[1] == {"index": 0, "function": {"arguments": ': "Oslo"}'}}
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    content, deltas, called = stream(required, ['[{"name": "get_time", ', '"parameters": {}}]'])
    assert content == ["", "", ""] and called and deltas[0]["function"] == {"name": "get_time", "arguments": "{}"}
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert stream(none, ["<tool_call>", "x"]) == (["<tool_call>", "x", ""], [], False)
