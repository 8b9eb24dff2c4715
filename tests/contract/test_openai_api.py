"""Contract of the OpenAI-compatible HTTP API, through the official `openai` client: the same
tokens as the engine, streaming, n and batched prompts, logprobs, chat through a template,
structured output, and every error status (400, 401, 404, 429) with the field to fix."""

import json
import re
import socket
from contextlib import contextmanager
from dataclasses import replace

import openai
import pytest

from services.assembly import start_http
from services.common.config import ServerConfig
from services.common.types import Sampling
from services.router.engine import GenerationRequest
from services.router.grpc_server import build_server
from tests.conftest import corrupt_bytes, finish_order_by_priority, wait_for

PROMPT = "def add(a, b):\n"
TEMPLATE = (
    "{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


@contextmanager
def http_api(engine, **cfg):
    cfg = ServerConfig(port=0, **{"max_sessions": 4, **cfg})
    server, servicer, _ = build_server(engine, cfg)
    server.start()
    http = start_http(engine, replace(cfg, http_port=0), servicer)
    port = http.server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port, servicer
    finally:
        http.stop()
        server.stop(0)


@pytest.fixture(scope="module")
def api(tiny_engine, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("chat") / "template.jinja"
    tpl.write_text(TEMPLATE)
    with http_api(tiny_engine, chat_template=tpl, served_model_name="tiny", response_stats=True) as (port, servicer):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, servicer, port


def greedy(engine, ids, n_tokens, method="vanilla", **kw):
    return engine.generate(GenerationRequest(ids, n_tokens, method=method, **kw)).result()


def idle(servicer) -> bool:
    return wait_for(lambda: not servicer.active and servicer.admission.running == 0)


@pytest.mark.parametrize("method", ["vanilla", "sd", "suffix"])
def test_completion_equals_the_engines_greedy_output(api, tiny_engine, method):
    client, servicer, _ = api
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"method": method}
    )
    ref = greedy(tiny_engine, tiny_engine.encode(PROMPT), 30)
    (c,) = out.choices
    assert c.text == ref["text"] and c.finish_reason == "length" and c.index == 0
    assert out.usage.completion_tokens == 30 and out.usage.prompt_tokens == len(tiny_engine.encode(PROMPT))
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    assert c.model_extra["speculation"]["method"] == method
    assert idle(servicer)


def test_stream_concatenates_to_the_whole_answer_then_usage_then_done(api, tiny_engine):
    client, servicer, _ = api
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"method": "sd"},
        )
    )
    ref = greedy(tiny_engine, tiny_engine.encode(PROMPT), 30)
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert len(texts) >= 3 and "".join(texts) == ref["text"]
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert all(ch.usage is None for ch in chunks[:-1])
    assert idle(servicer)


def test_streams_decode_on_the_event_loop_without_a_thread_each(api, tiny_engine):
    """A request's thread parses and admits it; its decoding runs on the server's event loop:
    while streams are mid-answer, no request thread is alive, and each answer is whole."""
    import threading

    client, servicer, _ = api
    streams = [
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(3)
    ]
    firsts = [next(iter(s)) for s in streams]  # every stream has begun answering
    assert servicer.active  # the last one at least is still decoding
    assert not [t for t in threading.enumerate() if t.name == "http-request"]
    texts = [f.choices[0].text + "".join(ch.choices[0].text for ch in s if ch.choices) for f, s in zip(firsts, streams)]
    ref = greedy(tiny_engine, tiny_engine.encode(PROMPT), 200, ignore_eos=True)
    assert texts == [ref["text"]] * 3
    assert idle(servicer)


def test_seeded_n_and_batched_prompts_index_choices_prompt_major(api, tiny_engine):
    client, _, _ = api
    prompts = [PROMPT, "class Stack:\n"]
    out = client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=12, temperature=1.0, seed=7, extra_body={"method": "sd"}
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for j in range(2):
            ref = greedy(
                tiny_engine,
                tiny_engine.encode(prompt),
                12,
                method="sd",
                sampling=Sampling(temperature=1.0, seed=7 + j),
            )
            assert out.choices[p * 2 + j].text == ref["text"], (p, j)
    assert out.usage.completion_tokens == 4 * 12


