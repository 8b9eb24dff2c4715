"""gRPC contract of specmesh.v1.Generation: streaming, final message, every error status."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ServerConfig
from services.router.engine import GenerationRequest
from services.router.grpc_server import SERVICE_NAME, build_server
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import finish_order_by_priority


@pytest.fixture(scope="module")
def served(tiny_engine):
    server, servicer, port = build_server(tiny_engine, ServerConfig(port=0, max_sessions=2, response_stats=True))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.GenerationStub(channel), servicer, channel
    channel.close()
    server.stop(0)


def collect(stub, **kw):
    return list(stub.Generate(pb.GenerateRequest(**kw), timeout=30))


def wait_idle(servicer, timeout=5.0):
    end = time.time() + timeout
    while servicer.active and time.time() < end:
        time.sleep(0.01)
    return not servicer.active


def test_stream_matches_engine_and_ends_with_final(served, tiny_engine):
    stub, servicer, _ = served
    msgs = collect(stub, prompt="def add(a, b):\n", max_new_tokens=40, method="sd")
    final = msgs[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(msgs) >= 2 and all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    ids = [t for m in msgs for t in m.token_ids]
    ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode("def add(a, b):\n"), 40, method="vanilla")).result()
    assert ids == ref["token_ids"]
    assert "".join(m.text for m in msgs) == ref["text"]
    assert final.usage.completion_tokens == 40 and final.usage.prompt_tokens == len(
        tiny_engine.encode("def add(a, b):\n")
    )
    s = final.stats
    assert s.cycles == len(msgs) - 1 or s.cycles >= len(msgs) - 1
    assert abs(s.tau - 40 / s.cycles) < 1e-6 and s.accepted_tokens <= s.draft_tokens
    assert final.method == "sd"
    assert wait_idle(servicer)


def test_streams_beyond_the_servers_worker_threads_decode_at_once(tiny_engine):
    """The server runs on grpc.aio: a stream holds a worker thread only to validate and be
    admitted, so 8 streams decode together on a server with 4 such workers, each answer whole."""
    server, servicer, port = build_server(tiny_engine, ServerConfig(port=0, max_sessions=8, max_queue=0, workers=1))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.GenerationStub(channel)
        collect(stub, prompt="x = 1", max_new_tokens=2)  # the engine's and the channel's threads are up
        threads = threading.active_count()
        ask = dict(prompt="def add(a, b):\n", max_new_tokens=200, method="sd", ignore_eos=True)
        streams = [stub.Generate(pb.GenerateRequest(**ask), timeout=60) for _ in range(8)]
        firsts = [next(s) for s in streams]  # every stream has begun answering
        assert len(servicer.active) == 8  # all decoding at once, though at most 4 could hold a thread
        assert threading.active_count() - threads <= 4, "; ".join(t.name for t in threading.enumerate())  # not 8
        answers = [[*f.token_ids, *(t for m in s for t in m.token_ids)] for f, s in zip(firsts, streams)]
        ids = tiny_engine.encode("def add(a, b):\n")
        ref = tiny_engine.generate(GenerationRequest(ids, 200, method="vanilla", ignore_eos=True)).result()
        assert answers == [ref["token_ids"]] * 8
        assert wait_idle(servicer)
    finally:
        channel.close()
        server.stop(0)


def test_usage_reports_the_prompt_tokens_the_prefix_cache_gave(served, tiny_engine):
    stub, _, _ = served
    prompt = "".join(f"def usage_{i}(x):\n    return x + {i}\n\n" for i in range(6))
    n = len(tiny_engine.encode(prompt))
    first, again = (collect(stub, prompt=prompt, max_new_tokens=4, method="vanilla")[-1].usage for _ in range(2))
    assert first.cached_prompt_tokens == 0 and first.prompt_tokens == n
    assert again.cached_prompt_tokens == (n - 1) // 32 * 32 >= 32


def test_cache_salt_keeps_prefix_cache_blocks_within_a_tenant(served, tiny_engine):
    stub, _, _ = served
    prompt = "".join(f"def salted_{i}(x):\n    return x % {i + 2}\n\n" for i in range(6))
    n = len(tiny_engine.encode(prompt))

    def cached(salt: str) -> int:
        return collect(stub, prompt=prompt, max_new_tokens=4, method="sd", cache_salt=salt)[
            -1
        ].usage.cached_prompt_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached("") == 0  # other salts, and none, do not see tenant a's blocks
    assert cached("tenant-a") == (n - 1) // 32 * 32 > 0
    assert cached("") == (n - 1) // 32 * 32  # no salt shares with no salt


def test_logprobs_are_the_target_log_probabilities_of_each_streamed_token(served, tiny_engine):
    """Aligned with token_ids in every message; equal to a full forward of the target over the
    prompt and output (whatever drafted them); the alternatives best first; absent unless asked."""
    import torch

    stub, _, _ = served
    prompt = "def mean(xs):\n"
    ids = tiny_engine.encode(prompt)
    model = tiny_engine.verifier.runner.model
    for method in ("vanilla", "sd", "suffix", "suffix-tree"):
        msgs = collect(stub, prompt=prompt, max_new_tokens=24, method=method, logprobs=4)
        assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
        out = [t for m in msgs for t in m.token_ids]
        lps = [x for m in msgs for x in m.logprobs]
        with torch.no_grad():
            ref = torch.log_softmax(model.forward_train(torch.tensor([ids + out]))[0].float(), -1)
        for j, (t, x) in enumerate(zip(out, lps)):
            row = ref[len(ids) - 1 + j]
            assert x.token_id == t and abs(x.logprob - float(row[t])) < 1e-4, (method, j)
            assert len(x.top_ids) == 4 and x.top_ids[0] == t  # greedy: the token is the best
            assert list(x.top_logprobs) == sorted(x.top_logprobs, reverse=True)
            assert abs(x.top_logprobs[1] - float(row[x.top_ids[1]])) < 1e-4
    assert not any(m.logprobs for m in collect(stub, prompt=prompt, max_new_tokens=4, method="sd"))
    own = collect(stub, prompt=prompt, max_new_tokens=4, method="sd", logprobs=0)
    assert all(len(x.top_ids) == 0 for m in own for x in m.logprobs) and sum(len(m.logprobs) for m in own) == 4


def check_prompt_logprobs(lps, ids: list[int], model, top: int) -> None:
    """One per prompt token after the first, equal to a full forward of the target."""
    import torch

    with torch.no_grad():
        ref = torch.log_softmax(model.forward_train(torch.tensor([ids]))[0].float(), -1)
    assert [x.token_id for x in lps] == ids[1:]
    for j, x in enumerate(lps):
        assert abs(x.logprob - float(ref[j, ids[j + 1]])) < 1e-4, j
        assert len(x.top_ids) == top and list(x.top_logprobs) == sorted(x.top_logprobs, reverse=True)
        assert not top or abs(x.top_logprobs[0] - float(ref[j].max())) < 1e-4


def test_prompt_logprobs_are_the_targets_and_bypass_the_prefix_cache(served, tiny_engine):
    """The last message carries every prompt token's log-probability after the first, for any
    method; a prompt whose blocks are cached is still prefilled whole for them."""
    stub, _, _ = served
    prompt = "".join(f"def plp_{i}(x):\n    return x + {i}\n" for i in range(6))
    ids = tiny_engine.encode(prompt)
    assert len(ids) > 64
    warm = collect(stub, prompt=prompt, max_new_tokens=4, method="sd")  # its blocks are now cached
    assert (
        not warm[-1].prompt_logprobs and collect(stub, prompt=prompt, max_new_tokens=4)[-1].usage.cached_prompt_tokens
    )
    for method in ("vanilla", "sd", "suffix"):
        msgs = collect(stub, prompt=prompt, max_new_tokens=4, method=method, prompt_logprobs=3)
        assert msgs[-1].usage.cached_prompt_tokens == 0
        check_prompt_logprobs(msgs[-1].prompt_logprobs, ids, tiny_engine.verifier.runner.model, 3)


def test_prompt_logprobs_with_chunked_prefill(served, tiny_engine):
    """A prompt prefilled in chunks beside a decoding session gets the same prompt logprobs."""
    from services.common.types import CycleRequest, SessionSpec

    stub, _, _ = served
    core = tiny_engine.verifier
    ids = list(range(300, 420))
    other = core.open(SessionSpec(tiny_engine.encode("x = 1\n"), 8))
    other.cycle(CycleRequest())
    core.prefill_chunk = 16
    try:
        msgs = collect(stub, prompt_token_ids=ids, max_new_tokens=4, method="vanilla", prompt_logprobs=0)
    finally:
        core.prefill_chunk = tiny_engine.cfg.prefill_chunk
        other.close()
    check_prompt_logprobs(msgs[-1].prompt_logprobs, ids, core.runner.model, 0)


def test_prompt_token_ids_and_default_method(served, tiny_engine):
    stub, _, _ = served
    ids = tiny_engine.encode("import os\n")
    msgs = collect(stub, prompt_token_ids=ids, max_new_tokens=8)
    assert msgs[-1].method == tiny_engine.default_method == "sd"  # hybrid needs the predictor
    assert sum(len(m.token_ids) for m in msgs) == 8


def test_a_request_that_names_no_method_gets_the_engines_default_in_process_too(tiny_engine):
    ids = tiny_engine.encode("import os\n")
    assert GenerationRequest(ids, 4).method == ""  # no front end picks a default of its own
    assert tiny_engine.generate(GenerationRequest(ids, 4)).result()["method"] == tiny_engine.default_method
    (g,) = tiny_engine.generate_all(GenerationRequest(ids, 4)).gens
    assert g.req.method == tiny_engine.default_method


def test_stop_string_ends_stream_without_emitting_it(served, tiny_engine):
    stub, _, _ = served
    full = tiny_engine.generate(GenerationRequest(tiny_engine.encode("x = ["), 60, method="vanilla")).result()["text"]
    stop = full[12:15]
    msgs = collect(stub, prompt="x = [", max_new_tokens=60, stop=[stop], method="sd")
    text = "".join(m.text for m in msgs)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    assert text == full[: full.index(stop)] and stop not in text
    msgs = collect(stub, prompt="x = [", max_new_tokens=60, stop=[stop], method="sd", include_stop_str_in_output=True)
    assert "".join(m.text for m in msgs) == full[: full.index(stop) + len(stop)]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP


def test_stop_token_ids_end_the_stream_after_the_token(served, tiny_engine):
    """The first generated stop token ends the stream and is part of it, whichever method
    committed tokens past it in the same cycle."""
    stub, _, _ = served
    ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode("x = ["), 40, method="vanilla")).result()[
        "token_ids"
    ]
    stop = ref[9]
    for method in ("vanilla", "sd"):
        msgs = collect(stub, prompt="x = [", max_new_tokens=40, stop_token_ids=[stop, 8191], method=method)
        assert [t for m in msgs for t in m.token_ids] == ref[: ref.index(stop) + 1], method
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP


def test_a_temperature_below_vllms_epsilon_decodes_greedily(served):
    """A denormal temperature overflowed the logits it divides (UNKNOWN to the client); below
    1e-5 it is greedy, as in vLLM, with every method."""
    stub, servicer, _ = served
    for method in ("vanilla", "sd", "suffix"):
        greedy = [
            t for m in collect(stub, prompt="def add(a, b):", max_new_tokens=12, method=method) for t in m.token_ids
        ]
        tiny = [
            t
            for m in collect(stub, prompt="def add(a, b):", max_new_tokens=12, method=method, temperature=1e-45, seed=7)
            for t in m.token_ids
        ]
        assert tiny == greedy, method
    assert wait_idle(servicer)


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"prompt": "", "max_new_tokens": 5}, "prompt"),
        ({"prompt": "a", "prompt_token_ids": [1], "max_new_tokens": 5}, "prompt"),
        ({"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": -3}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 100000}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 5, "temperature": -0.5}, "temperature"),
        ({"prompt": "a", "max_new_tokens": 5, "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "max_new_tokens": 5, "temperature": float("inf")}, "temperature"),
        ({"prompt": "a", "max_new_tokens": 5, "top_p": 0.0}, "top_p"),
        ({"prompt": "a", "max_new_tokens": 5, "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "max_new_tokens": 5, "top_k": -1}, "top_k"),
        ({"prompt": "a", "max_new_tokens": 5, "min_p": 1.5}, "min_p"),
        ({"prompt": "a", "max_new_tokens": 5, "min_p": -0.25}, "min_p"),
        ({"prompt": "a", "max_new_tokens": 5, "method": "warp-drive"}, "method"),
        ({"prompt": "a", "max_new_tokens": 5, "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "max_new_tokens": 5, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "max_new_tokens": 5, "cache_salt": "s" * 257}, "cache_salt"),
        ({"prompt": "a", "max_new_tokens": 5, "min_tokens": 6}, "min_tokens"),
        ({"prompt": "a", "max_new_tokens": 5, "stop": ["s"] * 17}, "stop"),
        ({"prompt": "a", "max_new_tokens": 5, "stop": ["s" * 257]}, "stop"),
        ({"prompt": "a", "max_new_tokens": 5, "stop_token_ids": [9000]}, "stop_token_ids"),
        ({"prompt": "a", "max_new_tokens": 5, "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"prompt": "a", "max_new_tokens": 5, "repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"prompt": "a", "max_new_tokens": 5, "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "a", "max_new_tokens": 5, "frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"prompt_token_ids": [9000], "max_new_tokens": 5}, "prompt_token_ids"),
        ({"prompt": "word " * 400, "max_new_tokens": 5}, "prompt"),  # longer than the 256-token context
        ({"prompt": "a", "max_new_tokens": 5, "structured_output": {"regex": "(a"}}, "structured_output"),
        (
            {"prompt": "a", "max_new_tokens": 5, "structured_output": {"json_schema": "{"}},
            "structured_output.json_schema",
        ),
        ({"prompt": "a", "max_new_tokens": 5, "structured_output": {}}, "structured_output"),
        (
            {"prompt": "a", "max_new_tokens": 5, "structured_output": {"regex": "a+"}, "ignore_eos": True},
            "structured_output",
        ),
        ({"prompt": "a", "max_new_tokens": 5, "n": 0}, "n"),
        ({"prompt": "a", "max_new_tokens": 5, "logit_bias": {5: 101.0}}, "logit_bias"),
        ({"prompt": "a", "max_new_tokens": 5, "logit_bias": {9000: 1.0}}, "logit_bias"),
        ({"prompt": "a", "max_new_tokens": 5, "allowed_token_ids": [1, 9000]}, "allowed_token_ids"),
        ({"prompt": "a", "max_new_tokens": 5, "n": 3}, "n"),  # more completions than the server's 2 sessions
        ({"prompt": "a", "max_new_tokens": 5, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt": "a", "max_new_tokens": 5, "bad_words": ["w"] * 65}, "bad_words"),
        ({"prompt": "a", "max_new_tokens": 5, "bad_words": ["word " * 40]}, "bad_words"),
        ({"prompt": "a", "max_new_tokens": 5, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_invalid_argument_names_the_field(served, kw, field):
    stub, servicer, _ = served
    with pytest.raises(grpc.RpcError) as e:
        collect(stub, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()
    assert wait_idle(servicer)


def test_truncate_prompt_tokens_keeps_the_prompts_end(served, tiny_engine):
    """As vLLM's: the last N prompt tokens are the prompt; -1 keeps what fits the context, so a
    prompt too long for it (refused without truncation) is served."""
    stub, _, _ = served
    prompt = "".join(f"def trunc_{i}(x):\n    return x + {i}\n\n" for i in range(30))
    ids = tiny_engine.encode(prompt)
    assert len(ids) > 256  # longer than the tiny model's context
    for keep, kept in ((40, ids[-40:]), (-1, ids[-(256 - 16) :])):
        msgs = collect(stub, prompt=prompt, max_new_tokens=16, method="sd", truncate_prompt_tokens=keep)
        ref = tiny_engine.generate(GenerationRequest(kept, 16, method="vanilla")).result()
        assert [t for m in msgs for t in m.token_ids] == ref["token_ids"]
        assert msgs[-1].usage.prompt_tokens == len(kept)
    assert collect(stub, prompt="ab", max_new_tokens=4, truncate_prompt_tokens=100)[-1].usage.prompt_tokens == len(
        tiny_engine.encode("ab")
    )


def test_deadline_exceeded_frees_session(served):
    stub, servicer, _ = served
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="def f():", max_new_tokens=200, method="vanilla"), timeout=0.02))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(servicer)


def test_cancelled_stream_frees_session_and_drafter_state(served, tiny_engine):
    stub, servicer, _ = served
    call = stub.Generate(pb.GenerateRequest(prompt="class A:", max_new_tokens=200, method="sd"), timeout=30)
    next(call)
    call.cancel()
    assert wait_idle(servicer)
    assert not tiny_engine.verifier.drafters["draft-lm"].states


def test_admission_queues_then_refuses(served):
    """Slots full: a request waits in the queue (and runs when a slot frees); queue full: refused."""
    import threading

    stub, servicer, _ = served
    adm = servicer.admission
    with adm._cond:
        adm.running = adm.max_sessions  # every slot taken
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("msgs", collect(stub, prompt="a", max_new_tokens=3)))
    waiter.start()
    end = time.time() + 5
    while adm.waiting == 0 and time.time() < end:
        time.sleep(0.01)
    assert adm.waiting == 1 and "msgs" not in result  # queued, not refused
    old_queue, adm.max_queue = adm.max_queue, 1
    try:
        with pytest.raises(grpc.RpcError) as e:
            collect(stub, prompt="a", max_new_tokens=3)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in e.value.details()
    finally:
        adm.max_queue = old_queue
        with adm._cond:
            adm.running = 0
            adm._cond.notify_all()
    waiter.join(10)
    assert result["msgs"][-1].finish_reason == pb.FINISH_REASON_LENGTH  # the queued request ran


def test_a_queued_request_with_a_lower_priority_value_is_admitted_first(tiny_engine):
    """Generate's priority reaches the admission queue: of two queued requests, the later one
    with priority -1 is admitted first (one slot, so "first" waits until urgent's frees)."""
    srv, servicer, port = build_server(tiny_engine, ServerConfig(port=0, max_sessions=1, max_queue=4))
    srv.start()
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        send = lambda p: collect(stub, prompt="a", max_new_tokens=3, priority=p)  # noqa: E731
        assert finish_order_by_priority(servicer.admission, send) == ["urgent", "first"]
    finally:
        srv.stop(0)


def test_queued_request_leaves_at_its_deadline(served):
    stub, servicer, _ = served
    adm = servicer.admission
    with adm._cond:
        adm.running = adm.max_sessions
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="a", max_new_tokens=3), timeout=0.3))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert adm.waiting == 0
    finally:
        with adm._cond:
            adm.running = 0
            adm._cond.notify_all()


