"""Hypothesis against the HTTP API (OpenAI's and SGLang's routes): bodies of every shape, with the
fields the routes know and values of every JSON type, valid or not. Each answers within its
deadline with a status that names the client's error or serves it, never a 500 or a hang, and
the server serves and holds no session afterwards."""

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.router.engine import GenerationRequest
from tests.contract.test_openai_api import http_api

pytestmark = pytest.mark.chaos

FIELDS = [
    "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "max_new_tokens", "temperature",
    "top_p", "top_k", "min_p", "n", "best_of", "stream", "stream_options", "stop", "stop_token_ids", "seed",
    "logprobs", "top_logprobs", "echo", "suffix", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "ignore_eos", "response_format",
    "structured_outputs", "tools", "tool_choice", "cache_salt", "request_id", "return_token_ids",
    "prompt_logprobs", "truncate_prompt_tokens", "skip_special_tokens", "method", "user", "text", "input_ids",
    "sampling_params", "rid", "tokens", "add_special_tokens", "priority",
]  # fmt: skip
ROUTES = ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize", "/abort_request"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-(2**63), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(FIELDS + ["role", "content", "type", "json_schema", "regex"]), inner, max_size=4
        ),
    ),
    max_leaves=12,
)
BASE = {  # a valid request of each route, which the fuzzing then bends a few fields of
    "/v1/completions": {"prompt": "def f(", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/generate": {"text": "def f(", "sampling_params": {"max_new_tokens": 4}},
    "/tokenize": {"prompt": "def f("},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/abort_request": {"rid": "nobody"},
}
overrides = st.dictionaries(st.sampled_from(FIELDS), values, max_size=3)
# a server's answer to a client's mistake: served, refused as invalid, unknown model, too large,
# overloaded; never 500
CLEAR = {200, 400, 404, 413, 422, 429}


def encode(body) -> bytes:
    text = json.dumps(body, allow_nan=True)  # NaN and Infinity: not JSON, the server must say so
    return text.encode()


@pytest.fixture(scope="module")
def server(tiny_engine):
    with http_api(tiny_engine, max_sessions=4, max_queue=8) as (port, _):
        yield port


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(ROUTES),
    shape=st.sampled_from(["bent", "bent", "random", "not an object"]),
    bend=overrides,
    other=values,
)
def test_every_body_gets_a_clear_status_in_time(server, route, shape, bend, other):
    body = {**BASE[route], **bend} if shape == "bent" else bend if shape == "random" else other
    if shape == "bent" and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64  # decode a little: the fuzzing is of the fields, not of patience
    req = urllib.request.Request(
        f"http://127.0.0.1:{server}{route}", data=encode(body), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    assert status in CLEAR, (route, body, status, text[:300])
    if status != 200:
        assert "message" in text or "error" in text, (route, status, text[:300])


def test_after_the_fuzzing_the_server_serves_and_holds_no_session(server, tiny_engine):
    from tests.conftest import wait_for

    assert wait_for(lambda: not tiny_engine.verifier.sessions)  # every fuzzed request's session closed
    out = tiny_engine.generate(GenerationRequest(tiny_engine.encode("x"), 2)).result()
    assert out["finish_reason"] in ("stop", "length")
