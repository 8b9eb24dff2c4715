"""Tool calling for the chat API (OpenAI's ``tools`` / ``tool_choice``, as vLLM serves them).

- The tools go to the chat template (``tools=``), which tells the model how to call them.
- ``tool_choice`` "auto" (the default with tools): the model decides; its output is read by the
  Hermes parser (vLLM's ``hermes``, the format of Qwen2.5's and Hermes' templates): each
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes a call, the text before
  the first one stays the message's content.
- A named function: the output is constrained (structured output) to that function's
  ``parameters`` schema, and the whole output is its arguments (OpenAI answers with
  finish_reason "stop" then).
- "required": the output is constrained to a JSON array of at least one
  ``{"name": ..., "parameters": {...}}`` over the given tools (vLLM's form), one call each.
- "none": the tools are rendered, and the output is plain content.

Streams (``ToolStream``): "auto" sends content as it comes, holding back only what may be the
start of a ``<tool_call>`` tag, and the calls whole once the output ends; a named function's
arguments stream as they are generated; "required" sends its calls whole at the end.

No HTTP here: bodies in, dataclasses and dicts out.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from services.common.structured import StructuredOutput

MAX_TOOLS = 128
MAX_CALLS = 128  # tool-call blocks read from one answer; the rest stay text
OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` field that cannot be served; the message names it."""


@dataclass(frozen=True)
class Tools:
    """The request's tools (OpenAI's dicts, for the template) and how to call them."""

    specs: tuple[dict, ...]
    choice: str  # "auto" | "required" | "none" | "named"
    name: str | None = None  # the function a named choice forces

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.specs]

    @property
    def forced(self) -> str:
        """The function a named choice forces."""
        if self.name is None:
            raise ToolError("tool_choice: no function named")
        return self.name

    def parameters(self, name: str) -> dict:
        spec = next(t for t in self.specs if t["function"]["name"] == name)
        return spec["function"].get("parameters") or {"type": "object"}

    def constraint(self) -> StructuredOutput | None:
        """The structured output a forced choice decodes under (None: free text)."""
        if self.choice == "named":
            return StructuredOutput(json_schema=json.dumps(self.parameters(self.forced)))
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [n]}, "parameters": self.parameters(n)},
                    "required": ["name", "parameters"],
                }
                for n in self.names
            ]
            return StructuredOutput(json_schema=json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls}}))
        return None


def parse_tools(body: dict) -> Tools | None:
    """``tools`` and ``tool_choice`` of a chat body; None without tools (then only "none" or
    no ``tool_choice`` is allowed, as OpenAI's)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice: needs `tools`")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise ToolError(f'tools: must be a list of 1 to {MAX_TOOLS} {{"type": "function", "function": {{...}}}}')
    specs: list[dict] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not re.fullmatch(r"[A-Za-z0-9_\-\.]{1,64}", fn["name"])
        ):
            raise ToolError(
                f'tools[{i}]: must be {{"type": "function", "function": {{"name": ..., '
                '"description": ..., "parameters": {...}}}} with a name of 1-64 letters, digits, _ - .'
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters: must be a JSON Schema object")
        specs.append({"type": "function", "function": fn})
    names = [s["function"]["name"] for s in specs]
    if len(set(names)) != len(names):
        raise ToolError("tools: function names must be unique")
    if choice is None or choice in ("auto", "required", "none"):
        return Tools(tuple(specs), choice or "auto")
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
        else None
    )
    if name is None:
        raise ToolError(
            'tool_choice: must be "auto", "required", "none" or {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise ToolError(f"tool_choice: no tool is named {name!r} (tools: {', '.join(names)})")
    return Tools(tuple(specs), "named", name)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool calls with their arguments
    as objects (the API carries them as JSON strings)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def call(name: str, arguments: str) -> dict:
    """One tool call in OpenAI's response form."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def message(tools: Tools, text: str) -> tuple[str | None, list[dict], bool]:
    """(content, tool calls, whether the model called tools) of an output under ``tools``.
    Text that does not parse as the expected calls stays content."""
    if tools.choice == "named":
        return None, [call(tools.forced, text)], False
    if tools.choice == "required":
        try:
            items = json.loads(text)
            calls = [call(c["name"], json.dumps(c["parameters"])) for c in items]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, [], False
        return None, calls, bool(calls)
    if tools.choice == "none":
        return text, [], False
    return hermes(text, set(tools.names))


def hermes(text: str, names: set[str]) -> tuple[str | None, list[dict], bool]:
    """vLLM's ``hermes`` parser: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks."""
    calls = []
    for block in call_blocks(text):
        try:
            obj = json.loads(block)
            name, args = obj["name"], obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if name in names:
            calls.append(call(name, args if isinstance(args, str) else json.dumps(args)))
    if not calls:
        return text, [], False
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls, True


def call_blocks(text: str) -> list[str]:
    """What each ``<tool_call>...</tool_call>`` block holds, stripped, in order, the first
    ``MAX_CALLS`` of them: a tag's block ends at the first closing tag after it. Linear in ``text`` (a regex with lazy ``.*?`` between
    ``\\s*`` took cubic time on a tag followed by spaces: 40 s at 4,000, on the client's own
    echoed text), since the client controls it."""
    blocks: list[str] = []
    at = text.find(OPEN)
    while at >= 0 and len(blocks) < MAX_CALLS:
        end = text.find(CLOSE, at + len(OPEN))
        if end < 0:
            break
        blocks.append(text[at + len(OPEN) : end].strip())
        at = text.find(OPEN, end + len(CLOSE))
    return blocks


class ToolStream:
    """One streamed answer under ``tools``: ``feed`` each new text piece and send what it
    returns now, (content, tool-call deltas); ``finish`` gives the rest and whether the model
    called tools. Deltas are OpenAI's: ``{"index", "id"?, "type"?, "function": {...}}``."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.held = ""  # text not sent yet: a possible tag start, or the calls part
        self.in_calls = False  # auto: a <tool_call> tag has begun
        self.named_started = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        choice = self.tools.choice
        if choice == "none":
            return text, []
        if choice == "named":
            if not self.named_started:
                self.named_started = True
                return "", [{"index": 0, **call(self.tools.forced, text)}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self.held += text
        if choice == "required" or self.in_calls:
            return "", []
        at = self.held.find(OPEN)
        if at >= 0:
            content, self.held, self.in_calls = self.held[:at], self.held[at:], True
            return content, []
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1) if OPEN.startswith(self.held[-k:])), 0)
        content, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return content, []

    def finish(self) -> tuple[str, list[dict], bool]:
        choice, rest = self.tools.choice, self.held
        self.held = ""
        if choice == "named":
            return "", [] if self.named_started else [{"index": 0, **call(self.tools.forced, "")}], False
        if choice == "none" or (choice == "auto" and not self.in_calls):
            return rest, [], False
        content, calls, called = message(self.tools, rest)
        if not calls:
            return rest, [], False
        return (content or "") if choice == "auto" else "", [{"index": j, **c} for j, c in enumerate(calls)], called