def test_health_and_reflection(served):
    _, _, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
        )
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services


def test_generated_code_is_up_to_date(tmp_path):
    from pathlib import Path

    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    protos = sorted((root / "protos/specmesh/v1").glob("*.proto"))
    assert len(protos) == 5
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{root / 'protos'}",
                f"--python_out={tmp_path}",
                f"--grpc_python_out={tmp_path}",
                *map(str, protos),
            ]
        )
        == 0
    )
    for proto in protos:
        for name in (f"{proto.stem}_pb2.py", f"{proto.stem}_pb2_grpc.py"):
            assert (tmp_path / "specmesh/v1" / name).read_text() == (root / "specmesh/v1" / name).read_text(), (
                f"specmesh/v1/{name} is stale: run `make protos`"
            )


def test_cancelled_stream_stops_its_prompt_prefill_at_the_next_step(served, tiny_engine):
    """A client that cancels while its long prompt is prefilling in chunks (another stream is
    decoding): the server stops feeding that prompt at the next step and frees the session;
    the other stream carries on."""
    stub, servicer, _ = served
    core = tiny_engine.verifier
    chunks: list[int] = []
    step = core.runner.step

    def logged(verify, prefill, trees=None, gates=None):
        chunks.extend(n for _, n in prefill)
        return step(verify, prefill, trees, gates)

    core.runner.step, core.prefill_chunk = logged, 2
    try:
        other = stub.Generate(pb.GenerateRequest(prompt="#", max_new_tokens=150, method="vanilla"), timeout=60)
        next(other)
        call = stub.Generate(
            pb.GenerateRequest(prompt_token_ids=list(range(300, 500)), max_new_tokens=4, method="vanilla"), timeout=60
        )
        end = time.time() + 30
        while len(chunks) < 3 and time.time() < end:
            time.sleep(0.001)
        assert len(chunks) >= 3, "the long prompt never prefilled in chunks"
        call.cancel()
        end = time.time() + 10
        while len(servicer.active) > 1 and time.time() < end:
            time.sleep(0.005)
        assert len(servicer.active) == 1  # the cancelled request is gone
        fed = len(chunks)
        time.sleep(0.2)
        assert len(chunks) == fed  # it stopped, and before the end (100
        assert sum(chunks) < 150  # chunks of 2 when fed whole)
        assert sum(len(m.token_ids) for m in other) > 0  # the other stream finishes
    finally:
        core.runner.step, core.prefill_chunk = step, tiny_engine.cfg.prefill_chunk
    assert wait_idle(servicer)