def test_best_of_returns_the_n_likeliest_of_its_candidates(api, tiny_engine):
    """best_of 3, n 2: three seeded candidates (seed, seed + 1, seed + 2, as n's are) are made,
    and the two with the highest log-probability per token come back, best first; usage
    counts all three. Without logprobs asked, none are returned."""
    client, servicer, _ = api
    ids = tiny_engine.encode(PROMPT)
    cands = [
        greedy(tiny_engine, ids, 10, method="sd", logprobs=0, sampling=Sampling(temperature=1.5, seed=11 + j))
        for j in range(3)
    ]
    mean = [sum(x["logprob"] for x in c["logprobs"]) / len(c["logprobs"]) for c in cands]
    order = sorted(range(3), key=lambda j: -mean[j])
    assert len({c["text"] for c in cands}) == 3  # the ranking matters
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=2,
        best_of=3,
        max_tokens=10,
        temperature=1.5,
        seed=11,
        extra_body={"method": "sd"},
    )
    assert [c.text for c in out.choices] == [cands[j]["text"] for j in order[:2]]
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].logprobs is None
    assert out.usage.completion_tokens == sum(len(c["token_ids"]) for c in cands)
    assert idle(servicer)


def test_min_p_reaches_the_sampler(api, tiny_engine):
    """A seeded min-p request equals the engine's with the same sampling parameters, and differs
    from the same request without min-p (temperature 3 makes the tail it cuts matter)."""
    client, _, _ = api
    ids = tiny_engine.encode(PROMPT)
    texts = {}
    for min_p in (0.0, 0.3):
        sp = Sampling(temperature=3.0, seed=5, min_p=min_p)
        out = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=3.0,
            seed=5,
            extra_body={"method": "sd", "min_p": min_p},
        )
        texts[min_p] = out.choices[0].text
        assert texts[min_p] == greedy(tiny_engine, ids, 16, method="sd", sampling=sp)["text"], min_p
    assert texts[0.0] != texts[0.3]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(api, tiny_engine):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens
    streamed up to it, so the counts rise to the final usage."""
    client, _, _ = api
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            stream=True,
            extra_body={"method": "sd"},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert counts == sorted(counts) and counts[-1] == 30 and len(set(counts)) >= 3
    prompt = len(tiny_engine.encode(PROMPT))
    assert all(
        ch.usage.prompt_tokens == prompt and ch.usage.total_tokens == prompt + ch.usage.completion_tokens
        for ch in chunks
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    with pytest.raises(openai.BadRequestError, match="stream_options.include_usag: unknown field"):
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, stream=True, stream_options={"include_usag": True}
        )


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_prompt_and_output_ids(api, tiny_engine, stream):
    """vLLM's return_token_ids: each choice carries its prompt's ids and its output's, which are
    the engine's (streamed: the chunks' ids concatenate to them, the first chunk has the prompt's)."""
    client, _, _ = api
    prompts = [PROMPT, "class Stack:\n"]
    out = client.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=12,
        temperature=0,
        stream=stream,
        extra_body={"method": "sd", "return_token_ids": True},
    )
    got: dict[int, dict] = {}
    for ch in out if stream else [out]:
        for c in ch.choices:
            g = got.setdefault(c.index, {"ids": [], "prompt": []})
            g["ids"] += c.model_extra["token_ids"]
            g["prompt"] += c.model_extra.get("prompt_token_ids") or []
    for i, prompt in enumerate(prompts):
        ids = tiny_engine.encode(prompt)
        assert got[i] == {"ids": greedy(tiny_engine, ids, 12)["token_ids"], "prompt": ids}, i
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert "token_ids" not in plain.choices[0].model_extra


def test_chat_return_token_ids_puts_the_prompt_ids_on_the_response(api, tiny_engine):
    client, _, _ = api
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "add"}],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    prompt = out.model_extra["prompt_token_ids"]
    assert tiny_engine.tokenizer.decode(prompt).endswith("# assistant:\n")
    assert out.choices[0].model_extra["token_ids"] == greedy(tiny_engine, prompt, 8)["token_ids"]


def test_token_id_prompts_and_stop_strings(api, tiny_engine):
    client, _, _ = api
    ids = tiny_engine.encode(PROMPT)
    ref = greedy(tiny_engine, ids, 30)["text"]
    stop = ref[10:14]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=30, temperature=0, stop=[stop])
    assert out.choices[0].text == ref[: ref.index(stop)] and out.choices[0].finish_reason == "stop"
    assert out.choices[0].stop_reason == stop  # vLLM's: what stopped it


