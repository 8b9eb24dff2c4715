"""OpenAI request bodies → GenerationRequests: defaults, field forms, refusals (a stand-in
engine: encode is a byte tokenizer)."""

import json
from types import SimpleNamespace

import pytest

from services.common.structured import StructuredOutput
from services.router import openai_api as oa
from services.router.engine import Engine as RealEngine
from services.router.engine import InvalidRequest


class Engine:
    default_method = "hybrid"
    context_len = 1024
    cfg = SimpleNamespace(max_new_tokens_limit=512)
    tokenizer = None
    truncate = RealEngine.truncate  # reads context_len only
    bad_word_ids = RealEngine.bad_word_ids  # calls encode only

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * add_special_tokens + list(text.encode())  # 0: its BOS token


def parse(**body):
    return oa.completion_request(body, Engine(), "m")


def test_defaults_are_openais():
    api = parse(prompt="ab")
    (g,) = api.gens
    assert g.prompt_ids == [0, 97, 98] and g.max_new_tokens == 16 and g.sampling.temperature == 1.0  # BOS: vLLM's
    assert (
        g.method == "" and g.n == 1 and g.logprobs is None and not api.stream and api.model == "m"
    )  # "": the engine's


@pytest.mark.parametrize(
    "prompt, ids, plain",
    [
        ("a", [[0, 97]], [[97]]),
        (["a", "b"], [[0, 97], [0, 98]], [[97], [98]]),
        ([5, 6], [[5, 6]], [[5, 6]]),
        ([[5], [6, 7]], [[5], [6, 7]], [[5], [6, 7]]),
    ],
)
def test_prompt_forms(prompt, ids, plain):
    """Text takes the tokenizer's special tokens unless add_special_tokens is false; ids are as given."""
    assert [g.prompt_ids for g in parse(prompt=prompt).gens] == ids
    assert [g.prompt_ids for g in parse(prompt=prompt, add_special_tokens=False).gens] == plain


def test_batched_prompts_get_distinct_request_ids():
    assert [g.request_id for g in parse(prompt=["a", "b"], request_id="r").gens] == ["r-p0", "r-p1"]


def test_sampling_fields_and_vllm_extras():
    (g,) = parse(
        prompt="a",
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=3,
        stop="x",
        logit_bias={"7": -100},
        repetition_penalty=1.2,
        min_tokens=2,
        stop_token_ids=[1],
        allowed_token_ids=[1, 2],
        logprobs=2,
        method="sd",
    ).gens
    sp = g.sampling
    assert parse(prompt="a", bad_words=["hi"]).gens[0].sampling.bad_words == ((32, 104, 105), (104, 105))
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.repetition_penalty) == (0.0, 0.5, 0, 3, 1.2)
    assert sp.logit_bias == ((7, -100.0),) and sp.allowed_token_ids == (1, 2)
    assert g.stop == ("x",) and g.stop_token_ids == (1,) and g.min_tokens == 2 and g.logprobs == 2 and g.method == "sd"


def test_structured_output_forms():
    schema = {"type": "object"}
    assert parse(prompt="a", response_format={"type": "json_object"}).gens[0].structured == StructuredOutput(
        json_object=True
    )
    assert parse(
        prompt="a", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    ).gens[0].structured == StructuredOutput(json_schema=json.dumps(schema))
    assert parse(prompt="a", response_format={"type": "text"}).gens[0].structured is None
    assert parse(prompt="a", structured_outputs={"choice": ["y", "n"]}).gens[0].structured == StructuredOutput(
        choice=("y", "n")
    )
    assert parse(prompt="a", structured_outputs={"regex": "a+"}).gens[0].structured == StructuredOutput(regex="a+")


@pytest.mark.parametrize(
    "body, match",
    [
        ({"prompt": "a", "temperture": 1}, r"^temperture: unknown field"),
        ({}, r"^prompt: required"),
        ({"prompt": {"x": 1}}, r"^prompt: must be"),
        ({"prompt": "a", "max_tokens": "5"}, r"^max_tokens: must be an integer"),
        ({"prompt": "a", "n": True}, r"^n: must be an integer"),
        ({"prompt": "a", "stream": "yes"}, r"^stream: must be true or false"),
        ({"prompt": "a", "stop": [1]}, r"^stop: must be a string or a list of strings"),
        ({"prompt": "a", "logit_bias": {"a": 1}}, r"^logit_bias: keys must be token ids"),
        ({"prompt": "a", "logit_bias": {"1": True}}, r"^logit_bias: values must be numbers"),
        ({"prompt": "a", "suffix": "b"}, r"^suffix: not supported"),
        ({"prompt": "a", "bad_words": ["x", 1]}, r"^bad_words: must be a list of strings"),
        ({"prompt": "a", "n": 3, "best_of": 2}, r"^best_of: must be at least n \(3\)"),
        ({"prompt": "a", "best_of": "2"}, r"^best_of: must be an integer"),
        ({"prompt": "a", "seed": -1}, r"^seed: must be in"),
        ({"prompt": ["a"] * 17}, r"^prompt: at most 16 prompts"),
        (
            {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            r"^structured_outputs: set exactly one",
        ),
        (
            {"prompt": "a", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            r"^structured_outputs: set either",
        ),
        ({"prompt": "a", "response_format": {"type": "json_schema"}}, r"^response_format: json_schema needs"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, r"^stream_options: only allowed when stream"),
    ],
)
def test_refusals_name_the_field(body, match):
    with pytest.raises(InvalidRequest, match=match):
        oa.completion_request(body, Engine(), "m")


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    api = parse(prompt="ab", echo=True, logprobs=1, max_tokens=1)
    assert api.echo and api.gens[0].prompt_logprobs == 1 and api.gens[0].logprobs == 1
    assert parse(prompt="ab", echo=True).gens[0].prompt_logprobs is None


def test_other_model_is_not_found():
    with pytest.raises(oa.ModelNotFound, match="`gpt-4` is not served here"):
        parse(prompt="a", model="gpt-4")


def test_engine_messages_use_this_apis_field_names():
    api = parse(prompt="a", structured_outputs={"regex": "("})
    assert oa.openai_message(InvalidRequest("max_new_tokens: must be in [1, 9]")) == "max_tokens: must be in [1, 9]"
    assert oa.openai_message(InvalidRequest("structured_output: bad"), api) == "structured_outputs: bad"
    assert oa.openai_message(InvalidRequest("structured_output: bad")) == "response_format: bad"


def test_chat_needs_a_template_and_checks_tools():
    eng = Engine()
    eng.tokenizer = SimpleNamespace(chat_template=None)
    with pytest.raises(InvalidRequest, match="no chat template"):
        oa.chat_request({"messages": [{"role": "user", "content": "hi"}]}, eng, "m", None)
    with pytest.raises(InvalidRequest, match=r"^tools\[0\]: must be"):
        oa.chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, eng, "m", None)
    with pytest.raises(InvalidRequest, match=r"^messages\[0\].content: must be a string"):
        oa.chat_request({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, eng, "m", "t")


def test_legacy_logprobs_offsets_follow_the_token_texts():
    from services.common.types import TokenLogprob

    tok = SimpleNamespace(decode=lambda ids: {1: "ab", 2: "c", 3: "z"}[ids[0]])
    out = oa.completion_logprobs(tok, [TokenLogprob(1, -0.1, ((1, -0.1), (3, -2.0))), TokenLogprob(2, -0.2)], 5)
    assert out == {
        "tokens": ["ab", "c"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"ab": -0.1, "z": -2.0}, {}],
        "text_offset": [5, 7],
    }