def test_structured_output_streams_a_json_instance_of_the_schema(served, tiny_engine):
    """A JSON schema over gRPC: the stream is the engine's constrained output, and it parses
    into an instance of the schema."""
    import json

    from services.common.structured import StructuredOutput

    stub, servicer, _ = served
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
            "required": ["ok", "tag"],
        }
    )
    msgs = collect(
        stub,
        prompt="def add(a, b):\n",
        max_new_tokens=60,
        method="sd",
        structured_output=pb.StructuredOutput(json_schema=schema),
    )
    ref = tiny_engine.generate(
        GenerationRequest(
            tiny_engine.encode("def add(a, b):\n"),
            60,
            method="vanilla",
            structured=StructuredOutput(json_schema=schema),
        )
    ).result()
    assert [t for m in msgs for t in m.token_ids] == ref["token_ids"]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_EOS
    obj = json.loads("".join(m.text for m in msgs))
    assert isinstance(obj["ok"], bool) and obj["tag"] in ("a", "b")
    choice = collect(
        stub,
        prompt="x = ",
        max_new_tokens=20,
        method="sd",
        structured_output=pb.StructuredOutput(choice=pb.Choices(values=["None", "True", "[1, 2]"])),
    )
    assert "".join(m.text for m in choice) in ("None", "True", "[1, 2]")
    assert wait_idle(servicer)


