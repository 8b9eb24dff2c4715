"""Hostile and careless clients against a real server, one test per defence (docs/reliability.md,
"Threat model"): each failed before its defence was built."""

import threading

import grpc
import pytest

from services.common.config import ServerConfig
from services.router.engine import GenerationRequest
from services.router.grpc_server import build_server
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def bundled_server(bundled_engine):
    server, _, port = build_server(bundled_engine, ServerConfig(port=0, max_sessions=8))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.GenerationStub(channel)
    channel.close()
    server.stop(0)


@pytest.mark.parametrize("method", ["hybrid", "sd", "suffix"])
def test_two_streams_that_share_a_request_id_are_served_apart(bundled_server, bundled_engine, method):
    """A client's request_id is a label, not the session's key: two concurrent streams that
    share one (a retry, a client library reusing ids) each get their own prompt's greedy tokens
    (before: both ended UNKNOWN with hybrid, one with a KeyError with sd and suffix)."""
    prompts = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n"]
    got: dict[int, list] = {}

    def stream(i: int) -> None:
        req = pb.GenerateRequest(prompt=prompts[i], max_new_tokens=32, method=method, request_id="same")
        try:
            got[i] = list(bundled_server.Generate(req, timeout=120))
        except grpc.RpcError as e:
            got[i] = [e]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    for i, prompt in enumerate(prompts):
        msgs = got[i]
        assert all(isinstance(m, pb.GenerateResponse) for m in msgs), msgs[-1]
        ref = bundled_engine.generate(GenerationRequest(bundled_engine.encode(prompt), 32, method="vanilla")).result()
        assert [t for m in msgs for t in m.token_ids] == ref["token_ids"]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" + " " * 100_000,  # cubic under the old regex (40 s at 4,000 spaces)
        ("<tool_call>" + " " * 50) * 1_700,
        "<tool_call>" + " \n" * 50_000 + "</tool_call>",
        ("<tool_call> x </tool_call>" + " " * 10) * 2_800,
        "<tool_call>{</tool_call>" * 4_200,  # blocks past MAX_CALLS are not parsed
    ],
)
def test_the_tool_call_parser_is_linear_in_a_clients_text(text):
    """A client's own text reaches the parser (an echoed assistant message): 100k characters of
    any shape parse in well under 50 ms."""
    import time

    from services.router.tools import Tools, message

    tools = Tools(({"type": "function", "function": {"name": "f", "parameters": {}}},), "auto")
    assert len(text) >= 100_000
    t0 = time.perf_counter()
    content, calls, called = message(tools, text)
    assert time.perf_counter() - t0 < 0.05
    assert calls == [] and not called and content == text


def test_the_tool_call_parser_reads_each_block_to_its_first_closing_tag():
    from services.router.tools import call_blocks, hermes

    text = 'hi <tool_call> {"name": "f", "arguments": {"a": 1}} </tool_call>\n<tool_call>{"name": "g"}</tool_call><tool_call>'
    assert call_blocks(text) == ['{"name": "f", "arguments": {"a": 1}}', '{"name": "g"}']
    content, calls, called = hermes(text, {"f", "g"})
    assert content == "hi" and called and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert calls[0]["function"]["arguments"] == '{"a": 1}'


