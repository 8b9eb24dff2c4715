"""The Ray Serve application, in-process on 2 CPUs: Generate through Serve's gRPC proxy, two
verifier replicas behind the prefix-affinity request router."""

import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.runtime import free_port
from services.router.engine import GenerationRequest
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import wait_for
from tests.fleet import ray_serve
from tests.integration.test_cli import scrape as scrape_labelled


@pytest.fixture(scope="module")
def serve_app(tiny_dirs, tmp_path_factory):
    import shutil

    models = tmp_path_factory.mktemp("ray-models")
    shutil.copytree(tiny_dirs[0], models / "target")
    shutil.copytree(tiny_dirs[1], models / "draft")
    metrics_port = free_port()
    args = {
        "models_dir": str(models),
        "verifier_gpus": 0,
        "verifier_replicas": 2,
        "cpus_per_replica": 0.25,
        "max_new_tokens_limit": 200,
        "shared_memory": True,
        "remote_drafter": True,
        "metrics_port": metrics_port,
        "metrics_host": "127.0.0.1",
        "max_sessions": 2,  # the ingress's streams
        "max_queue": 1,
        "prefill_chunk": 1,  # beside an open session, a new prompt prefills 1 token a step
        "response_stats": True,  # final messages carry their speculation stats and cached tokens
    }
    # a step feeding a prompt's chunk waits 10 ms (fault injection, services/verifier/faults.py), so
    # the cancel tests' prefills outlast Ray's cancel on a loaded host whatever the step's speed
    with ray_serve(args, env={"SPECMESH_FAULT_CHUNK_DELAY_MS": "10"}) as (channel, _, http_port):
        yield pb_grpc.GenerationStub(channel), channel, metrics_port, http_port


def test_generate_streams_through_the_serve_proxy(serve_app, tiny_engine):
    stub = serve_app[0]
    for method in ("vanilla", "sd", "suffix", "csd"):
        msgs = list(
            stub.Generate(pb.GenerateRequest(prompt="def add(a, b):\n", max_new_tokens=24, method=method), timeout=120)
        )
        ids = [t for m in msgs for t in m.token_ids]
        ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode("def add(a, b):\n"), 24, method="vanilla"))
        if method == "csd":  # relaxed: only its length is fixed
            assert len(ids) == 24
        else:
            assert ids == ref.result()["token_ids"], method
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].stats.cycles > 0


def test_the_verifier_replicas_log_no_line_per_cycle_or_probe(serve_app):
    """The deployments the router calls per cycle or per probe write no access-log line per call
    (a verifier replica once logged one per cycle and one per health probe, idle or not); the
    ingress keeps its line per request."""
    import ray

    from services.ray_app import verifiers_live

    stub = serve_app[0]
    list(stub.Generate(pb.GenerateRequest(prompt="def log(a):\n", max_new_tokens=12, method="sd"), timeout=120))
    handle = ray.serve.get_deployment_handle("VerifierDeployment", app_name="specmesh")
    assert verifiers_live(handle) >= 1  # the health probe's calls
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    verifiers = list(logs.glob("replica_specmesh_VerifierDeployment_*.log"))
    ingress = list(logs.glob("replica_specmesh_GenerationIngress_*.log"))
    assert verifiers and ingress
    assert not [line for f in verifiers for line in f.read_text().splitlines() if " CALL " in line]
    assert any(" CALL " in line for f in ingress for line in f.read_text().splitlines())