def test_n_completions_stream_with_their_index_and_a_final_each(served, tiny_engine):
    """n = 2 sampled with seed 5: the messages of index i are the single request with seed
    5 + i, and each completion ends with its own final message."""
    from services.common.types import Sampling

    stub, servicer, _ = served
    msgs = collect(stub, prompt="def add(a, b):\n", max_new_tokens=24, method="sd", temperature=1.0, seed=5, n=2)
    finals = [m for m in msgs if m.finish_reason]
    assert sorted(m.index for m in finals) == [0, 1] and msgs[-1].finish_reason
    for i in (0, 1):
        single = tiny_engine.generate(
            GenerationRequest(
                tiny_engine.encode("def add(a, b):\n"),
                24,
                method="sd",
                sampling=Sampling(temperature=1.0, seed=5 + i),
            )
        ).result()
        assert [t for m in msgs if m.index == i for t in m.token_ids] == single["token_ids"]
        assert next(m for m in finals if m.index == i).usage.completion_tokens == len(single["token_ids"])
    assert wait_idle(servicer)


@pytest.mark.parametrize("skip", [None, True, False])
def test_skip_special_tokens(served, tiny_engine, skip):
    """Only the end-of-sequence token allowed, streamed with ignore_eos: its ids come either
    way, and its text only with skip_special_tokens=false (vLLM's default skips it)."""
    stub = served[0]
    eos = tiny_engine.eos_id
    kw = {} if skip is None else {"skip_special_tokens": skip}
    msgs = collect(
        stub, prompt="def f():\n", max_new_tokens=3, method="vanilla", ignore_eos=True, allowed_token_ids=[eos], **kw
    )
    assert [t for m in msgs for t in m.token_ids] == [eos] * 3
    assert "".join(m.text for m in msgs) == ("" if skip in (None, True) else "<|endoftext|>" * 3)


def test_the_last_message_names_what_stopped_the_stream(served, tiny_engine):
    """stop_reason (vLLM's) on the final message: the stop token id or the stop string; neither
    when the length limit ended it."""
    stub = served[0]
    ref = collect(stub, prompt="def f():\n", max_new_tokens=12, method="vanilla")
    ids = [t for m in ref for t in m.token_ids]
    text = "".join(m.text for m in ref)
    assert ref[-1].WhichOneof("stop_reason") is None and ref[-1].finish_reason == pb.FINISH_REASON_LENGTH
    by_token = collect(stub, prompt="def f():\n", max_new_tokens=12, method="sd", stop_token_ids=[ids[2]])
    assert by_token[-1].WhichOneof("stop_reason") == "stop_token_id" and by_token[-1].stop_token_id == ids[2]
    word = text[4:7]
    by_string = collect(stub, prompt="def f():\n", max_new_tokens=12, method="suffix", stop=[word])
    assert by_string[-1].WhichOneof("stop_reason") == "stop_string" and by_string[-1].stop_string == word
    assert by_string[-1].finish_reason == pb.FINISH_REASON_STOP
