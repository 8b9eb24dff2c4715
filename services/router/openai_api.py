"""OpenAI-compatible request and response bodies (``/v1/completions``, ``/v1/chat/completions``),
as vLLM's server accepts them: JSON dicts in, ``GenerationRequest`` out, and the engine's steps
back into OpenAI's objects and stream chunks. No HTTP here; ``services.router.http_server``
is the edge.

Rules kept from OpenAI and vLLM:
- unknown fields are refused (a misspelt parameter is never silently ignored);
- ``max_tokens`` defaults to 16 for completions, and to what the context leaves for chat;
- ``temperature`` defaults to 1.0 (sampling), as both APIs do; 0 is greedy;
- choice ``i * n + j`` is completion ``j`` of prompt ``i``; completion ``j`` of a seeded
  request samples with ``seed + j``;
- the vLLM extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``, ``include_stop_str_in_output``, ``allowed_token_ids``, ``prompt_logprobs``,
  ``structured_outputs``, ``truncate_prompt_tokens``, ``bad_words``, ``cache_salt``, ``request_id``,
  ``return_token_ids``, ``return_tokens_as_token_ids``, ``priority``, ``skip_special_tokens``,
  ``spaces_between_special_tokens``) and specmesh's ``method`` are accepted;
- ``spaces_between_special_tokens`` must be a boolean and changes nothing: vLLM applies it only
  with a slow (Python) tokenizer, and the engine loads fast ones, which decode added tokens
  as written;
- ``return_token_ids`` (vLLM's) adds ``token_ids`` (the output's) to every choice, or stream
  chunk, and ``prompt_token_ids``: per choice for completions (in its first chunk when
  streaming), once per response (in the first chunk) for chat.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace

from services.common.structured import StructuredOutput
from services.common.types import Sampling, TokenLogprob
from services.router.engine import MAX_N, Generation, GenerationRequest, InvalidRequest
from services.router.tools import ToolError, Tools, parse_tools, template_messages
from services.router.tools import message as tool_message

FINISH = {"length": "length", "eos": "stop", "stop": "stop", "abort": "abort"}  # vLLM's names
DEFAULT_COMPLETION_TOKENS = 16
MAX_PROMPTS = 16  # prompts in one /v1/completions request

_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "user",
    "response_format",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "structured_outputs",
    "cache_salt",
    "request_id",
    "method",
    "truncate_prompt_tokens",
    "bad_words",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "priority",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "add_special_tokens",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "prompt_logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "chat_template_kwargs",
    "continue_final_message",
    "echo",
}
# engine field names as a client of this API knows them
_FIELD_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}


def openai_message(e: InvalidRequest, api: "ApiRequest | None" = None) -> str:
    """The engine's message with its field named as this API names it."""
    name, sep, rest = str(e).partition(":")
    names = {**_FIELD_NAMES, "structured_output": api.structured_field if api else "response_format"}
    return f"{names.get(name, name)}{sep}{rest}" if sep else str(e)


# ---- typed field access: each names the field and what it must be -----------------------------