def bad_entries(source: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specmesh_redis_bad_entries_total", {"source": source}) or 0.0


def test_bad_suffix_feed_entries_are_skipped_and_counted(redis_url):
    """Redis is shared: a ragged entry, out-of-vocabulary ids or a missing field in the suffix feed
    (before: a crash-looping router, or a step that failed every session in it) are skipped and
    counted, at warm-up and while running, and the good entries around them still arrive."""
    import uuid

    import redis

    from services.drafter.suffix import GlobalSuffixCache
    from services.memory.redis_link import RedisLink
    from services.memory.suffix_feed import SuffixFeed, pack
    from tests.conftest import wait_for

    stream, r = f"test:hostile:{uuid.uuid4().hex}", redis.Redis.from_url(redis_url)
    bad = [{"origin": "x", "tokens": b"\x01\x02\x03"}, {"origin": "x", "tokens": pack([5, 70_000])}, {"origin": "x"}]
    for fields in [*bad, {"origin": "x", "tokens": pack([11, 12, 13])}]:
        r.xadd(stream, fields)
    before = bad_entries("suffix_feed")
    cache = GlobalSuffixCache(64, 100)
    feed = SuffixFeed(RedisLink(redis_url, "suffix_feed"), cache, stream=stream, vocab=1000).start()
    try:
        assert len(cache) == 1 and bad_entries("suffix_feed") - before == 3  # warmed past them
        r.xadd(stream, {"origin": "x", "tokens": b"\xff" * 7})
        r.xadd(stream, {"origin": "x", "tokens": pack([21, 22, 23])})
        assert wait_for(lambda: len(cache) == 2, timeout=10)
        assert bad_entries("suffix_feed") - before == 4 and all(t.is_alive() for t in feed._threads)
    finally:
        feed.close()
        r.delete(stream)


def test_bad_correction_memory_counts_are_skipped_and_counted(redis_url):
    """Malformed fields and NaN, infinite or negative counts in the shared correction memory
    (before: a ValueError that stopped a verifier's start, or counts the gate trusted) are
    skipped and counted; the good counts around them are read."""
    import math
    import uuid

    import redis

    from services.memory.redis_link import RedisLink
    from services.memory.redis_memory import RedisCorrectionMemory

    prefix, r = f"test:hostile:ocm:{uuid.uuid4().hex}", redis.Redis.from_url(redis_url)
    writer = RedisCorrectionMemory(RedisLink(redis_url, "ocm"), prefix=prefix, flush_interval_s=0.05)
    try:
        writer.ensure_prior({(1, 2): 3.0})
        r.hset(f"{prefix}:prior", mapping={"junk": "1", "3:4": "nan", "5:6": "inf", "7:8": "-2", "9:x": "1"})
        before = bad_entries("correction_memory")
        reader = RedisCorrectionMemory(RedisLink(redis_url, "ocm"), prefix=prefix)  # reads the store at start
        try:
            assert reader.lookup(1, 2) == 3.0
            assert all(
                math.isfinite(reader.lookup(a, b)) and reader.lookup(a, b) == 0 for a, b in [(3, 4), (5, 6), (7, 8)]
            )
            assert bad_entries("correction_memory") - before >= 5
        finally:
            reader.close()
    finally:
        writer.close()
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)