def test_stop_reason_names_the_stop_string_or_token(api, tiny_engine):
    """vLLM's stop_reason, streamed (in the last chunk) and not: the stop string, the stop
    token id, or null when the length limit ended the completion."""
    client, _, _ = api
    ref = greedy(tiny_engine, tiny_engine.encode(PROMPT), 12)
    third, word = ref["token_ids"][2], ref["text"][4:7]
    for stream in (False, True):
        for extra, reason in (({"stop_token_ids": [third]}, third), ({"stop": [word]}, word), ({}, None)):
            stop = extra.pop("stop", None)
            out = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=stream, stop=stop, extra_body=extra
            )
            last = [ch.choices[0] for ch in out if ch.choices][-1] if stream else out.choices[0]
            assert last.stop_reason == reason and last.finish_reason == ("length" if reason is None else "stop")


def test_truncate_prompt_tokens(api, tiny_engine):
    client, _, _ = api
    ids = tiny_engine.encode(PROMPT * 4)
    out = client.completions.create(
        model="tiny", prompt=PROMPT * 4, max_tokens=8, temperature=0, extra_body={"truncate_prompt_tokens": 6}
    )
    assert out.usage.prompt_tokens == 6 and out.choices[0].text == greedy(tiny_engine, ids[-6:], 8)["text"]
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens: must be >= 1"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body={"truncate_prompt_tokens": 0})


def test_bad_words_never_appear(api, tiny_engine):
    client, _, _ = api
    plain = greedy(tiny_engine, tiny_engine.encode(PROMPT), 30)["text"]
    word = next(w for w in plain.split() if w.isalpha() and len(w) > 2)
    sp = Sampling(bad_words=tiny_engine.bad_word_ids([word]))
    ref = greedy(tiny_engine, tiny_engine.encode(PROMPT), 30, sampling=sp)["text"]
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"bad_words": [word], "method": "sd"}
    )
    assert out.choices[0].text == ref != plain and word not in ref.split()
    with pytest.raises(openai.BadRequestError, match="bad_words: must be a list of strings"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"bad_words": "x"})


def test_logprobs_are_the_engines(api, tiny_engine):
    client, _, _ = api
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    ref = greedy(tiny_engine, tiny_engine.encode(PROMPT), 10, logprobs=3)
    lp = out.choices[0].logprobs
    # equal up to float noise: a prefix-cache hit or a batched step sums in another order
    assert lp.token_logprobs == pytest.approx([x["logprob"] for x in ref["logprobs"]], abs=1e-4)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(
        len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=1e-5)  # greedy: the token is the best
        for top, v in zip(lp.top_logprobs, lp.token_logprobs)
    )


def test_logprob_entries_name_token_ids_when_asked(api, tiny_engine):
    """return_tokens_as_token_ids (vLLM's): every logprob entry, top ones and an echoed prompt's
    included, names its token as ``token_id:N``; the text is unchanged."""
    client, _, _ = api
    ids = tiny_engine.encode(PROMPT)
    ref = greedy(tiny_engine, ids, 6, logprobs=2)
    named = [f"token_id:{x['token_id']}" for x in ref["logprobs"]]
    asked = {"return_tokens_as_token_ids": True}
    for stream in (False, True):
        out = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=stream, extra_body=asked
        )
        chunks = [ch.choices[0] for ch in out if ch.choices] if stream else out.choices
        tokens = sum((c.logprobs.tokens for c in chunks if c.logprobs), [])
        assert tokens == named and "".join(c.text for c in chunks) == ref["text"], stream
        assert all(
            k.startswith("token_id:") for c in chunks if c.logprobs for top in c.logprobs.top_logprobs for k in top
        )
    echoed = (
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True, extra_body=asked
        )
        .choices[0]
        .logprobs.tokens
    )
    assert echoed[: len(ids)] == [f"token_id:{t}" for t in ids]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body=asked,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 4 and all(
        e.token.startswith("token_id:") and e.bytes == list(e.token.encode()) for e in entries
    )