def test_openai_api_through_the_serve_http_proxy(serve_app, tiny_engine):
    """The same ingress answers OpenAI-compatible HTTP through Serve's HTTP proxy: the engine's
    greedy tokens, a stream, and a 400 naming the field."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_app[3]}/v1", api_key="unused", max_retries=0, timeout=120)
    ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode("def add(a, b):\n"), 24, method="vanilla")).result()
    out = client.completions.create(
        model="target", prompt="def add(a, b):\n", max_tokens=24, temperature=0, extra_body={"method": "sd"}
    )
    assert out.choices[0].text == ref["text"] and out.usage.completion_tokens == 24
    chunks = list(
        client.completions.create(
            model="target",
            prompt="def add(a, b):\n",
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"method": "suffix"},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == ref["text"] and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="^Error code: 400.*top_p: must be in"):
        client.completions.create(model="target", prompt="x", max_tokens=4, top_p=2)


def test_n_completions_under_a_grammar_through_the_proxy(serve_app, tiny_engine):
    """n = 2 with a regex through Serve's proxy: each completion is the embedded constrained
    greedy output, with its own index and final message."""
    from services.common.structured import StructuredOutput

    stub = serve_app[0]
    regex = r"(def|class) [a-z_]{1,12}\([a-z, ]{0,16}\):\n    return [a-z0-9 +*]{1,20}\n"
    msgs = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt="def add(a, b):\n",
                max_new_tokens=40,
                method="sd",
                n=2,
                structured_output=pb.StructuredOutput(regex=regex),
            ),
            timeout=120,
        )
    )
    ref = tiny_engine.generate(
        GenerationRequest(
            tiny_engine.encode("def add(a, b):\n"), 40, method="vanilla", structured=StructuredOutput(regex=regex)
        )
    ).result()["token_ids"]
    assert sorted(m.index for m in msgs if m.finish_reason) == [0, 1]
    for i in (0, 1):
        assert [t for m in msgs if m.index == i for t in m.token_ids] == ref, i


def test_invalid_request_status_survives_the_proxy(serve_app):
    stub = serve_app[0]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=0), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # more completions than the ingress's sessions (2)
        list(stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=2, n=3), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n: at most 2" in e.value.details()


def test_abort_through_the_proxy(serve_app):
    """The ingress answers Abort itself, for the completions on its replica (none here)."""
    stub = serve_app[0]
    assert stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=60).aborted == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(pb.AbortRequest(), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()


def test_an_abort_reaches_the_ingress_replica_that_holds_the_request(serve_app, tiny_dirs, tmp_path):
    """A second application with two ingress replicas: an Abort that Serve's proxy sends to
    the replica not decoding the request (it answers aborted = 0) still ends the stream, with
    finish_reason ABORT, through the AbortBoard. The proxy sends a call to the less loaded of
    two replicas, so while one streams the Abort goes to the other; the trials allow for it
    landing where the stream is (then the abort is local, answered 1)."""
    import shutil

    from ray import serve

    from services.ray_app import app

    stub = serve_app[0]
    for name, src in (("target", tiny_dirs[0]), ("draft", tiny_dirs[1])):
        shutil.copytree(src, tmp_path / name)
    serve.run(
        app(
            {
                "models_dir": str(tmp_path),
                "verifier_gpus": 0,
                "verifier_replicas": 1,
                "cpus_per_replica": 0.1,
                "ingress_replicas": 2,
                "max_new_tokens_limit": 240,
            }
        ),
        name="two-ingress",
        route_prefix="/two",
    )
    meta = (("application", "two-ingress"),)
    try:
        relayed = 0
        for trial in range(6):
            rid = f"long-{trial}"
            call = stub.Generate(
                pb.GenerateRequest(prompt="#", max_new_tokens=230, method="vanilla", request_id=rid),
                metadata=meta,
                timeout=120,
            )
            first = next(call)
            local = stub.Abort(pb.AbortRequest(request_id=rid), metadata=meta, timeout=60).aborted
            msgs = [first, *call]
            assert msgs[-1].finish_reason == pb.FINISH_REASON_ABORT, (trial, local)
            assert sum(len(m.token_ids) for m in msgs) < 230
            relayed += local == 0
            if relayed:
                break
        assert relayed, "every Abort landed on the replica streaming its request"
    finally:
        serve.delete("two-ingress")


def test_memory_and_drafter_deployments_are_shared(serve_app):
    """csd runs recorded first rejections into the memory deployment; suffix drafts came from the drafter one."""
    from ray import serve

    memory = serve.get_deployment_handle("MemoryDeployment", app_name="specmesh")
    stub = serve_app[0]
    list(stub.Generate(pb.GenerateRequest(prompt="class A:\n", max_new_tokens=24, method="csd"), timeout=120))
    import time

    end = time.time() + 20
    while not memory.read.remote().result() and time.time() < end:
        time.sleep(0.2)
    assert memory.read.remote().result()  # pairs flushed by the verifier's write-behind
    msgs = list(
        stub.Generate(
            pb.GenerateRequest(prompt="x = 1\nx = 1\nx = 1\n", max_new_tokens=16, method="suffix"), timeout=120
        )
    )
    assert msgs[-1].stats.cycles > 0


def test_health_through_the_proxy(serve_app):
    channel = serve_app[1]
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    # Watch (on the ingress's event loop, a stream Serve counts toward max_sessions) answers and is then let go
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def scrape(port: int) -> dict[str, float]:
    """The node endpoint's samples, summed over label sets: name -> value."""
    out: dict[str, float] = {}
    for key, value in scrape_labelled(port).items():
        name = key.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + value
    return out


