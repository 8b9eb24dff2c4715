"""SGLang's native ``POST /generate`` over HTTP: the engine's greedy tokens, SGLang's
sampling-parameter names and defaults, its meta_info (finish reasons with what matched), batches
and n, a cumulative stream, and errors naming the field as SGLang does."""

import json
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from services.router.engine import GenerationRequest
from tests.contract.test_openai_api import http_api

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def url(tiny_engine):
    with http_api(tiny_engine, response_stats=True) as (port, _):
        yield f"http://127.0.0.1:{port}/generate"


def greedy(engine, prompt: str, n_tokens: int, **kw) -> dict:
    return engine.generate(GenerationRequest(engine.encode(prompt), n_tokens, method="vanilla", **kw)).result()


class Answer:
    def __init__(self, status_code: int, text: str):
        self.status_code, self.text = status_code, text

    def json(self):
        return json.loads(self.text)


def post(url: str, body: dict) -> Answer:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Answer(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())


def sse(url: str, body: dict) -> list[str]:
    """The data of each server-sent event."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [ln[len("data: ") :] for ln in (raw.decode().rstrip("\n") for raw in r) if ln.startswith("data: ")]


@pytest.mark.parametrize("method", ["vanilla", "sd", "suffix"])
def test_generate_equals_the_engines_greedy_output(url, tiny_engine, method):
    ref = greedy(tiny_engine, PROMPT, 12)
    out = post(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "method": method})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["output_ids"] == ref["token_ids"] and body["text"] == ref["text"]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(tiny_engine.encode(PROMPT)) and meta["completion_tokens"] == 12
    assert meta["spec_verify_ct"] == meta["speculation"]["cycles"] > 0 and meta["speculation"]["method"] == method
    if method == "vanilla":
        assert meta["spec_verify_ct"] == 12


def test_stops_report_what_matched(url, tiny_engine):
    ref = greedy(tiny_engine, PROMPT, 12)
    third = ref["token_ids"][2]
    body = post(
        url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [third]}}
    ).json()
    assert body["output_ids"] == ref["token_ids"][:3]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    word = ref["text"][4:7]
    assert word and ref["text"].find(word) == 4
    body = post(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": word}}).json()
    assert body["text"] == ref["text"][:4] and body["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    kept = post(
        url,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": [word], "no_stop_trim": True},
        },
    ).json()
    assert kept["text"] == ref["text"][:7]


def test_batches_and_n_answer_lists_prompt_major(url, tiny_engine):
    prompts = [PROMPT, "class Stack:\n"]
    refs = [greedy(tiny_engine, p, 6) for p in prompts]
    out = post(
        url,
        {
            "input_ids": [tiny_engine.encode(p) for p in prompts],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2},
        },
    ).json()
    assert isinstance(out, list) and [o["output_ids"] for o in out] == [r["token_ids"] for r in refs for _ in (0, 1)]
    one = post(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2}}).json()
    assert isinstance(one, list) and len(one) == 2


def test_the_default_length_is_sglangs(url):
    body = post(url, {"text": PROMPT, "sampling_params": {"temperature": 0, "ignore_eos": True}}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(body["output_ids"]) == 128


def test_a_stream_carries_the_completion_so_far(url, tiny_engine):
    ref = greedy(tiny_engine, PROMPT, 16)
    lines = sse(
        url,
        {"text": PROMPT, "stream": True, "method": "sd", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
    )
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    assert len(chunks) >= 2 and all(c["index"] == 0 for c in chunks)
    for a, b in zip(chunks, chunks[1:]):  # cumulative: each extends the one before
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["text"] == ref["text"] and last["output_ids"] == ref["token_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 16}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": PROMPT, "max_new_tokens": 4}, "max_new_tokens: unknown field"),
        ({"text": PROMPT, "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens: unknown field"),
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens:"),
        ({"text": PROMPT, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature:"),
        ({"text": PROMPT, "sampling_params": {"min_new_tokens": -1}}, "sampling_params.min_new_tokens:"),
        ({"text": PROMPT, "sampling_params": {"json_schema": "{}", "regex": "a+"}}, "sampling_params.json_schema:"),
        ({"text": PROMPT, "input_ids": [1, 2]}, "text:"),
        ({"sampling_params": {}}, "text:"),
        ({"text": PROMPT, "sampling_params": []}, "sampling_params:"),
    ],
)
def test_errors_name_the_field_as_sglang_does(url, body, field):
    out = post(url, body)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["message"].startswith(field), out.json()


def test_structured_output_through_sglang_names(url):
    body = post(
        url, {"text": "x = ", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": "[0-9]{3}"}}
    ).json()
    assert len(body["text"]) == 3 and body["text"].isdigit()
    assert body["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_bad_grammar_is_named_by_its_parameter(url):
    for field, value in (("regex", "(unclosed"), ("json_schema", "{not json")):
        out = post(url, {"text": "x", "sampling_params": {"max_new_tokens": 4, field: value}})
        assert out.status_code == 400 and out.json()["error"]["message"].startswith(f"sampling_params.{field}:"), (
            out.text
        )


def get(url: str) -> Answer:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return Answer(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())


def test_model_info_names_the_target(url, tiny_engine):
    info = get(url.replace("/generate", "/get_model_info")).json()
    assert info["model_path"] == info["tokenizer_path"] == str(tiny_engine.cfg.target)
    assert info["is_generation"] is True and info["model_type"] == "llama"
    assert info["architectures"] == json.loads((tiny_engine.cfg.target / "config.json").read_text()).get(
        "architectures"
    )


def test_server_info_reports_limits_and_the_accept_length(url, tiny_engine):
    from services.common.metrics import decoding_totals

    post(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "method": "suffix"})
    info = get(url.replace("/generate", "/get_server_info")).json()
    cycles, tokens = decoding_totals()  # nothing decodes between the two reads
    assert info["max_running_requests"] == 4 and info["max_queued_requests"] == 32
    assert info["speculative_algorithm"] == tiny_engine.default_method and "suffix" in info["methods"]
    assert info["context_length"] == tiny_engine.context_len
    cfg = tiny_engine.cfg
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (
        cfg.eagle3_k,
        cfg.eagle3_topk,
        cfg.eagle3_tree_tokens,
    )
    (state,) = info["internal_states"]
    assert state["avg_spec_accept_length"] == round(tokens / cycles, 4) >= 1.0
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
    assert get(url.replace("/generate", "/server_info")).json()["max_running_requests"] == 4  # SGLang's newer name


@pytest.fixture
def served(tiny_engine):
    """A server of one session slot and no queue, its health check waiting 1.5 s."""
    from services.assembly import start_http
    from services.common.config import ServerConfig
    from services.router.grpc_server import build_server

    cfg = ServerConfig(port=0, http_port=0, max_sessions=1, max_queue=0, health_check_timeout_s=1.5)
    server, servicer, _ = build_server(tiny_engine, cfg)
    server.start()
    http = start_http(tiny_engine, cfg, servicer)
    try:
        yield f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}", servicer.admission, http
    finally:
        http.stop()
        server.stop(0)


class _Held:
    """An admission context that holds its slot and never goes away."""

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> None:
        return None


def scrape_value(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_health_generate_decodes_a_token_outside_the_request_metrics(served, tiny_engine):
    base, _, _ = served
    probe = {"method": tiny_engine.default_method, "finish_reason": "length"}
    requests, steps = scrape_value("specmesh_requests_total", **probe), scrape_value("specmesh_verify_batch_size_count")
    assert get(f"{base}/health_generate").status_code == 200
    assert scrape_value("specmesh_verify_batch_size_count") > steps  # the probe's token was verified
    assert scrape_value("specmesh_requests_total", **probe) == requests


def test_health_generate_takes_others_progress_when_admission_is_full(served, tiny_engine):
    """A busy server is healthy without queueing its probe; a full one that emits nothing is not."""
    import threading

    base, admission, _ = served
    assert admission.acquire(_Held()) is None  # the only slot is taken, and nothing decodes in it
    try:
        refused = scrape_value("specmesh_requests_rejected_total", code="RESOURCE_EXHAUSTED")
        out = get(f"{base}/health_generate")
        assert out.status_code == 503 and "no token generated within 1.5 s" in out.json()["error"]["message"]
        assert scrape_value("specmesh_requests_rejected_total", code="RESOURCE_EXHAUSTED") == refused + 1

        gen = tiny_engine.generate(
            GenerationRequest(tiny_engine.encode(PROMPT), 200, method="vanilla", ignore_eos=True)
        )
        stop, started = threading.Event(), threading.Event()

        def decode_slowly():  # a request decoding outside this server's admission: progress
            steps = iter(gen)
            for _ in steps:
                started.set()
                if stop.wait(0.05):
                    break
            steps.close()

        t = threading.Thread(target=decode_slowly)
        t.start()
        try:
            assert started.wait(30)
            assert get(f"{base}/health_generate").status_code == 200
            assert scrape_value("specmesh_requests_rejected_total", code="RESOURCE_EXHAUSTED") == refused + 2
        finally:
            stop.set()
            t.join(30)
    finally:
        admission.release(1)


def test_health_generate_is_503_while_draining(served):
    base, _, http = served
    assert get(f"{base}/health_generate").status_code == 200
    http.drain()
    assert get(f"{base}/health_generate").status_code == 503 and get(f"{base}/ping").status_code == 503


@contextmanager
def both_apis(engine, **cfg):
    """gRPC and HTTP over one engine and one admission: (HTTP base URL, gRPC port, servicer)."""
    from services.assembly import start_http
    from services.common.config import ServerConfig
    from services.router.grpc_server import build_server

    cfg = ServerConfig(port=0, http_port=0, **{"max_sessions": 4, **cfg})
    server, servicer, port = build_server(engine, cfg)
    server.start()
    http = start_http(engine, cfg, servicer)
    try:
        yield f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}", port, servicer
    finally:
        http.stop()
        server.stop(0)


@contextmanager
def slowed(engine, seconds: float):
    """Every verifier step takes ``seconds`` longer: a request decodes long enough to be aborted."""
    import time

    core = engine.verifier
    step = core.runner.step

    def slow(*a, **kw):
        time.sleep(seconds)
        return step(*a, **kw)

    core.runner.step = slow
    try:
        yield
    finally:
        core.runner.step = step


def in_thread(fn):
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()))
    t.start()
    return t, box


def test_abort_request_ends_a_completion_with_what_it_has(tiny_engine):
    """SGLang's POST /abort_request by rid: the request's answer comes at once, finish_reason
    abort, its tokens a prefix of the greedy output; over gRPC (same registry) FINISH_REASON_ABORT."""
    import grpc

    from specmesh.v1 import generate_pb2 as pb
    from specmesh.v1 import generate_pb2_grpc as pb_grpc
    from tests.conftest import wait_for

    ref = greedy(tiny_engine, PROMPT, 150, ignore_eos=True)["token_ids"]
    with both_apis(tiny_engine) as (base, port, servicer), slowed(tiny_engine, 0.02):
        body = {
            "text": PROMPT,
            "rid": "job-1",
            "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True},
        }
        t, box = in_thread(lambda: post(f"{base}/generate", body))
        assert wait_for(lambda: len(servicer.active) == 1, timeout=30)
        assert post(f"{base}/abort_request", {"rid": "job-1"}).json() == {"aborted": 1}
        t.join(30)
        out = box["out"].json()
        assert out["meta_info"]["finish_reason"] == {"type": "abort"}
        assert 0 < len(out["output_ids"]) < 150 and out["output_ids"] == ref[: len(out["output_ids"])]

        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stream = stub.Generate(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=150, method="sd", ignore_eos=True, request_id="grpc-1"),
            timeout=60,
        )
        first = next(stream)
        assert post(f"{base}/abort_request", {"rid": "grpc-1"}).json() == {"aborted": 1}
        msgs = [first, *stream]
        ids = [t for m in msgs for t in m.token_ids]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_ABORT and ids == ref[: len(ids)] and len(ids) < 150

        stream = stub.Generate(
            pb.GenerateRequest(
                prompt=PROMPT, max_new_tokens=150, method="vanilla", ignore_eos=True, request_id="grpc-2"
            ),
            timeout=60,
        )
        first = next(stream)
        assert stub.Abort(pb.AbortRequest(request_id="grpc-2"), timeout=10).aborted == 1  # gRPC's own Abort
        msgs = [first, *stream]
        ids = [t for m in msgs for t in m.token_ids]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_ABORT and ids == ref[: len(ids)] and len(ids) < 150
        with pytest.raises(grpc.RpcError) as e:
            stub.Abort(pb.AbortRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    assert not servicer.active


def test_abort_all_ends_running_and_queued_requests(tiny_engine):
    from tests.conftest import wait_for

    with both_apis(tiny_engine, max_sessions=1, max_queue=1) as (base, _, servicer), slowed(tiny_engine, 0.02):
        running = in_thread(
            lambda: post(
                f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": 150, "ignore_eos": True, "request_id": "a"}
            )
        )
        assert wait_for(lambda: len(servicer.active) == 1, timeout=30)
        queued = in_thread(
            lambda: post(
                f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": 150, "ignore_eos": True, "request_id": "b"}
            )
        )
        assert wait_for(lambda: servicer.admission.waiting == 1, timeout=30)
        assert post(f"{base}/abort_request", {"abort_all": True}).json() == {"aborted": 1}
        for t, box in (running, queued):
            t.join(30)
        first, second = (box["out"].json()["choices"][0] for _, box in (running, queued))
        assert first["finish_reason"] == second["finish_reason"] == "abort"
        assert 0 < len(first["text"]) and second["text"] == ""  # the queued one ended as it started
        assert (
            post(f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "request_id": "c"}).json()["choices"][0][
                "finish_reason"
            ]
            == "length"
        )  # a later request is not aborted


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "rid:"),
        ({"rid": 5}, "rid:"),
        ({"rid": ""}, "rid:"),
        ({"abort_all": "yes"}, "abort_all:"),
        ({"rid": "x", "bogus": 1}, "bogus: unknown field"),
        ([], "body:"),
    ],
)
def test_abort_request_names_what_to_fix(url, body, field):
    out = post(url.replace("/generate", "/abort_request"), body)
    assert out.status_code == 400 and out.json()["error"]["message"].startswith(field), out.text