def _typed(body: dict, key: str, kinds: tuple, what: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise InvalidRequest(f"{key}: must be {what}, got {json.dumps(v)[:80]}")
    return v


def _num(body: dict, key: str, default: float) -> float:
    return float(_typed(body, key, (int, float), "a number", default))


def _int(body: dict, key: str, default: int) -> int:
    return _typed(body, key, (int,), "an integer", default)


def _opt_int(body: dict, key: str) -> int | None:
    """An integer field, None when absent."""
    return _typed(body, key, (int,), "an integer")


def _bool(body: dict, key: str) -> bool:
    return _typed(body, key, (bool,), "true or false", False)


def _ids(body: dict, key: str) -> tuple[int, ...]:
    v = _typed(body, key, (list,), "a list of token ids", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise InvalidRequest(f"{key}: must be a list of non-negative integer token ids")
    return tuple(v)


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidRequest("stop: must be a string or a list of strings")
    return tuple(s for s in v if s)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    v = _typed(body, "logit_bias", (dict,), "an object mapping token ids to biases", {})
    try:
        pairs = sorted((int(k), float(b)) for k, b in v.items() if not isinstance(b, bool))
    except (TypeError, ValueError):
        raise InvalidRequest('logit_bias: keys must be token ids ("1234") and values numbers') from None
    if len(pairs) != len(v):
        raise InvalidRequest("logit_bias: values must be numbers")
    return tuple(pairs)


def _bad_words(body: dict, engine) -> tuple[tuple[int, ...], ...]:
    v = _typed(body, "bad_words", (list,), "a list of strings", [])
    if not all(isinstance(w, str) for w in v):
        raise InvalidRequest("bad_words: must be a list of strings")
    return engine.bad_word_ids(v)


def _sampling(body: dict, engine) -> Sampling:
    top_k = _int(body, "top_k", 0)
    seed = _opt_int(body, "seed")
    if seed is not None and not 0 <= seed < 2**63 - MAX_N:
        raise InvalidRequest(f"seed: must be in [0, 2**63 - {MAX_N}), got {seed}")
    return Sampling(
        temperature=_num(body, "temperature", 1.0),
        top_p=_num(body, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1 = off
        seed=seed,
        repetition_penalty=_num(body, "repetition_penalty", 1.0),
        presence_penalty=_num(body, "presence_penalty", 0.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0),
        logit_bias=_logit_bias(body),
        allowed_token_ids=_ids(body, "allowed_token_ids"),
        bad_words=_bad_words(body, engine),
        min_p=_num(body, "min_p", 0.0),
    )


def _structured(body: dict) -> StructuredOutput | None:
    """``structured_outputs`` (vLLM: json / regex / choice / json_object) or ``response_format``
    (OpenAI: text / json_object / json_schema); at most one of them."""
    so, rf = body.get("structured_outputs"), body.get("response_format")
    if so is not None and rf is not None:
        raise InvalidRequest("structured_outputs: set either structured_outputs or response_format, not both")
    if so is not None:
        return structured_outputs(so)
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest('response_format: must be {"type": "text" | "json_object" | "json_schema"}')
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutput(json_object=True)
    schema = (rf.get("json_schema") or {}).get("schema") if isinstance(rf.get("json_schema"), dict) else None
    if not isinstance(schema, dict):
        raise InvalidRequest('response_format: json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
    return StructuredOutput(json_schema=json.dumps(schema))


def structured_outputs(so) -> StructuredOutput:
    """vLLM's ``structured_outputs``: exactly one of json (a schema or its JSON), regex, choice, json_object."""
    kinds = [k for k in ("json", "regex", "choice", "json_object") if isinstance(so, dict) and so.get(k) is not None]
    if len(kinds) != 1 or len(so) != 1:
        raise InvalidRequest("structured_outputs: set exactly one of json, regex, choice, json_object")
    v = so[kinds[0]]
    if kinds[0] == "json":
        return StructuredOutput(json_schema=v if isinstance(v, str) else json.dumps(v))
    if kinds[0] == "regex" and isinstance(v, str):
        return StructuredOutput(regex=v)
    if kinds[0] == "choice" and isinstance(v, list) and all(isinstance(c, str) for c in v):
        return StructuredOutput(choice=tuple(v))
    if kinds[0] == "json_object" and v is True:
        return StructuredOutput(json_object=True)
    raise InvalidRequest(
        f"structured_outputs.{kinds[0]}: wrong type (regex: a string, choice: a list of "
        "strings, json: a schema object or string, json_object: true)"
    )


def _refuse_fields(body: dict, allowed: set[str], unsupported: dict[str, str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(
            f"{unknown[0]}: unknown field; this server accepts {', '.join(sorted(allowed - set(unsupported)))}"
        )
    for key, why in unsupported.items():
        if body.get(key) not in (None, False, [], {}):
            raise InvalidRequest(f"{key}: {why}")


# ---- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiRequest:
    """What one HTTP request asks for: a ``GenerationRequest`` per prompt, and how to answer."""

    gens: tuple[GenerationRequest, ...]
    stream: bool
    include_usage: bool
    model: str
    chat: bool = False
    logprobs: bool = False  # per-token logprobs in the answer
    structured_field: str = "response_format"  # which field set the grammar, for error messages
    echo: bool = False  # completions: the prompt precedes the output in text and logprobs
    token_ids: bool = False  # return_token_ids: prompt and output token ids beside the text
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob entries name tokens "token_id:N"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
    tools: Tools | None = None  # chat: the request's tools and tool_choice
    chat_echo: str = ""  # chat echo: the last (assistant) message, which the answer repeats first
    n: int = 0  # completions: choices returned per prompt, of the gens' n (best_of) made; 0: all

    @property
    def calls_tools(self) -> bool:
        """Its output is read for tool calls (then a stream sends the message when it ends)."""
        return self.tools is not None and self.tools.choice != "none"


def _request(
    body: dict,
    prompt_ids: list[int],
    engine,
    max_tokens: int,
    n: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> GenerationRequest:
    keep = _opt_int(body, "truncate_prompt_tokens")
    _typed(body, "spaces_between_special_tokens", (bool,), "true or false", True)
    return GenerationRequest(
        prompt_ids=engine.truncate(prompt_ids, keep, max_tokens),
        max_new_tokens=max_tokens,
        sampling=_sampling(body, engine),
        stop=_stops(body),
        stop_token_ids=_ids(body, "stop_token_ids"),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        prompt_logprobs=prompt_logprobs,
        method=_typed(body, "method", (str,), "a method name", ""),
        request_id=_typed(body, "request_id", (str,), "a string", ""),
        logprobs=logprobs,
        cache_salt=_typed(body, "cache_salt", (str,), "a string", ""),
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0),
        structured=_structured(body),
        n=n,
        priority=_priority(body),
        skip_special_tokens=_typed(body, "skip_special_tokens", (bool,), "true or false", True),
    )


def _priority(body: dict) -> int:
    v = _int(body, "priority", 0)
    if not -(2**31) <= v < 2**31:
        raise InvalidRequest(f"priority: must fit in 32 bits, got {v}")
    return v


def _stream_opts(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage: a last chunk with the usage; continuous_usage_stats, vLLM's: every chunk
    also carries the usage so far, with include_usage only)."""
    opts = _typed(body, "stream_options", (dict,), "an object", None)
    if opts is not None and not stream:
        raise InvalidRequest("stream_options: only allowed when stream is true")
    opts = opts or {}
    for key in opts:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise InvalidRequest(f"stream_options.{key}: unknown field (include_usage, continuous_usage_stats)")
    flags = [opts.get(k, False) for k in ("include_usage", "continuous_usage_stats")]
    for k, v in zip(("include_usage", "continuous_usage_stats"), flags):
        if not isinstance(v, bool):
            raise InvalidRequest(f"stream_options.{k}: must be true or false")
    return flags[0], flags[0] and flags[1]


PROMPT_SUFFIX = "-p"  # request id of prompt i of a batched request: its id + "-p" + i


def request_ids(request_id: str) -> tuple[str, ...]:
    """The ids that name a completion of ``request_id``: itself and, for one prompt of a
    batched request, the request's id."""
    base, sep, i = request_id.rpartition(PROMPT_SUFFIX)
    return (request_id, base) if sep and base and i.isdigit() else (request_id,)


def _prompts(v, engine, special: bool) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists; strings take
    the tokenizer's special tokens with ``special``."""
    if isinstance(v, str):
        return [engine.encode(v, special)]
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return [list(v)]
    if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        return [engine.encode(p, special) for p in v]
    if isinstance(v, list) and v and all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in v):
        return [list(p) for p in v]
    raise InvalidRequest("prompt: must be a string, a list of strings, a list of token ids or a list of such lists")


def completion_request(body, engine, served_model: str | tuple[str, ...]) -> ApiRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be a JSON object")
    _refuse_fields(body, COMPLETION_FIELDS, {"suffix": "not supported (no fill-in-the-middle)"})
    model = _model(body, served_model)
    if "prompt" not in body:
        raise InvalidRequest("prompt: required")
    prompts = _prompts(body["prompt"], engine, _typed(body, "add_special_tokens", (bool,), "true or false", True))
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    n = _int(body, "n", 1)
    best_of = _int(body, "best_of", n)
    stream = _bool(body, "stream")
    if best_of < n:
        raise InvalidRequest(f"best_of: must be at least n ({n}), got {best_of}")
    if best_of > MAX_N:  # checked here, where the field that asks for them is known (the engine names n)
        raise InvalidRequest(f"best_of: at most {MAX_N} completions per prompt, got {best_of}")
    if best_of > n and stream:
        raise InvalidRequest("best_of: the best completions are known only at the end; use it without stream")
    max_tokens = _int(body, "max_tokens", DEFAULT_COMPLETION_TOKENS)
    logprobs, prompt_lp = _opt_int(body, "logprobs"), _opt_int(body, "prompt_logprobs")
    echo = _bool(body, "echo")
    if echo and logprobs is not None and prompt_lp is None:
        prompt_lp = logprobs  # the echoed prompt's tokens carry log-probabilities too (lm-eval's loglikelihood)
    ranked = 0 if best_of > n and logprobs is None else logprobs  # best_of ranks by the tokens' log-probabilities
    first = _request(body, prompts[0], engine, max_tokens, best_of, ranked, prompt_lp)  # fields parsed once
    keep = _opt_int(body, "truncate_prompt_tokens")
    gens = (first,) + tuple(replace(first, prompt_ids=engine.truncate(ids, keep, max_tokens)) for ids in prompts[1:])
    if len(gens) > 1 and gens[0].request_id:  # a session id names one prompt's completions
        gens = tuple(replace(g, request_id=f"{g.request_id}{PROMPT_SUFFIX}{i}") for i, g in enumerate(gens))
    include, continuous = _stream_opts(body, stream)
    return ApiRequest(
        gens,
        stream,
        include,
        model,
        logprobs=logprobs is not None,
        continuous_usage=continuous,
        structured_field=_structured_field(body),
        echo=echo,
        token_ids=_bool(body, "return_token_ids"),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
        n=n,
    )


def chat_request(body, engine, served_model: str | tuple[str, ...], template: str | None) -> ApiRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be a JSON object")
    _refuse_fields(body, CHAT_FIELDS, {})
    model = _model(body, served_model)
    try:
        tools = parse_tools(body)
    except ToolError as e:
        raise InvalidRequest(str(e)) from None
    _bool(body, "parallel_tool_calls")  # accepted: calls are as many as the model makes
    messages = checked_messages(body)
    ids = _chat_ids(body, engine, messages, template, tools)
    # vLLM's chat echo: the answer starts with the last message when it is the assistant's
    echoed = messages[-1]["content"] if _bool(body, "echo") and messages[-1]["role"] == "assistant" else ""
    n = _int(body, "n", 1)
    limit = min(engine.cfg.max_new_tokens_limit, max(1, engine.context_len - len(ids)))
    max_tokens = _opt_int(body, "max_completion_tokens")
    max_tokens = _int(body, "max_tokens", limit) if max_tokens is None else max_tokens
    want = _bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs")
    if top is not None and not want:
        raise InvalidRequest("top_logprobs: needs logprobs: true")
    stream = _bool(body, "stream")
    gen = _request(body, ids, engine, max_tokens, n, (top or 0) if want else None, None)
    forced = tools.constraint() if tools else None
    if forced is not None:
        if gen.structured is not None:
            raise InvalidRequest(f"tool_choice: a forced tool call cannot be combined with {_structured_field(body)}")
        gen = replace(gen, structured=forced)
    include, continuous = _stream_opts(body, stream)
    return ApiRequest(
        (gen,),
        stream,
        include,
        model,
        chat=True,
        logprobs=want,
        continuous_usage=continuous,
        structured_field="tool_choice" if forced else _structured_field(body),
        token_ids=_bool(body, "return_token_ids"),
        tools=tools,
        chat_echo=echoed,
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
    )


def _chat_ids(body: dict, engine, messages: list[dict], template: str | None, tools) -> list[int]:
    """The conversation's token ids as the chat fields ask (a chat completion's, /tokenize's)."""
    cont = _bool(body, "continue_final_message")
    if cont and (body.get("add_generation_prompt") is True or messages[-1]["role"] != "assistant"):
        raise InvalidRequest("continue_final_message: needs a final assistant message and add_generation_prompt false")
    kwargs = _typed(body, "chat_template_kwargs", (dict,), "an object", {})
    return chat_prompt(
        engine.tokenizer,
        template_messages(messages),
        template,
        add_generation_prompt=not cont and body.get("add_generation_prompt", True) is not False,
        kwargs={**kwargs, "continue_final_message": True} if cont else kwargs,
        tools=list(tools.specs) if tools else None,
        add_special_tokens=_bool(body, "add_special_tokens"),
    )


def _structured_field(body: dict) -> str:
    return "structured_outputs" if body.get("structured_outputs") is not None else "response_format"


def served_names(served: str | tuple[str, ...]) -> tuple[str, ...]:
    """The served model's names (vLLM's ``--served-model-name a b``)."""
    return (served,) if isinstance(served, str) else tuple(served)


def _model(body: dict, served: str | tuple[str, ...]) -> str:
    """The request may name the model by any of its names (or none); the answer carries the
    first, as vLLM's does, so a client of an alias learns which model answered."""
    names = served_names(served)
    model = _typed(body, "model", (str,), "a string", names[0])
    if model not in names:
        raise ModelNotFound(
            f"model: `{model}` is not served here; this server serves "
            f"{', '.join(f'`{n}`' for n in names)} (GET /v1/models)"
        )
    return names[0]


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve (HTTP 404, as OpenAI's)."""


ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles


def checked_messages(body: dict) -> list[dict]:
    """Text messages; an assistant's may carry ``tool_calls`` (its content then may be null), a
    tool's its ``tool_call_id``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest('messages: required, a non-empty list of {"role": ..., "content": ...}')
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}]: must be an object with a string `role`")
        if m["role"] not in ROLES:
            raise InvalidRequest(f"messages[{i}].role: one of {', '.join(ROLES)}, got {m['role']!r}")
        calls = m.get("tool_calls")
        if calls is not None and (
            m["role"] != "assistant"
            or not isinstance(calls, list)
            or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
        ):
            raise InvalidRequest(
                f"messages[{i}].tool_calls: an assistant's list of "
                '{"id", "type": "function", "function": {"name", "arguments"}}'
            )
        msg = {
            "role": m["role"],
            "content": "" if calls and m.get("content") is None else _content(m.get("content"), i),
        }
        msg.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None})
        out.append(msg)
    return out


def _content(c, i: int) -> str:
    """A string, or a list of text parts (other part types are refused)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c
    ):
        return "".join(p["text"] for p in c)
    raise InvalidRequest(
        f'messages[{i}].content: must be a string or a list of {{"type": "text", "text": ...}} '
        "parts (this model reads text only)"
    )


def chat_prompt(
    tokenizer,
    messages: list[dict],
    template: str | None,
    add_generation_prompt: bool = True,
    kwargs: dict | None = None,
    tools: list[dict] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The conversation (and the tools, if any) rendered by the chat template (the server's,
    else the tokenizer's); the template writes any BOS token itself, so the tokenizer adds
    its special tokens only when asked (vLLM's chat default)."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "messages: the served model has no chat template; start the server with "
            "--chat-template FILE, or use /v1/completions"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **(kwargs or {}),
        )
    except Exception as e:  # a template error names what the template expected
        raise InvalidRequest(f"messages: the chat template failed: {e}") from None
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


# ---- responses --------------------------------------------------------------------------------


@dataclass
class Choice:
    """One completion's answer so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)

    def add(self, step) -> None:
        """One step's output (``StepOutput``): its text, logprobs and token ids."""
        self.text.append(step.text)
        self.logprobs.extend(step.logprobs)
        self.token_ids.extend(step.token_ids)


def take_step(choices: list[Choice], gens, i: int, step) -> None:
    """Completion ``i``'s step into its choice (None: it has finished)."""
    if step is None:
        choices[i].finish_reason = gens[i].finish_reason
    else:
        choices[i].add(step)


def gather(completions) -> list[Choice]:
    """Every choice of a request that does not stream, decoding it here (``Completions``)."""
    choices = [Choice(i) for i in range(len(completions.gens))]
    for i, step in completions:
        take_step(choices, completions.gens, i, step)
    return choices


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def _tok(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


class _TokenIds:
    """Names each token ``token_id:N`` (vLLM's return_tokens_as_token_ids), so a logprob entry
    maps to its token where a token's text does not (part of a UTF-8 character, or a text
    that several tokens decode to)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"token_id:{i}" for i in ids)


def logprob_tokens(api: ApiRequest, tokenizer):
    """What names the tokens of the request's logprob entries."""
    return _TokenIds() if api.tokens_as_ids else tokenizer


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int) -> dict:
    """The legacy completions format; ``offset``: characters of the choice's text before these."""
    tokens = [_tok(tokenizer, x.token_id) for x in lps]
    return {
        "tokens": tokens,
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{_tok(tokenizer, i): v for i, v in x.top} for x in lps],
        "text_offset": _offsets(tokens, offset),
    }


def echo_logprobs(tokenizer, g) -> dict:
    """The echoed prompt's entries: its first token has none (null), the rest the target's
    log-probability given the tokens before (``prompt_logprobs``)."""
    first = _tok(tokenizer, g.req.prompt_ids[0])
    rest = completion_logprobs(tokenizer, g.prompt_logprobs, len(first))
    return {
        "tokens": [first] + rest["tokens"],
        "token_logprobs": [None] + rest["token_logprobs"],
        "top_logprobs": [None] + rest["top_logprobs"],
        "text_offset": [0] + rest["text_offset"],
    }


def joined_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _offsets(tokens: list[str], offset: int) -> list[int]:
    out = []
    for t in tokens:
        out.append(offset)
        offset += len(t)
    return out


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, lp: float) -> dict:
        s = _tok(tokenizer, token_id)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(i, v) for i, v in x.top]} for x in lps]}


def usage(gens, completion_tokens: int | None = None) -> dict:
    """The request's usage; ``completion_tokens``: those streamed so far (default: all). A prompt
    counts once, whatever its ``n``."""
    prompt = sum(len(g.req.prompt_ids) for g in gens if not g.prompt_repeat)
    done = sum(len(g.output_ids) for g in gens) if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "total_tokens": prompt + done,
        "prompt_tokens_details": {"cached_tokens": sum(g.cached_tokens for g in gens)},
    }