def test_replica_metrics_reach_the_node_endpoint(serve_app):
    """Router-side counters (ingress replica) and verifier-side histograms (verifier replica,
    another process) are served together, and they move with a Generate."""
    stub, _, port, _ = serve_app
    assert wait_for(lambda: _try_scrape(port) is not None, timeout=30), "no node metrics endpoint"
    before = scrape(port)
    msgs = list(stub.Generate(pb.GenerateRequest(prompt="def f(x):\n", max_new_tokens=20, method="sd"), timeout=120))
    cycles = msgs[-1].stats.cycles
    after = scrape(port)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("specmesh_requests_total") == 1  # ingress process
    assert moved("specmesh_cycles_total") == cycles
    assert moved("specmesh_verify_batch_size_count") == cycles  # verifier process
    assert moved("specmesh_spec_decode_num_accepted_tokens_total") <= moved(
        "specmesh_spec_decode_num_draft_tokens_total"
    )


def _try_scrape(port: int):
    try:
        return scrape(port)
    except OSError:
        return None


def test_streams_beyond_admission_get_resource_exhausted(serve_app):
    """2 streams run, 1 waits, the rest are refused by Serve's back-pressure; the admitted ones finish."""
    import threading

    stub = serve_app[0]
    codes: list = []
    running = [threading.Event() for _ in range(2)]

    def stream(started: threading.Event | None = None) -> None:
        try:
            msgs = []
            for msg in stub.Generate(
                pb.GenerateRequest(prompt="def f(x):\n", max_new_tokens=150, method="vanilla"), timeout=120
            ):
                msgs.append(msg)
                if started:
                    started.set()
            codes.append(grpc.StatusCode.OK if msgs[-1].finish_reason else None)
        except grpc.RpcError as e:
            codes.append(e.code())

    # The 2 admitted streams are running before the burst: Serve counts a request as queued
    # until a replica takes it, so a burst that arrives all at once can find 0 running.
    threads = [threading.Thread(target=stream, args=(ev,)) for ev in running]
    for t in threads:
        t.start()
    for ev in running:
        ev.wait(60)
    threads += [threading.Thread(target=stream) for _ in range(4)]
    for t in threads[2:]:
        t.start()
    for t in threads:
        t.join(150)
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes
    assert codes.count(grpc.StatusCode.OK) >= 2 and set(codes) <= {
        grpc.StatusCode.OK,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }, codes


def test_a_session_opens_where_its_prompt_start_is_cached(serve_app, tiny_engine):
    """The verifier deployment's request router: with its first session still open, a second
    session on the same prompt opens on the same replica (of two) and starts from its prefix
    cache. Four prompts: Serve's own routing would pick that replica each time by chance
    with probability 1/16."""

    from ray import serve

    from services.common.types import CycleRequest, SessionSpec
    from services.ray_app import RaySession

    handle = serve.get_deployment_handle("VerifierDeployment", app_name="specmesh")
    # Earlier tests' sessions, while their replica still reports them, count toward its load:
    # with more than the slack of 2 there, the open rightly goes to the other replica.
    no_sessions_reported()
    for p in range(4):
        ids = tiny_engine.encode("".join(f"def ray_{p}_{i}(x):\n    return x * {i} - {p}\n\n" for i in range(5)))
        first = RaySession(handle, SessionSpec(ids, 4))
        again = None
        try:
            assert first.cycle(CycleRequest()).cached_tokens == 0
            again = RaySession(handle, SessionSpec(ids, 4))
            assert again.cycle(CycleRequest()).cached_tokens == (len(ids) - 1) // 32 * 32 > 0
        finally:  # closed on a failure too, so that no later test finds them open
            first.close()
            if again is not None:
                again.close()