def test_special_tokens_read_as_text_only_when_not_skipped(api, tiny_engine):
    """vLLM's skip_special_tokens over HTTP (streamed and not): with only the end-of-sequence
    token allowed and ignore_eos, the text is empty by default and names the token when false.
    spaces_between_special_tokens is accepted as a boolean (vLLM's fast-tokenizer path
    ignores it) and refused as anything else."""
    client, _, _ = api
    asked = {"ignore_eos": True, "allowed_token_ids": [tiny_engine.eos_id], "return_token_ids": True}
    for skip, text in ((None, ""), (True, ""), (False, "<|endoftext|>" * 3)):
        extra = asked if skip is None else {**asked, "skip_special_tokens": skip, "spaces_between_special_tokens": True}
        for stream in (False, True):
            out = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, stream=stream, extra_body=extra
            )
            chunks = [ch.choices[0] for ch in out if ch.choices] if stream else out.choices
            assert "".join(c.text for c in chunks) == text, (skip, stream)
            assert sum((c.token_ids or [] for c in chunks), []) == [tiny_engine.eos_id] * 3
    for field in ("skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(openai.BadRequestError, match=f"{field}: must be true or false"):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={field: "yes"})


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(api, tiny_engine):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1, greedy. The
    prompt's tokens come back first (the first with null), with the target's log-probabilities."""
    client, _, _ = api
    prompt = "def add(a, b):\n    return a + b\n"
    ids = tiny_engine.encode(prompt)
    ref = greedy(tiny_engine, ids, 1, prompt_logprobs=1, logprobs=1)
    for stream in (False, True):
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True, stream=stream
        )
        if stream:
            chunks = [ch.choices[0] for ch in out if ch.choices]
            text = "".join(c.text for c in chunks)
            lp = {
                k: sum((getattr(c.logprobs, k) for c in chunks if c.logprobs), [])
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            }
        else:
            text, lp = out.choices[0].text, out.choices[0].logprobs.model_dump()
        assert text == prompt + ref["text"], stream
        assert (
            lp["tokens"][: len(ids)] == [tiny_engine.tokenizer.decode([t]) for t in ids]
            and len(lp["tokens"]) == len(ids) + 1
        )
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [x["logprob"] for x in ref["prompt_logprobs"]] + [ref["logprobs"][0]["logprob"]]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_chat_renders_the_template_and_answers_as_the_assistant(api, tiny_engine):
    client, _, _ = api
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    out = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2
    )
    rendered = "# system: You write Python.\n# user: def add(a, b):\n# assistant:\n"
    ref = greedy(tiny_engine, tiny_engine.tokenizer(rendered, add_special_tokens=False)["input_ids"], 20)
    c = out.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref["text"] and out.object == "chat.completion"
    assert len(c.logprobs.content) == 20 and all(len(x.top_logprobs) == 2 for x in c.logprobs.content)
    streamed = list(
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, stream=True)
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == ref["text"]
    assert streamed[-1].choices[0].finish_reason == "length"


def test_chat_continues_a_final_assistant_message_and_echoes_it(api, tiny_engine):
    """continue_final_message renders the last assistant turn open (no generation prompt after
    it); echo makes the answer start with that turn, streamed or not."""
    client, _, _ = api
    msgs = [{"role": "user", "content": "add"}, {"role": "assistant", "content": "def add(a, b):"}]
    kw = dict(
        model="tiny",
        messages=msgs,
        max_tokens=10,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "echo": True,
            "return_token_ids": True,
        },
    )
    out = client.chat.completions.create(**kw)
    prompt = out.model_extra["prompt_token_ids"]
    assert tiny_engine.tokenizer.decode(prompt) == "# user: add\n# assistant: def add(a, b):"
    ref = greedy(tiny_engine, prompt, 10)["text"]
    assert out.choices[0].message.content == "def add(a, b):" + ref
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == "def add(a, b):"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "def add(a, b):" + ref
    with pytest.raises(openai.BadRequestError, match="continue_final_message: needs a final assistant message"):
        client.chat.completions.create(
            model="tiny", messages=msgs[:1], max_tokens=3, extra_body={"continue_final_message": True}
        )


def test_json_schema_response_format_gives_a_valid_instance(api):
    client, _, _ = api
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
    }
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
    )
    c = out.choices[0]
    assert c.finish_reason == "stop"
    value = json.loads(c.text)
    assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
    choice = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_tokens": 0}, r"^max_tokens: must be in \[1, "),
        ({"temperature": -1}, r"^temperature: must be a finite number >= 0"),
        ({"extra_body": {"temprature": 0}}, r"^temprature: unknown field"),
        ({"extra_body": {"top_k": "3"}}, r"^top_k: must be an integer"),
        ({"extra_body": {"min_p": 2}}, r"^min_p: must be in \[0, 1\]"),
        ({"extra_body": {"priority": 2**40}}, r"^priority: must fit in 32 bits"),
        ({"suffix": "x"}, r"^suffix: not supported"),
        ({"n": 2, "best_of": 1}, r"^best_of: must be at least n \(2\)"),
        ({"best_of": 2, "stream": True}, r"^best_of: the best completions are known only at the end"),
        ({"best_of": 100}, r"^best_of: at most 16 completions per prompt, got 100"),
        ({"n": 5}, r"^n: at most 4 completions"),
        ({"logit_bias": {"x": 1}}, r"^logit_bias: keys must be token ids"),
        ({"extra_body": {"method": "magic"}}, r"^method: unknown method 'magic'"),
        ({"extra_body": {"response_format": {"type": "xml"}}}, r"^response_format: must be"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, r"^structured_outputs: the pattern cannot"),
        ({"stream_options": {"include_usage": True}}, r"^stream_options: only allowed when stream is true"),
    ],
)
def test_invalid_requests_get_400_naming_the_field(api, kw, match):
    client, servicer, _ = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": "tiny", "prompt": PROMPT, **kw})
    assert e.value.status_code == 400
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["code"] == 400

    assert re.search(match, err["message"]), err["message"]
    assert idle(servicer)


def test_tokenize_and_detokenize_round_trip(api, tiny_engine):
    _, _, port = api
    status, out = raw_post(port, json.dumps({"prompt": PROMPT}).encode(), "/tokenize")
    got = json.loads(out)
    assert status == 200 and got["tokens"] == tiny_engine.encode(PROMPT) and got["count"] == len(got["tokens"])
    status, out = raw_post(port, json.dumps({"tokens": got["tokens"]}).encode(), "/detokenize")
    assert status == 200 and json.loads(out)["prompt"] == PROMPT
    status, out = raw_post(port, json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "/tokenize")
    assert status == 200 and json.loads(out)["tokens"] == tiny_engine.encode("# user: hi\n# assistant:\n")
    status, out = raw_post(port, json.dumps({"tokens": [10**6]}).encode(), "/detokenize")
    assert status == 400 and json.loads(out)["error"]["message"].startswith("tokens: every id must be in")
    status, out = raw_post(port, b'{"prompt": "a", "messages": []}', "/tokenize")
    assert status == 400


def test_unknown_model_is_404_and_chat_without_messages_is_400(api):
    client, _, _ = api
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages: required"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]: must be"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            tools=[{"type": "function", "function": {"name": "f g"}}],
        )
    assert [m.id for m in client.models.list().data] == ["tiny"]


def raw_post(port: int, body: bytes, path: str = "/v1/completions") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


def test_malformed_bodies_get_400_never_a_crash(api):
    _, servicer, port = api
    for body in [
        b"not json",
        b"[1, 2]",
        b'{"prompt": {"a": 1}}',
        b'{"prompt": ""}',
        b'{"prompt": [true]}',
        b'{"prompt": "x", "max_tokens": 1e999}',
        b'{"prompt": "x", "n": null, "seed": -1}',
        b'{"prompt": "x", "logit_bias": {"1": "high"}}',
        b'{"prompt": [[1, 2], "x"]}',
    ] + [corrupt_bytes(64, seed) for seed in range(5)]:
        status, out = raw_post(port, body)
        assert status == 400, (body, out)
        assert json.loads(out)["error"]["message"]
    status, out = raw_post(port, b'{"messages": "hi"}', "/v1/chat/completions")
    assert status == 400 and b"messages: required" in out
    assert idle(servicer)


def test_a_client_that_leaves_mid_stream_frees_its_sessions(api, tiny_engine):
    client, servicer, _ = api
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=200,
        temperature=1.0,
        n=2,
        stream=True,
        extra_body={"method": "sd", "ignore_eos": True},
    )
    next(iter(stream))
    assert servicer.active
    stream.close()
    assert idle(servicer) and wait_for(lambda: not tiny_engine.verifier.sessions)


def test_overload_is_429_and_the_limit_is_shared_with_grpc(tiny_engine):
    with http_api(tiny_engine, max_sessions=1, max_queue=0) as (port, servicer):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            prompt=PROMPT,
            model="target",
            max_tokens=200,
            stream=True,
            extra_body={"method": "vanilla", "ignore_eos": True},
        )
        next(iter(stream))
        with pytest.raises(openai.RateLimitError, match="concurrent sessions"):
            client.completions.create(prompt=PROMPT, model="target", max_tokens=4)
        assert servicer.admission.running == 1
        stream.close()
        assert idle(servicer)
        assert client.completions.create(prompt=PROMPT, model="target", max_tokens=4).choices[0].text


def test_http_priority_orders_the_admission_queue(tiny_engine):
    """HTTP ``priority`` reaches the queue the gRPC server shares: of two queued requests, the
    later one with priority -1 is admitted first."""
    with http_api(tiny_engine, max_sessions=1, max_queue=4) as (port, servicer):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        send = lambda p: client.completions.create(
            model="target",
            prompt=PROMPT,
            max_tokens=3,  # noqa: E731
            extra_body={"priority": p},
        )
        assert finish_order_by_priority(servicer.admission, send) == ["urgent", "first"]
        assert idle(servicer)


def test_bearer_token_is_required_on_v1_but_not_health(tiny_engine):
    import urllib.request

    with http_api(tiny_engine, auth_token="s3cret") as (port, _):
        base = f"http://127.0.0.1:{port}"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="target", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
        assert urllib.request.urlopen(f"{base}/health").status == urllib.request.urlopen(f"{base}/ping").status == 200
        from importlib.metadata import version

        assert json.load(urllib.request.urlopen(f"{base}/version")) == {"version": version("specmesh")}
        assert raw_post(port, b'{"prompt": "x"}', "/tokenize")[0] == 401


def test_reset_prefix_cache_forgets_cached_prompt_blocks(api, tiny_engine):
    """vLLM's POST /reset_prefix_cache (and SGLang's /flush_cache): a prompt served from the
    prefix cache is prefilled whole after it."""
    import urllib.error
    import urllib.request

    from prometheus_client import REGISTRY

    client, _, port = api
    prompt = "".join(f"def reset_{i}(x):\n    return x * {i}\n\n" for i in range(6))

    def cached() -> int:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    get = urllib.request.Request(f"http://127.0.0.1:{port}/flush_cache", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:  # a GET changes nothing (SGLang's also flushes on GET)
        urllib.request.urlopen(get, timeout=30)
    assert e.value.code == 405 and cached() > 0
    for path, method, text in (("/reset_prefix_cache", "POST", ""), ("/flush_cache", "POST", "Cache flushed.\n")):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and r.read().decode() == text
        assert REGISTRY.get_sample_value("specmesh_prefix_cache_bytes") == 0  # the gauge follows at once
        assert cached() == 0 and cached() > 0  # cold once, then cached again


def test_max_model_len_caps_the_context(tiny_dirs):
    """vLLM's --max-model-len: /v1/models reports it, a request past it is refused naming it,
    and one above the target's positions is refused at startup."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    target, draft = tiny_dirs
    cfg = EngineConfig(target=target, draft=draft, eagle3=None, predictor=None, ocm_snapshot=None, max_model_len=40)
    engine = Engine(cfg)
    try:
        with http_api(engine) as (port, _):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
            assert client.models.list().data[0].model_extra["max_model_len"] == 40
            ids = engine.encode(PROMPT)
            assert client.completions.create(
                model="target", prompt=ids, max_tokens=40 - len(ids), temperature=0
            ).usage.completion_tokens == 40 - len(ids)
            with pytest.raises(openai.BadRequestError, match="the context of 40 tokens"):
                client.completions.create(model="target", prompt=ids, max_tokens=41 - len(ids))
    finally:
        engine.close()
    with pytest.raises(ValueError, match="max_model_len: 257 exceeds the target's 256 positions"):
        Engine(replace(cfg, max_model_len=257))