STATS_KEYS = ("speculation", "prompt_tokens_details", "cached_tokens", "spec_verify_ct")


def without_stats(body):
    """``body`` (a response or chunk, OpenAI's or SGLang's) without how it was decoded or what
    the prefix cache gave (``STATS_KEYS``), unless the server gives them (--response-stats)."""
    if isinstance(body, dict):
        return {k: without_stats(v) for k, v in body.items() if k not in STATS_KEYS}
    if isinstance(body, list):
        return [without_stats(v) for v in body]
    return body


def speculation(g) -> dict:
    """specmesh's extension: how the completion was decoded."""
    s = g.stats
    return {
        "method": g.req.method,
        "cycles": s.cycles,
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "rescued_tokens": s.rescued_tokens,
        "tau": round(s.tau, 4),
        "acceptance_rate": round(s.acceptance_rate, 4),
        "draft_s": round(g.timings.draft_s, 6),
        "verify_s": round(g.timings.verify_s, 6),
    }


def best_of(api: ApiRequest, choices: list[Choice], gens) -> tuple[list[Choice], list]:
    """OpenAI's best_of: of each prompt's ``best_of`` completions (choices i·best_of ..), the
    ``n`` with the highest log-probability per token, best first, as choices i·n + j. Returns
    them and their generations."""
    made = api.gens[0].n
    if not api.n or api.n == made:
        return choices, list(gens)
    keep_c: list[Choice] = []
    keep_g: list[Generation] = []
    for start in range(0, len(choices), made):
        group = range(start, start + made)
        top = sorted(
            group, key=lambda k: -sum(x.logprob for x in choices[k].logprobs) / max(1, len(choices[k].logprobs))
        )
        for k in top[: api.n]:
            keep_c.append(replace(choices[k], index=len(keep_c)))
            keep_g.append(gens[k])
    return keep_c, keep_g