def test_a_cancelled_stream_stops_its_prefill_at_the_next_step(serve_app, tiny_engine):
    """A client cancelling through Serve's proxy while its prompt prefills in chunks on a
    verifier replica (beside another stream, which its prompt's start sends it to): Ray cancels
    the cycle in flight, and the replica stops feeding the prompt at its next step instead of
    finishing it for nobody. The other stream carries on."""
    import time

    stub, _, port, _ = serve_app
    start = tiny_engine.encode("".join(f"def chunked_{i}(x):\n    return x * {i}\n\n" for i in range(4)))

    def fed() -> float:
        return scrape(port).get("specmesh_prefill_chunks_total", 0.0)

    for attempt in range(3):
        # earlier sessions count toward a replica's load until their reports age out: past the
        # affinity slack they would send the second stream to the other replica, where it is fed whole
        no_sessions_reported()
        before = fed()  # read first: a prompt fed alone counts no chunk, and the other stream's time is short
        # The other stream should outlast the prompt's chunks (~27 + len(tail) of them), else the rest is
        # fed whole; the second request goes out as soon as the other decodes.
        other = stub.Generate(
            pb.GenerateRequest(prompt_token_ids=start, max_new_tokens=190, method="vanilla", ignore_eos=True),
            timeout=120,
        )
        first = next(other)  # decoding on the replica that now holds the start
        # never cached (a new range each attempt): fed whole, they take len(tail) - 1 chunks of 1 at least
        tail = list(range(300 + 200 * attempt, 450 + 200 * attempt))
        call = stub.Generate(
            pb.GenerateRequest(prompt_token_ids=start + tail, max_new_tokens=4, method="vanilla"), timeout=120
        )
        if wait_for(lambda b=before: fed() - b >= 3, timeout=30):
            break
        # A loaded host can take longer to route the second request than the other takes to decode
        # its tokens: then the prompt is fed alone, whole, and there is no prefill in flight to cancel.
        call.cancel()
        other.cancel()
    else:
        raise AssertionError(f"the prompt never prefilled in chunks in 3 attempts: {open_sessions()}")
    call.cancel()
    assert wait_for(lambda: (f := fed(), time.sleep(0.3), fed() == f)[-1], timeout=30)
    # Stopped before the end: the tail's chunks take at least 1.5 s (10 ms each, the fixture's
    # fault delay), and a loaded host takes some steps to deliver Ray's cancel.
    assert fed() - before < len(tail) - 1
    rest = list(other)
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 190
    assert wait_for(lambda: not any(open_sessions().values()), timeout=30), open_sessions()  # none left behind


def test_a_cancelled_ray_session_stops_its_cycle_in_flight(serve_app, tiny_engine):
    """``RaySession.cancel``, which the engine calls from another thread when its client goes
    away: the cycle in flight (a prompt prefilling in chunks beside another open session, on
    the replica that holds its start) raises ``SessionCancelled``, the replica stops feeding
    that prompt at its next step, and the session is closed there."""
    import threading
    import time

    from ray import serve

    from services.common.types import CycleRequest, SessionCancelled, SessionSpec
    from services.ray_app import RaySession

    port = serve_app[2]
    assert wait_for(lambda: not any(open_sessions().values()), timeout=30)  # earlier tests' are closed
    handle = serve.get_deployment_handle("VerifierDeployment", app_name="specmesh")
    start = tiny_engine.encode("".join(f"def ray_cancel_{i}(x):\n    return x + {i}\n\n" for i in range(4)))
    holder = RaySession(handle, SessionSpec(start, 4))
    holder.cycle(CycleRequest())  # places the start on a replica, and stays open there

    def fed() -> float:
        return scrape(port).get("specmesh_prefill_chunks_total", 0.0)

    before = fed()
    # Never cached: fed 1 token a step beside the holder, the tail takes len(tail) - 1 steps, alone in
    # them, 10 ms each at least (the fixture's fault delay): Ray's cancel lands long before the end
    # (in CI, without the delay, a 900-token tail once finished first).
    tail = list(range(300, 300 + 900 - len(start)))
    session = RaySession(handle, SessionSpec(start + tail, 4))  # affinity: beside the holder
    raised: list[BaseException] = []

    def cycle():
        try:
            session.cycle(CycleRequest())
        except BaseException as e:  # noqa: BLE001 - the test asserts which one
            raised.append(e)

    thread = threading.Thread(target=cycle)
    thread.start()
    try:
        assert wait_for(lambda: fed() - before >= 1, timeout=30), "the prompt never prefilled in chunks"
        session.cancel()
        thread.join(30)
        assert not thread.is_alive() and len(raised) == 1 and isinstance(raised[0], SessionCancelled), raised
        assert wait_for(lambda: (f := fed(), time.sleep(0.3), fed() == f)[-1], timeout=30)
        assert fed() - before < len(tail) - 1  # stopped before the end (see the test above)
    finally:
        session.close()
        holder.close()
    assert wait_for(lambda: not any(open_sessions().values()), timeout=30), open_sessions()  # none left behind