def test_500_idle_health_watches_leave_generate_and_check_answering(tiny_engine):
    """Health Watch streams hold no worker thread (before: 16 idle ones, the server's workers,
    left Generate and the kubelet's Check ending DEADLINE_EXCEEDED), and, with auth on, only
    Check is open to a caller without the token."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, _, port = build_server(tiny_engine, ServerConfig(port=0, max_sessions=2))
    server.start()
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(5)]  # 100 streams a connection
    watches = []
    try:
        for i in range(500):
            watch = health_pb2_grpc.HealthStub(channels[i % 5]).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            watches.append(watch)
        assert all(next(w).status == health_pb2.HealthCheckResponse.SERVING for w in watches)  # all 500 open
        check = health_pb2_grpc.HealthStub(channels[0]).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.GenerationStub(channels[1])
        msgs = list(stub.Generate(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=4, method="sd"), timeout=5))
        assert sum(len(m.token_ids) for m in msgs) == 4
    finally:
        for w in watches:
            w.cancel()
        for c in channels:
            c.close()
        server.stop(0)


def test_only_health_check_is_open_without_the_token(tiny_engine):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, _, port = build_server(tiny_engine, ServerConfig(port=0, max_sessions=2, auth_token="s3cret"))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            next(health.Watch(health_pb2.HealthCheckRequest(), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=5, metadata=[("authorization", "Bearer s3cret")])
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    finally:
        channel.close()
        server.stop(0)


def fan_out_schema(width: int) -> str:
    """A schema of a few kilobytes whose ``$ref``s expand to ``width``³ string patterns."""
    import json

    defs: dict = {"d0": {"type": "string", "pattern": "[a-z]{1,5}"}}
    for i in range(1, 4):
        props = {f"p{j}": {"$ref": f"#/$defs/d{i - 1}"} for j in range(width)}
        defs[f"d{i}"] = {"type": "object", "properties": props, "required": list(props)}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d3"})


def test_a_schema_that_fans_out_is_expanded_and_refused_in_the_compile_worker(tiny_engine, monkeypatch):
    """A JSON schema's regex is built in the capped compile worker, never in the server's process
    (a 14 KB schema here expands to about 150 MB; before, the router built it on its request
    thread, with no time or memory cap): it is refused as too complex, and the server serves on."""
    from services.common import structured
    from services.common.structured import StructuredOutput
    from services.router.engine import InvalidRequest

    def in_process(schema: str) -> str:
        raise AssertionError("a client's schema was expanded in the server's process")

    monkeypatch.setattr(structured, "schema_regex", in_process)
    bomb = fan_out_schema(150)
    assert len(bomb) < structured.MAX_SPEC_CHARS
    prompt = tiny_engine.encode("{")
    with pytest.raises(InvalidRequest, match="json_schema: too complex"):
        tiny_engine.generate(GenerationRequest(prompt, 8, structured=StructuredOutput(json_schema=bomb))).result()
    small = StructuredOutput(
        json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    )
    out = tiny_engine.generate(GenerationRequest(prompt, 12, structured=small)).result()
    assert out["finish_reason"] in ("stop", "length")


def test_admin_endpoints_take_the_admin_token_not_the_apis(tiny_engine):
    """With an admin token set, a client holding the API token cannot abort other clients'
    requests or reset the prefix caches (HTTP or gRPC); the admin token can, and it is not an
    API token. With an API token and no admin token the admin endpoints are off (403,
    PERMISSION_DENIED), since every client holds the API token; an open server leaves them open."""
    import urllib.error
    import urllib.request

    from tests.contract.test_openai_api import http_api

    def post(port: int, path: str, token: str, body: bytes = b"{}") -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}",
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    with http_api(tiny_engine, auth_token="api", admin_token="admin") as (port, _):
        for path, body in (
            ("/abort_request", b'{"abort_all": true}'),
            ("/reset_prefix_cache", b""),
            ("/flush_cache", b""),
        ):
            assert post(port, path, "api", body) == 401, path
            assert post(port, path, "admin", body) == 200, path
        assert post(port, "/v1/completions", "admin", b'{"prompt": "x", "max_tokens": 1}') == 401

    with http_api(tiny_engine, auth_token="api") as (port, _):  # no admin token: the endpoints are off
        for path, body in (("/abort_request", b'{"abort_all": true}'), ("/flush_cache", b"")):
            assert post(port, path, "api", body) == 403, path
    with http_api(tiny_engine) as (port, _):  # an open server: open to all, these too
        assert post(port, "/abort_request", "", b'{"abort_all": true}') == 200

    server, _, grpc_port = build_server(tiny_engine, ServerConfig(port=0, auth_token="api"))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GenerationStub(channel).Abort(
                    pb.AbortRequest(abort_all=True), timeout=10, metadata=[("authorization", "Bearer api")]
                )
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--admin-token-file" in e.value.details()
    finally:
        server.stop(0)

    server, _, grpc_port = build_server(tiny_engine, ServerConfig(port=0, auth_token="api", admin_token="admin"))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.Abort(pb.AbortRequest(abort_all=True), timeout=10, metadata=[("authorization", "Bearer api")])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "admin token" in e.value.details()
            done = stub.Abort(pb.AbortRequest(abort_all=True), timeout=10, metadata=[("authorization", "Bearer admin")])
            assert done.aborted == 0
            msgs = list(
                stub.Generate(
                    pb.GenerateRequest(prompt="x", max_new_tokens=2),
                    timeout=30,
                    metadata=[("authorization", "Bearer api")],
                )
            )
            assert sum(len(m.token_ids) for m in msgs) == 2
    finally:
        server.stop(0)


def test_a_grammar_compiles_only_once_its_request_is_admitted(tiny_engine):
    """A structured request refused for load compiles nothing: the compile comes after
    admission (before, every request compiled its pattern, up to 10 s in the worker, and only
    then asked for a slot). Admitted, the same request compiles and decodes."""

    class Holder:  # another client's request, holding the server's one slot
        def is_active(self) -> bool:
            return True

        def time_remaining(self) -> None:
            return None

    server, servicer, port = build_server(tiny_engine, ServerConfig(port=0, max_sessions=1, max_queue=0))
    server.start()
    pattern = "[a-f]{3}-[0-9]{2}z"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            ask = pb.GenerateRequest(
                prompt="id: ", max_new_tokens=8, structured_output=pb.StructuredOutput(regex=pattern)
            )
            assert servicer.admission.acquire(Holder()) is None
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(ask, timeout=30))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not tiny_engine.grammars.cached(pattern)
            servicer.admission.release()
            msgs = list(stub.Generate(ask, timeout=30))
            assert "".join(m.text for m in msgs).startswith(tuple("abcdef"))
            assert tiny_engine.grammars.cached(pattern)
    finally:
        server.stop(0)


def test_grammar_workers_build_a_pattern_once_and_no_more_than_their_number_at_once(tiny_engine, monkeypatch):
    """The compile pool: requests for one pattern share its one build; distinct patterns build
    at most ``workers`` at a time; a request that finds every worker busy past ``wait_s`` is
    refused as overload, not queued without end."""
    import time

    from services.common.refusals import Overloaded
    from services.common.structured import GrammarCompiler

    compiler = GrammarCompiler(tiny_engine.tokenizer, tiny_engine.verifier.vocab_size, workers=2, wait_s=5)
    builds, running, peak, lock = [], [0], [0], threading.Lock()

    def build(worker, pattern):
        with lock:
            builds.append(pattern)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return f"grammar of {pattern}"

    monkeypatch.setattr(compiler, "_compile", build)
    asks = ["a"] * 4 + ["b", "c", "d"]
    got: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i, p=p: got.update({i: compiler.compile(p)})) for i, p in enumerate(asks)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == {i: f"grammar of {p}" for i, p in enumerate(asks)}
        assert sorted(builds) == ["a", "b", "c", "d"] and peak[0] == 2

        compiler.wait_s = 0.1
        slow = [threading.Thread(target=compiler.compile, args=(p,)) for p in ("e", "f")]
        for t in slow:
            t.start()
        time.sleep(0.05)  # both workers busy for 0.3 s
        with pytest.raises(Overloaded, match="compile worker"):
            compiler.compile("g")
        for t in slow:
            t.join()
    finally:
        compiler.close()


def test_an_http_flood_gets_no_more_threads_than_admission_could_take(tiny_engine):
    """Each HTTP generation request decodes on a thread of its own; past the requests that
    could decode or wait (sessions + queue + one to be told the queue is full) a request is
    refused with 429 before it gets a thread (before, every request got one, and parsed and
    compiled its grammar, before admission refused it)."""
    import json
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from tests.contract.test_openai_api import http_api

    def post(port: int) -> int:
        body = json.dumps({"prompt": "x", "max_tokens": 60, "ignore_eos": True}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sum(t.name == "http-request" for t in threading.enumerate()))
            stop.wait(0.002)

    with http_api(tiny_engine, max_sessions=1, max_queue=1) as (port, _):
        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(lambda _: post(port), range(12)))
        stop.set()
        watcher.join()
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}
    assert peak[0] <= 3  # sessions 1 + queue 1 + 1


def test_tenants_draft_only_from_their_own_outputs():
    """The suffix cache is scoped as the prefix cache is, by ``cache_salt``: a tenant's outputs
    (finished, or live token by token) are drafted for its own later requests, never for another
    tenant's or the shared pool's, and never published to the replicas' feed; requests without a
    salt share the pool as before. (Before, one tenant's output became every tenant's draft, and
    with csd could appear in their outputs.)"""
    from services.common.config import SuffixConfig
    from services.drafter.suffix import SuffixDrafter

    published: list[list[int]] = []
    d = SuffixDrafter(SuffixConfig(), on_finish=published.append)
    secret = list(range(700, 760))

    def draft_after(req: str, scope: str | None, seen: list[int]) -> list[int]:
        d.start(req, [1, 2, 3], scope=scope)
        d.observe(req, seen)
        return d.propose_batch([(req, 16)])[0].token_ids

    d.start("a-writer", [9, 9], scope="tenant-a")
    d.observe("a-writer", secret)
    d.propose_batch([("a-writer", 4)])  # the live output is in tenant a's tree from this step
    assert draft_after("b-live", "tenant-b", secret[:6]) == []  # live: not for tenant b
    assert draft_after("pool-live", None, secret[:6]) == []  # nor for the shared pool
    assert draft_after("a-live", "tenant-a", secret[:6])[:6] == secret[6:12]  # tenant a's own
    d.stop("a-writer")
    assert published == []  # a tenant's output stays off the shared feed
    assert draft_after("b-done", "tenant-b", secret[:6]) == []
    assert draft_after("a-done", "tenant-a", secret[:6])[:6] == secret[6:12]

    d.start("pool-writer", [5], scope=None)
    d.observe("pool-writer", secret)
    d.stop("pool-writer")
    assert published == [secret]
    assert draft_after("pool-reader", None, secret[:6])[:6] == secret[6:12]  # unsalted requests share
    assert draft_after("empty-salt", "", secret[:6])[:6] == secret[6:12]  # an empty salt is none


def test_a_rotated_token_file_takes_effect_without_a_restart(tiny_engine, tmp_path):
    """--auth-token-file is read again once it changes (a Kubernetes Secret volume is replaced in
    place when rotated): the old token is refused and the new one taken, over gRPC and HTTP, with
    no restart; a file emptied meanwhile keeps the last token rather than open the API."""
    import os
    import urllib.error
    import urllib.request

    from services.common.security import TokenFile
    from tests.contract.test_openai_api import http_api

    path = tmp_path / "token"
    path.write_text("old-token\n")

    def rotate(text: str) -> None:  # as the kubelet does: a new file renamed over the old
        new = tmp_path / "token.new"
        new.write_text(text)
        os.replace(new, path)

    def http_status(port: int, token: str) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def grpc_ok(port: int, token: str) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                list(
                    pb_grpc.GenerationStub(channel).Generate(
                        pb.GenerateRequest(prompt="x", max_new_tokens=1),
                        timeout=30,
                        metadata=[("authorization", f"Bearer {token}")],
                    )
                )
                return True
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                return False

    token = TokenFile(path, recheck_s=0.0)
    with http_api(tiny_engine, auth_token=token) as (port, servicer):
        server, _, grpc_port = build_server(tiny_engine, ServerConfig(port=0, auth_token=token))
        server.start()
        try:
            assert http_status(port, "old-token") == 200 and grpc_ok(grpc_port, "old-token")
            rotate("new-token\n")
            assert http_status(port, "old-token") == 401 and not grpc_ok(grpc_port, "old-token")
            assert http_status(port, "new-token") == 200 and grpc_ok(grpc_port, "new-token")
            rotate("")  # a half-written or emptied file: the last token stays, the API stays closed
            assert http_status(port, "new-token") == 200 and http_status(port, "") == 401
        finally:
            server.stop(0)
    with pytest.raises(ValueError, match="no token"):
        TokenFile(tmp_path / "missing")


def test_responses_say_how_they_were_decoded_only_when_the_server_enables_it(tiny_engine):
    """Per-response speculation stats and cached prompt tokens (an acceptance oracle across
    tenants, as vLLM's prompt-tokens details are) are off by default: gRPC's last message has
    neither, OpenAI's and SGLang's answers (streamed or not) carry no `speculation`,
    `prompt_tokens_details`, `cached_tokens` or `spec_verify_ct`; --response-stats gives them."""
    import json
    import urllib.request

    from tests.contract.test_openai_api import http_api

    def post(port: int, path: str, body: dict) -> str:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read().decode()

    asks = [
        ("/v1/completions", {"prompt": "def f(", "max_tokens": 3, "method": "suffix"}),
        (
            "/v1/completions",
            {"prompt": "def f(", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
        ),
        ("/generate", {"text": "def f(", "sampling_params": {"max_new_tokens": 3}}),
        ("/generate", {"text": "def f(", "sampling_params": {"max_new_tokens": 3}, "stream": True}),
    ]
    for enabled in (False, True):
        with http_api(tiny_engine, response_stats=enabled) as (port, _):
            texts = [post(port, path, body) for path, body in asks]
        for text in texts:
            for key in ("speculation", "cached_tokens"):
                assert (key in text) == enabled, (enabled, key, text[:200])
        server, _, port = build_server(tiny_engine, ServerConfig(port=0, response_stats=enabled))
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                last = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt="x", max_new_tokens=3)))[
                    -1
                ]
            assert last.HasField("stats") == enabled and (last.stats.cycles > 0) == enabled
        finally:
            server.stop(0)


def test_a_tenants_correction_memory_pairs_stay_in_its_own_memory(tiny_engine):
    """csd's correction memory is scoped by ``cache_salt`` too: a salted request reads and grows
    its salt's own memory on the replica (started from the calibration prior), so its divergence
    pairs never change another tenant's, or the pool's, accepted tokens; unsalted requests grow the
    shared one; ``--memory-pooled`` puts every request in the shared one."""
    from dataclasses import replace

    from services.memory.correction_memory import SaltedMemories

    core = tiny_engine.verifier
    ids = tiny_engine.encode("def fibonacci(n):\n")

    def run(salt: str) -> None:
        tiny_engine.generate(GenerationRequest(ids, 40, method="csd", cache_salt=salt)).result()

    shared = dict(core.memory.snapshot())
    run("tenant-a")
    mine = core.memory_of("tenant-a").snapshot()
    assert sum(mine.values()) > 0  # the run's first rejections were recorded ...
    assert core.memory.snapshot() == shared  # ... in tenant a's memory only
    assert core.memory_of("tenant-never-seen").snapshot() == {} and core.memory_of(
        "tenant-never-seen"
    ) is not core.memory_of("tenant-a")
    assert core.policy_of("csd", "tenant-a").memory is core.memory_of("tenant-a")
    run("")
    assert sum(core.memory.snapshot().values()) > sum(shared.values())  # unsalted: the shared pool
    assert core.memory_of("") is core.memory and core.policy_of("csd", "") is core.policies["csd"]

    salted = core.salted
    try:
        core.salted = None  # --memory-pooled
        assert core.memory_of("tenant-a") is core.memory
    finally:
        core.salted = salted
    few = SaltedMemories({(1, 2): 5.0}, limit=2)
    first = few.of("x")
    assert first.lookup(1, 2) == 5.0  # each salt starts from the calibration prior
    few.of("y"), few.of("z")
    assert len(few) == 2 and few.of("x") is not first  # the least recently used salt was dropped
    from services.common.config import EngineConfig
    from services.verifier.core import VerifierCore

    pooled = VerifierCore.from_config(replace(tiny_engine.cfg, memory_pooled=True), tiny_engine.eos_id)
    try:
        assert pooled.salted is None and pooled.memory_of("tenant-a") is pooled.memory
    finally:
        pooled.close()
    assert EngineConfig.from_mapping({"memory_pooled": "true"}).memory_pooled  # --memory-pooled, the chart's value
    assert not EngineConfig.from_mapping({}).memory_pooled