def response_body(api: ApiRequest, rid: str, created: int, choices: list[Choice], gens, tokenizer) -> dict:
    """The whole answer of a request that did not stream; usage counts every completion made,
    ``best_of``'s left out too."""
    all_gens = list(gens)
    choices, gens = best_of(api, choices, gens)
    out = []
    for c, g in zip(choices, gens):
        echoed = tokenizer.decode(g.req.prompt_ids) if api.echo else ""
        text = echoed + "".join(c.text)
        lp, named = None, logprob_tokens(api, tokenizer)
        if api.logprobs and api.chat:
            lp = chat_logprobs(named, c.logprobs)
        elif api.logprobs:
            lp = completion_logprobs(named, c.logprobs, len(echoed))
            lp = joined_logprobs(echo_logprobs(named, g), lp) if api.echo else lp
        base = {
            "index": c.index,
            "logprobs": lp,
            "finish_reason": FINISH.get(c.finish_reason or "", "stop"),
            "stop_reason": g.stop_reason,
            "speculation": speculation(g),
        }
        if api.token_ids:
            base["token_ids"] = list(c.token_ids)
        if api.chat:
            text = api.chat_echo + text
            base["message"] = {"role": "assistant", "content": text}
            if api.tools is not None and api.calls_tools:
                content, calls, called = tool_message(api.tools, text)
                base["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                base["finish_reason"] = "tool_calls" if called else base["finish_reason"]
        else:
            base["text"] = text
            if g.req.prompt_logprobs is not None:
                base["prompt_logprobs"] = _prompt_logprobs(tokenizer, g)
            if api.token_ids:
                base["prompt_token_ids"] = list(g.req.prompt_ids)
        out.append(base)
    body = {
        "id": rid,
        "object": "chat.completion" if api.chat else "text_completion",
        "created": created,
        "model": api.model,
        "choices": out,
        "usage": usage(all_gens),
    }
    if api.chat and api.token_ids:
        body["prompt_token_ids"] = list(gens[0].req.prompt_ids)
    return body


def _prompt_logprobs(tokenizer, g) -> list:
    """vLLM's shape: None for the first prompt token, then {token_id: {logprob, rank?, decoded_token}}."""
    rows: list[dict | None] = [None]
    for x in g.prompt_logprobs:
        row = {str(i): {"logprob": v, "decoded_token": _tok(tokenizer, i)} for i, v in x.top}
        row[str(x.token_id)] = {"logprob": x.logprob, "decoded_token": _tok(tokenizer, x.token_id)}
        rows.append(row)
    return rows


def stream_chunk(
    api: ApiRequest,
    rid: str,
    created: int,
    index: int,
    text: str | None,
    lps,
    tokenizer,
    offset: int = 0,
    finish: str | None = None,
    first: bool = False,
    token_ids=(),
    prompt_ids=None,
) -> dict:
    """One SSE event: new text (and ``token_ids``) of choice ``index`` (or, with ``finish``, its
    end); ``prompt_ids`` go in the choice's first chunk when the request asked for token ids."""
    lp = None
    if api.logprobs and lps:
        named = logprob_tokens(api, tokenizer)
        lp = chat_logprobs(named, lps) if api.chat else completion_logprobs(named, lps, offset)
    choice: dict = {"index": index, "logprobs": lp, "finish_reason": FINISH.get(finish) if finish else None}
    if api.chat:
        delta = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk" if api.chat else "text_completion",
        "created": created,
        "model": api.model,
        "choices": [choice],
    }
    if api.token_ids:
        choice["token_ids"] = list(token_ids)
        if prompt_ids is not None:
            (chunk if api.chat else choice)["prompt_token_ids"] = list(prompt_ids)
    return chunk


