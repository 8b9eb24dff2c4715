"""Tool calling through the OpenAI-compatible chat API and the official `openai` client:
tools reach the chat template, forced choices come back as calls whose arguments match the
function's schema (streamed too), and bad tool fields are 400s naming the field."""

import json
import re

import openai
import pytest

from tests.contract.test_openai_api import greedy, http_api, idle, raw_post

TEMPLATE = (
    "{% if tools %}# tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}# {{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}"
)
UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
            "required": ["unit", "ok"],
        },
    },
}
PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {"host": {"enum": ["a", "b"]}}, "required": ["host"]},
    },
}
ASK = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def chat(tiny_engine, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tools") / "template.jinja"
    tpl.write_text(TEMPLATE)
    with http_api(tiny_engine, chat_template=tpl, served_model_name="tiny") as (port, servicer):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60), servicer


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_a_named_tool_choice_returns_a_call_whose_arguments_match_its_schema(chat):
    client, servicer = chat
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[UNIT, PING], tool_choice=named("set_unit"), max_tokens=40, temperature=0
    )
    c = out.choices[0]
    assert c.message.content is None and c.finish_reason == "stop"  # OpenAI's answer to a forced call
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "set_unit" and call.type == "function" and call.id.startswith("call_")
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["ok"], bool)
    assert idle(servicer)


def test_a_streamed_forced_call_streams_its_arguments(chat):
    """The first tool-call delta names the function; the arguments follow piece by piece and
    join to the unstreamed answer's."""
    client, _ = chat
    kw = dict(model="tiny", messages=ASK, tools=[UNIT, PING], tool_choice=named("ping"), max_tokens=30, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) >= 2 and all(d.index == 0 for d in deltas)
    assert deltas[0].function.name == "ping" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == whole and json.loads(whole)["host"] in ("a", "b")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_returns_at_least_one_call_of_the_given_tools(chat):
    client, _ = chat
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[UNIT, PING], tool_choice="required", max_tokens=80, temperature=0
    )
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.function.name in ("set_unit", "ping") and isinstance(json.loads(call.function.arguments), dict)


def test_tools_and_earlier_calls_reach_the_template(chat, tiny_engine):
    """auto and none leave the output free: it is the plain greedy answer to the rendered
    prompt, which lists the tools and an earlier turn's call and result."""
    client, _ = chat
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": '{"host": "a"}'}}
            ],
        },
        {"role": "tool", "content": "pong", "tool_call_id": "call_1"},
    ]
    for choice in ("auto", "none"):
        out = client.chat.completions.create(
            model="tiny",
            messages=history,
            tools=[UNIT, PING],
            tool_choice=choice,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        prompt = out.model_extra["prompt_token_ids"]
        rendered = tiny_engine.tokenizer.decode(prompt)
        assert rendered == (
            '# tools: set_unit ping# user: def add(a, b):# assistant: <tool_call>{"name": "ping", '
            '"arguments": {"host": "a"}}</tool_call># tool: pong# assistant:\n'
        )  # Jinja trims blocks' newlines
        c = out.choices[0]
        assert c.message.content == greedy(tiny_engine, prompt, 12)["text"] and not c.message.tool_calls, choice
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=history, tools=[UNIT, PING], max_tokens=12, temperature=0, stream=True
        )
    )
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices[0].delta.content]
    assert len(pieces) >= 2 and "".join(pieces) == c.message.content  # auto streams content as it comes
    assert chunks[-1].choices[0].finish_reason == "length"
    port = int(str(client.base_url).rsplit(":", 1)[1].split("/")[0])
    body = json.dumps({"messages": history, "tools": [UNIT, PING]}).encode()
    status, answer = raw_post(port, body, "/tokenize")  # vLLM's /tokenize renders the same prompt
    assert status == 200 and json.loads(answer)["tokens"] == prompt


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tool_choice": "auto"}, r"^tool_choice: needs `tools`"),
        ({"tools": [UNIT], "tool_choice": named("nope")}, r"^tool_choice: no tool is named 'nope'"),
        ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, r"^tools\[0\]: must be"),
        (
            {"tools": [UNIT], "tool_choice": named("set_unit"), "response_format": {"type": "json_object"}},
            r"^tool_choice: a forced tool call cannot be combined with response_format",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, r"^messages\[0\]\.tool_calls"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(chat, kw, match):
    client, _ = chat
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": "tiny", "messages": ASK, "max_tokens": 4, **kw})
    assert re.match(match, e.value.body["message"]), e.value.body["message"]