def test_a_step_is_one_call_per_replica_and_replicas_hold_past_64_sessions(serve_app, tiny_engine):
    """``RayVerifier.step``: a router step is one ``step`` call per verifier replica with the
    cycles of every session it holds; 140 sessions stay open on two replicas at once (a replica
    once multiplexed at most 64, evicting the rest), and each cycle answers with the target's
    own next token."""
    import threading

    from ray import serve

    from services.common.types import CycleRequest, CycleResult, SessionSpec
    from services.ray_app import RayVerifier

    assert wait_for(lambda: not any(open_sessions().values()), timeout=30)  # earlier tests' are closed
    verifier = RayVerifier(serve.get_deployment_handle("VerifierDeployment", app_name="specmesh"))
    prompts = [tiny_engine.encode(f"def many_{i}(x):\n") for i in range(140)]
    sessions = [verifier.open(SessionSpec(p, 4)) for p in prompts]
    calls: list[int] = []
    on_replica = verifier._on_replica
    verifier._on_replica = lambda cycles, dones: calls.append(len(cycles)) or on_replica(cycles, dones)
    got: dict[int, object] = {}
    all_in = threading.Event()

    def done(i, outcome):
        got[i] = outcome
        if len(got) == len(sessions):
            all_in.set()

    try:
        verifier.step([(s, CycleRequest()) for s in sessions], done)
        assert all_in.wait(180), f"{len(got)} of {len(sessions)} cycles answered"
        assert all(isinstance(o, CycleResult) for o in got.values()), {type(o) for o in got.values()}
        replicas = {s.replica for s in sessions}
        assert len(calls) == len(replicas) and sum(calls) == len(sessions)
        held = open_sessions()
        assert sum(len(v) for v in held.values()) == len(sessions) and max(len(v) for v in held.values()) > 64, {
            k: len(v) for k, v in held.items()
        }
        for i in (0, 77, 139):
            ref = tiny_engine.generate(GenerationRequest(prompts[i], 1, method="vanilla")).result()["token_ids"]
            assert got[i].committed[:1] == ref[:1] or (not ref and got[i].committed == [tiny_engine.eos_id])
    finally:
        for s in sessions:
            s.close()
        verifier.close()

    def none_open() -> bool:
        try:
            return not any(open_sessions().values())
        except AssertionError:  # a replica busy closing them did not answer yet
            return False

    assert wait_for(none_open, timeout=60), open_sessions()


def no_sessions_reported() -> None:
    """Wait until no verifier replica holds a session, and until the request routers' copies of
    the replicas' reports (sent every 1 s, then broadcast by the controller) say so too: a
    placement test that starts sooner may see an earlier test's closed session as load."""
    assert wait_for(lambda: not any(open_sessions().values()), timeout=30), open_sessions()
    time.sleep(2.5)


def open_sessions() -> dict[str, list[str]]:
    """Each verifier replica's open sessions, as it reports them to the request routers."""
    from ray import serve

    handle = serve.get_deployment_handle("VerifierDeployment", app_name="specmesh")
    seen: dict[str, list[str]] = {}
    end = time.time() + 30
    while len(seen) < 2 and time.time() < end:
        # The calls land where Serve's power-of-two router sends them: one at a time, all go to
        # whichever replica has fewer calls in flight (in CI a replica busy closing 70 sessions
        # was passed over 40 times in a row); several at once spread over both.
        for call in [handle.record_routing_stats.remote() for _ in range(8)]:
            stats = call.result()
            seen[stats["replica"]] = stats["sessions"]
    assert len(seen) == 2, f"only {list(seen)} answered"
    return seen


def test_sessions_other_routers_opened_count_toward_placement(serve_app, tiny_engine):
    """The ingress's request router counts sessions that another router (this test's handle)
    opened, from the verifier replicas' reports: with 3 of them open on the replica holding a
    prompt's start (slack 2), a stream with that start goes to the other replica, where nothing
    of it is cached. Both routers break load ties the same way, so without the reports the
    stream would go where the 3 sessions are."""
    import time

    from ray import serve

    from services.common.types import CycleRequest, SessionSpec
    from services.ray_app import RaySession

    stub = serve_app[0]
    assert wait_for(lambda: not any(open_sessions().values()), timeout=30)  # earlier tests' are closed
    handle = serve.get_deployment_handle("VerifierDeployment", app_name="specmesh")
    start = tiny_engine.encode("".join(f"def loads_{i}(x):\n    return x - {i}\n\n" for i in range(4)))
    sessions = [RaySession(handle, SessionSpec(start, 4)) for _ in range(3)]
    try:
        assert [s.cycle(CycleRequest()).cached_tokens > 0 for s in sessions] == [False, True, True]  # one replica
        end, cached = time.time() + 30, []
        while time.time() < end and (not cached or cached[-1] > 0):
            msgs = list(
                stub.Generate(
                    pb.GenerateRequest(prompt_token_ids=start + [len(cached) + 7], max_new_tokens=1, method="vanilla"),
                    timeout=60,
                )
            )
            cached.append(msgs[-1].usage.cached_prompt_tokens)
            time.sleep(0.5)
        assert cached[-1] == 0, cached
    finally:
        for s in sessions:
            s.close()