def test_a_model_served_under_several_names(tiny_engine):
    """vLLM's --served-model-name a b: /v1/models lists both, a request may name either, and
    the answer carries the first."""
    with http_api(tiny_engine, served_model_name=("tiny-2026-12", "tiny")) as (port, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        models = client.models.list().data
        assert [m.id for m in models] == ["tiny-2026-12", "tiny"] and {m.model_extra["root"] for m in models} == {
            "tiny-2026-12"
        }
        for name in ("tiny", "tiny-2026-12"):
            assert client.completions.create(model=name, prompt=PROMPT, max_tokens=2).model == "tiny-2026-12"
        with pytest.raises(openai.NotFoundError, match="this server serves `tiny-2026-12`, `tiny`"):
            client.completions.create(model="tiny-2025", prompt=PROMPT, max_tokens=2)


def cors(port: int, origin: str, path: str = "/v1/completions") -> tuple[int, dict]:
    """A browser's preflight for a JSON POST with a bearer token: status and headers."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method="OPTIONS",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_cors_preflight_is_answered_before_the_bearer_check(tiny_engine):
    """vLLM's --allowed-origins: a browser UI on another origin may call the API once its origin is
    allowed; by default no origin is (no CORS headers: a page on any site cannot drive it)."""
    with http_api(tiny_engine) as (port, _):
        status, headers = cors(port, "https://ui.example")
        assert status >= 400 and "access-control-allow-origin" not in {k.lower() for k in headers}
    with http_api(tiny_engine, auth_token="s3cret", allowed_origins=("*",)) as (port, _):
        status, headers = cors(port, "https://ui.example")
        assert status == 200 and headers["access-control-allow-origin"] == "*"
        assert "authorization" in headers["access-control-allow-headers"].lower()
    with http_api(tiny_engine, allowed_origins=("https://ui.example",)) as (port, _):
        status, headers = cors(port, "https://ui.example")
        assert status == 200 and headers["access-control-allow-origin"] == "https://ui.example"
        status, headers = cors(port, "https://elsewhere.example")
        assert status == 400 and "access-control-allow-origin" not in {k.lower() for k in headers}


@pytest.fixture(scope="module")
def bos_engine(tiny_dirs, tmp_path_factory):
    """The tiny pair with a tokenizer that adds a BOS token (id 0) as Llama's does."""
    import shutil

    from services.common.config import EngineConfig
    from services.router.engine import Engine

    target = tmp_path_factory.mktemp("bos") / "target"
    shutil.copytree(tiny_dirs[0], target)
    tok = json.loads((target / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (target / "tokenizer.json").write_text(json.dumps(tok))
    engine = Engine(
        EngineConfig(
            target=target, draft=tiny_dirs[1], eagle3=None, predictor=None, ocm_snapshot=None, max_new_tokens_limit=200
        )
    )
    yield engine
    engine.close()


def test_offline_tools_encode_prompts_as_the_api_does(bos_engine):
    """bench, trace and calibrate (``encode_fit``) take the BOS token as the API's text
    prompts do, and keep it when a long prompt loses its start to fit the context."""
    ids = bos_engine.encode(PROMPT)
    assert bos_engine.encode_fit(PROMPT, 8) == [0, *ids]
    long = PROMPT * 200
    full = bos_engine.encode(long)
    fit = bos_engine.encode_fit(long, 56)
    assert len(fit) == bos_engine.context_len - 56 and fit[0] == 0 and fit[1:] == full[len(full) - len(fit) + 1 :]


def test_text_prompts_take_the_tokenizers_special_tokens(bos_engine, tmp_path):
    """As vLLM and SGLang tokenize a text prompt: with the BOS token a Llama-style tokenizer
    adds (add_special_tokens, default true), over HTTP and gRPC alike; a chat template writes
    its own, so chat adds none unless asked."""
    import grpc

    from specmesh.v1 import generate_pb2 as pb
    from specmesh.v1 import generate_pb2_grpc as pb_grpc

    ids = bos_engine.encode(PROMPT)
    assert ids[0] != 0 and bos_engine.encode(PROMPT, add_special_tokens=True) == [0, *ids]
    tpl = tmp_path / "template.jinja"
    tpl.write_text(TEMPLATE)
    with http_api(bos_engine, chat_template=tpl) as (port, _):
        status, out = raw_post(port, json.dumps({"prompt": PROMPT, "return_token_strs": True}).encode(), "/tokenize")
        body = json.loads(out)
        assert status == 200 and body["tokens"] == [0, *ids] and body["token_strs"][0] == "<|endoftext|>"
        _, out = raw_post(port, json.dumps({"prompt": PROMPT, "add_special_tokens": False}).encode(), "/tokenize")
        assert json.loads(out)["tokens"] == ids
        messages = [{"role": "user", "content": "hi"}]
        _, out = raw_post(port, json.dumps({"messages": messages}).encode(), "/tokenize")
        chat = json.loads(out)["tokens"]
        _, out = raw_post(port, json.dumps({"messages": messages, "add_special_tokens": True}).encode(), "/tokenize")
        assert chat[0] != 0 and json.loads(out)["tokens"] == [0, *chat]

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        ref = greedy(bos_engine, [0, *ids], 8)
        out = client.completions.create(model="target", prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.usage.prompt_tokens == len(ids) + 1 and out.choices[0].text == ref["text"]
        out = client.completions.create(
            model="target", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"add_special_tokens": False}
        )
        assert out.usage.prompt_tokens == len(ids)
        assert client.chat.completions.create(
            model="target", messages=messages, max_tokens=2, temperature=0
        ).usage.prompt_tokens == len(chat)

    server, _, port = build_server(bos_engine, ServerConfig(port=0, max_sessions=2))
    server.start()
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for flag, n in ((None, len(ids) + 1), (False, len(ids))):
            req = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=2, method="vanilla")
            if flag is not None:
                req.add_special_tokens = flag
            assert list(stub.Generate(req, timeout=60))[-1].usage.prompt_tokens == n
    finally:
        server.stop(0)


# -- hostile and careless input (issue 35's smaller defects) -----------------------------------
def raw_request(port: int, head: str, body: bytes = b"") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    return int(top.split()[1]), rest


def test_prompt_tokens_count_each_prompt_once_whatever_n(api, tiny_engine):
    client, _, _ = api
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    many = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=4, temperature=0)
    assert one.usage.prompt_tokens == len(tiny_engine.encode(PROMPT)) == many.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * 4
    two = client.completions.create(model="tiny", prompt=[PROMPT, PROMPT], n=2, max_tokens=4, temperature=0)
    assert two.usage.prompt_tokens == 2 * one.usage.prompt_tokens  # two prompts, each once


def test_unknown_paths_and_methods_answer_in_openais_error_shape(api):
    _, _, port = api
    status, out = raw_request(port, "GET /v1/nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 404 and json.loads(out)["error"]["type"] == "not_found_error"
    assert "/v1/nowhere" in json.loads(out)["error"]["message"]
    status, out = raw_request(port, "GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 405 and json.loads(out)["error"]["message"].startswith("method: GET")


def test_a_chat_role_openai_does_not_know_is_400(api):
    _, _, port = api
    body = json.dumps({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}).encode()
    status, out = raw_post(port, body, "/v1/chat/completions")
    assert status == 400 and "messages[0].role" in json.loads(out)["error"]["message"]


def test_deeply_nested_json_is_400_in_openais_shape(api):
    _, servicer, port = api
    status, out = raw_post(port, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400 and json.loads(out)["error"]["message"] == "body: JSON nested too deeply"
    assert idle(servicer)


def test_an_oversized_body_is_refused_while_it_is_read(tiny_engine):
    """A declared Content-Length past the limit is refused before any byte of the body, and a
    chunked body as soon as its bytes pass the limit (the rest is never read)."""
    with http_api(tiny_engine, max_message_bytes=1024) as (port, _):
        status, out = raw_request(
            port,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            "\r\nContent-Length: 3000000000\r\nConnection: close\r\n\r\n",
        )
        assert status == 413 and "at most 1024 bytes" in json.loads(out)["error"]["message"]
        chunk = b'{"prompt": "' + b"x" * 600
        body = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (chunk, b"y" * 600)) + b"0\r\n\r\n"
        status, out = raw_request(
            port,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            "\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
            body,
        )
        assert status == 413


def test_request_ids_are_capped(api):
    _, _, port = api
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, "request_id": "r" * 257}).encode()
    status, out = raw_post(port, body)
    assert status == 400 and json.loads(out)["error"]["message"].startswith("request_id: at most 256")