def tool_chunk(
    api: ApiRequest,
    rid: str,
    created: int,
    index: int,
    content: str,
    deltas: list[dict],
    lps,
    tokenizer,
    first: bool,
    finish: str | None = None,
    called: bool = False,
    token_ids=(),
) -> dict:
    """A chat stream chunk under tools: content and tool-call deltas (``ToolStream``'s), and at
    the end the finish reason, "tool_calls" when the model called tools."""
    chunk = stream_chunk(
        api, rid, created, index, content or None, lps, tokenizer, finish=finish, first=first, token_ids=token_ids
    )
    choice = chunk["choices"][0]
    if deltas:
        choice["delta"]["tool_calls"] = deltas
    if called:
        choice["finish_reason"] = "tool_calls"
    return chunk


def usage_chunk(api: ApiRequest, rid: str, created: int, gens) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if api.chat else "text_completion",
        "created": created,
        "model": api.model,
        "choices": [],
        "usage": usage(gens),
    }


def tokenize_body(body, engine, served_model: str | tuple[str, ...], template: str | None) -> dict:
    """vLLM's /tokenize: a ``prompt`` or chat ``messages`` (and ``tools``) → its token ids under
    this server's tokenizer."""
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be a JSON object")
    _refuse_fields(
        body,
        {
            "model",
            "prompt",
            "messages",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
            "tools",
            "add_special_tokens",
            "return_token_strs",
        },
        {},
    )
    _model(body, served_model)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("prompt: set either `prompt` or `messages`")
    if "messages" in body:
        try:
            tools = parse_tools({"tools": body.get("tools")})
        except ToolError as e:
            raise InvalidRequest(str(e)) from None
        ids = _chat_ids(body, engine, checked_messages(body), template, tools)
    else:
        ids = engine.encode(
            _typed(body, "prompt", (str,), "a string", ""),
            _typed(body, "add_special_tokens", (bool,), "true or false", True),
        )
    out = {"count": len(ids), "max_model_len": engine.context_len, "tokens": ids}
    if _bool(body, "return_token_strs"):
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize_body(body, engine, served_model: str | tuple[str, ...]) -> dict:
    """vLLM's /detokenize: ``tokens`` → their text."""
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be a JSON object")
    _refuse_fields(body, {"model", "tokens"}, {})
    _model(body, served_model)
    ids = _ids(body, "tokens")
    vocab = len(engine.tokenizer)
    if any(t >= vocab for t in ids):
        raise InvalidRequest(f"tokens: every id must be in [0, {vocab})")
    return {"prompt": engine.tokenizer.decode(list(ids))}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_body(served: str | tuple[str, ...], max_model_len: int, created: int | None = None) -> dict:
    """Every name of the served model, each rooted at the first."""
    names, created = served_names(served), created or int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "specmesh",
                "root": names[0],
                "max_model_len": max_model_len,
            }
            for n in names
        ],
    }


def served_model(engine, cfg) -> tuple[str, ...]:
    """The model's names in the HTTP API, the first also in vLLM-named metrics: the target's
    directory name by default."""
    return served_names(cfg.served_model_name or engine.cfg.target.name)