def test_reset_prefix_cache_reaches_every_verifier_replica(serve_app, tiny_engine):
    """vLLM's POST /reset_prefix_cache through Serve's proxy: the request router sends one
    call to each verifier replica in turn, so prompts cached on either are prefilled whole after."""
    import urllib.request

    from ray import serve

    from services.common.types import CycleRequest, SessionSpec
    from services.ray_app import RaySession

    port = serve_app[2]
    no_sessions_reported()  # else a stale report of another test's session decides the placement
    handle = serve.get_deployment_handle("VerifierDeployment", app_name="specmesh")
    prompts = [
        tiny_engine.encode("".join(f"def reset_{tag}_{i}(x):\n    return x - {i}\n\n" for i in range(5)))
        for tag in ("a", "b")
    ]
    sessions = []
    for ids in prompts:  # the second goes to the less loaded replica: the other one
        sessions.append(RaySession(handle, SessionSpec(ids, 4)))
        assert sessions[-1].cycle(CycleRequest()).cached_tokens == 0
    holders = open_sessions()
    assert sorted(len(v) for v in holders.values()) == [1, 1], holders  # one prompt cached on each replica
    for s in sessions:
        s.close()
    assert scrape(port).get("specmesh_prefix_cache_bytes", 0.0) > 0
    req = urllib.request.Request(f"http://127.0.0.1:{serve_app[3]}/reset_prefix_cache", data=b"", method="POST")
    assert urllib.request.urlopen(req, timeout=60).status == 200
    assert scrape(port).get("specmesh_prefix_cache_bytes", 0.0) == 0  # summed over both replicas
    for ids in prompts:
        again = RaySession(handle, SessionSpec(ids, 4))
        try:
            assert again.cycle(CycleRequest()).cached_tokens == 0
        finally:
            again.close()


def test_the_ray_drafter_answers_every_drafter_method(serve_app):
    """RayDrafter (the router's view of the DrafterDeployment) is a whole Drafter."""
    from ray import serve

    from services.ray_app import RayDrafter
    from tests.drafters import METHODS, exercise

    handle = serve.get_deployment_handle("DrafterDeployment", app_name="specmesh")
    assert exercise(RayDrafter(handle), [5, 6, 7, 5, 6, 7, 5, 6]) == set(METHODS)


def test_a_tensor_parallel_verifier_replica_serves_through_ray(serve_app, tiny_dirs, tiny_engine, tmp_path):
    """tensor_parallel: 2 in the app's args: the verifier replica is placed with a placement group
    (one bundle holding its ranks' CPUs), starts its second rank beside it (gloo) and gives
    vanilla's greedy tokens for sd and suffix."""
    import shutil

    from ray import serve
    from ray.util import placement_group_table

    from services.ray_app import app

    stub = serve_app[0]
    for name, src in (("target", tiny_dirs[0]), ("draft", tiny_dirs[1])):
        shutil.copytree(src, tmp_path / name)
    args = {"models_dir": str(tmp_path), "verifier_gpus": 0, "verifier_replicas": 1, "cpus_per_replica": 0.1}
    serve.run(app({**args, "tensor_parallel": 2}), name="tp2", route_prefix="/tp2")
    meta = (("application", "tp2"),)
    try:
        prompt = "def add(a, b):\n"
        ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(prompt), 24, method="vanilla")).result()
        for method in ("sd", "suffix"):
            msgs = list(
                stub.Generate(
                    pb.GenerateRequest(prompt=prompt, max_new_tokens=24, method=method), metadata=meta, timeout=120
                )
            )
            assert [t for m in msgs for t in m.token_ids] == ref["token_ids"], method
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert any(g["strategy"] == "STRICT_PACK" and list(g["bundles"].values()) == [{"CPU": 0.1}] for g in groups)
    finally:
        serve.delete("tp2")
