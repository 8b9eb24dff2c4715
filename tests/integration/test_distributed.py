"""Distributed topology on loopback: verifier replicas as processes, the router over gRPC.

Same outputs as embedded, a replica killed mid-stream loses nothing, a bounded load test
leaves no session behind, malformed verifier input gets a clear status.
"""

import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from services.common.config import EngineConfig, ServerConfig
from services.router.engine import Engine, GenerationRequest
from services.router.grpc_server import build_server
from services.verifier.client import RemoteVerifier
from specmesh.v1 import generate_pb2 as gpb
from specmesh.v1 import verifier_pb2 as vpb
from specmesh.v1 import verifier_pb2_grpc as vgrpc
from tests.conftest import corrupt_bytes, wait_for
from tests.fleet import active, router, start_verifier, stop, stream_ids

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\nimport os\n", "class A:\n    pass\n\nclass", "x = [1, 2"]


@pytest.fixture(scope="module")
def cluster(tiny_dirs):
    procs, addrs = zip(*[start_verifier(tiny_dirs) for _ in range(2)])
    engine, server, servicer, stub = router(tiny_dirs, list(addrs))
    yield engine, stub, list(addrs), servicer
    server.stop(0)
    stop(procs)


def test_distributed_equals_embedded(cluster, tiny_engine):
    _, stub, _, _ = cluster
    for method in ("vanilla", "sd", "suffix", "suffix-tree", "csd"):
        for p in PROMPTS:
            ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(p), 40, method="vanilla")).result()
            got = stream_ids(stub, p, 40, method)
            if method == "csd":
                assert len(got) == 40
            else:
                assert got == ref["token_ids"], (method, p)


def test_a_token_tree_crosses_the_link_and_its_second_branch_is_kept(cluster, tiny_engine):
    """A router's tree draft reaches the replica with its parents: the greedy continuation
    sits on the root's second branch, so the cycle commits that branch and the target's next
    token; the next cycle goes on from exactly there."""
    from services.common.types import CycleRequest, SessionSpec

    engine, _, _, _ = cluster
    ids = tiny_engine.encode("def add(a, b):\n")
    ref = tiny_engine.generate(GenerationRequest(ids, 6, method="vanilla")).result()["token_ids"]
    wrong = (ref[0] + 1) % 256
    session = engine.verifier.open(SessionSpec(ids, 6, max_draft=4))
    try:
        first = session.cycle(
            CycleRequest(draft_ids=(wrong, ref[0], ref[1]), draft_parents=(-1, -1, 1), draft_source="suffix")
        )
        assert first.committed == ref[:3] and first.accepted == 2 and first.drafted == 3
        second = session.cycle(CycleRequest(draft_ids=(ref[3], ref[4]), draft_source="suffix"))
        assert second.committed == ref[3:6]
    finally:
        session.close()


def test_a_new_session_goes_where_its_prompt_start_is_cached(cluster):
    """Prefix affinity: with one session open on the replica that verified a prompt, the same
    prompt goes there again (within the slack) and starts from its prefix cache; with no
    slack, or affinity off, it goes to the idle replica (prefilled there the first time)."""
    from services.common.types import CycleRequest, SessionSpec

    engine, _, addrs, _ = cluster
    pool = engine.verifier
    ids = engine.encode("".join(f"def affinity_{i}(x):\n    return x - {i}\n\n" for i in range(6)))
    first = pool.open(SessionSpec(ids, 4))
    sessions = [first]
    try:
        assert first.cycle(CycleRequest()).cached_tokens == 0
        again = pool.open(SessionSpec(ids, 4))
        sessions.append(again)
        assert again.addr == first.addr and again.cycle(CycleRequest()).cached_tokens == (len(ids) - 1) // 32 * 32 > 0
        for slack in (0, None):  # no slack, or affinity off: the idle replica
            pool.affinity_slack = slack
            elsewhere = pool.open(SessionSpec(ids, 4))
            assert elsewhere.addr != first.addr and elsewhere.cycle(CycleRequest()).cached_tokens == (
                0 if slack == 0 else (len(ids) - 1) // 32 * 32
            )
            elsewhere.close()
    finally:
        pool.affinity_slack = 2
        for s in sessions:
            s.close()


def test_logprobs_over_the_link_equal_embedded(cluster, tiny_engine):
    _, stub, _, _ = cluster
    for method in ("vanilla", "sd"):
        req = gpb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=24, method=method, logprobs=3)
        msgs = list(stub.Generate(req, timeout=60))
        got = [x for m in msgs for x in m.logprobs]
        ref = tiny_engine.generate(
            GenerationRequest(tiny_engine.encode(PROMPTS[0]), 24, method=method, logprobs=3)
        ).result()["logprobs"]
        assert [x.token_id for x in got] == [x["token_id"] for x in ref] and len(got) == 24
        for x, r in zip(got, ref):
            assert abs(x.logprob - r["logprob"]) < 1e-4 and list(x.top_ids) == [i for i, _ in r["top"]]
            assert all(abs(a - b) < 1e-4 for a, (_, b) in zip(x.top_logprobs, r["top"]))


def test_prompt_logprobs_over_the_link_equal_embedded(cluster, tiny_engine):
    _, stub, _, _ = cluster
    ref = tiny_engine.generate(
        GenerationRequest(tiny_engine.encode(PROMPTS[0]), 8, method="sd", prompt_logprobs=2)
    ).result()["prompt_logprobs"]
    msgs = list(
        stub.Generate(
            gpb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=8, method="sd", prompt_logprobs=2), timeout=60
        )
    )
    got = msgs[-1].prompt_logprobs
    assert [x.token_id for x in got] == [x["token_id"] for x in ref] == tiny_engine.encode(PROMPTS[0])[1:]
    for x, r in zip(got, ref):
        assert abs(x.logprob - r["logprob"]) < 1e-4 and list(x.top_ids) == [i for i, _ in r["top"]]


def test_penalties_over_the_link_equal_embedded(cluster, tiny_engine):
    """Penalties, logit bias and bad words reach the remote verifier with the session: the same
    output as in process."""
    from services.common.types import Sampling

    _, stub, _, _ = cluster
    sp = Sampling(repetition_penalty=1.3, presence_penalty=0.3, frequency_penalty=0.4)
    ids = tiny_engine.encode(PROMPTS[1])
    ref = tiny_engine.generate(GenerationRequest(ids, 32, sampling=sp, method="vanilla")).result()["token_ids"]
    assert ref != tiny_engine.generate(GenerationRequest(ids, 32, method="vanilla")).result()["token_ids"]
    for method in ("vanilla", "sd"):
        msgs = list(
            stub.Generate(
                gpb.GenerateRequest(
                    prompt=PROMPTS[1],
                    max_new_tokens=32,
                    method=method,
                    repetition_penalty=1.3,
                    presence_penalty=0.3,
                    frequency_penalty=0.4,
                ),
                timeout=60,
            )
        )
        assert [t for m in msgs for t in m.token_ids] == ref, method
    bias = Sampling(logit_bias=((ref[0], -8.0), (ref[1], 3.0)), allowed_token_ids=tuple(range(0, 4000)))
    ref = tiny_engine.generate(GenerationRequest(ids, 32, sampling=bias, method="vanilla")).result()["token_ids"]
    for method in ("vanilla", "sd"):  # and the logit bias
        msgs = list(
            stub.Generate(
                gpb.GenerateRequest(
                    prompt=PROMPTS[1],
                    max_new_tokens=32,
                    method=method,
                    logit_bias=dict(bias.logit_bias),
                    allowed_token_ids=bias.allowed_token_ids,
                ),
                timeout=60,
            )
        )
        assert [t for m in msgs for t in m.token_ids] == ref, method
    plain = tiny_engine.generate(GenerationRequest(ids, 32, method="vanilla")).result()

    def bannable(t: int) -> bool:  # one token that a word (as written or after a space) encodes to
        d = tiny_engine.tokenizer.decode([t])
        return bool(d.strip()) and d in (d.lstrip(), " " + d.lstrip()) and tiny_engine.encode(d) == [t]

    word = tiny_engine.tokenizer.decode([next(t for t in plain["token_ids"] if bannable(t))]).strip()
    banned = Sampling(bad_words=tiny_engine.bad_word_ids([word]))
    ref = tiny_engine.generate(GenerationRequest(ids, 32, sampling=banned, method="vanilla")).result()["token_ids"]
    assert ref != plain["token_ids"]
    for method in ("vanilla", "sd"):  # and bad words
        msgs = list(
            stub.Generate(
                gpb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=32, method=method, bad_words=[word]), timeout=60
            )
        )
        assert [t for m in msgs for t in m.token_ids] == ref, method


def test_structured_output_over_the_link_equals_embedded(cluster, tiny_engine):
    """The grammar reaches the remote verifier with the session (and its draft LM): the same
    constrained output as in process."""
    from services.common.structured import StructuredOutput

    _, stub, _, _ = cluster
    regex = r"(def|class) [a-z_]{1,12}\([a-z, ]{0,16}\):\n    return [a-z0-9 +*]{1,20}\n"
    ids = tiny_engine.encode(PROMPTS[0])
    ref = tiny_engine.generate(
        GenerationRequest(ids, 48, method="vanilla", structured=StructuredOutput(regex=regex))
    ).result()["token_ids"]
    for method in ("vanilla", "sd"):
        msgs = list(
            stub.Generate(
                gpb.GenerateRequest(
                    prompt=PROMPTS[0],
                    max_new_tokens=48,
                    method=method,
                    structured_output=gpb.StructuredOutput(regex=regex),
                ),
                timeout=60,
            )
        )
        assert [t for m in msgs for t in m.token_ids] == ref, method


def test_bounded_load_all_streams_complete_no_session_left(cluster, tiny_engine):
    _, stub, addrs, servicer = cluster
    jobs = [(PROMPTS[i % 4], ["sd", "suffix", "vanilla"][i % 3]) for i in range(16)]
    results: dict[int, list[int]] = {}

    def run(i, prompt, method):
        results[i] = stream_ids(stub, prompt, 48, method)

    threads = [threading.Thread(target=run, args=(i, p, m)) for i, (p, m) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == len(jobs)
    for i, (p, _) in enumerate(jobs):
        ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(p), 48, method="vanilla")).result()
        assert results[i] == ref["token_ids"]
    end = time.time() + 10
    while (servicer.active or any(active(a) for a in addrs)) and time.time() < end:
        time.sleep(0.05)
    assert not servicer.active and all(active(a) == 0 for a in addrs)


def test_cancelled_stream_frees_its_session_on_the_replica(cluster):
    """A client cancelling mid-stream closes its session over the Link; the link carries on."""
    _, stub, addrs, servicer = cluster
    call = stub.Generate(gpb.GenerateRequest(prompt="def f(x):\n", max_new_tokens=150, method="sd"), timeout=60)
    next(call)
    call.cancel()
    end = time.time() + 10
    while (servicer.active or any(active(a) for a in addrs)) and time.time() < end:
        time.sleep(0.05)
    assert not servicer.active and all(active(a) == 0 for a in addrs)
    assert len(stream_ids(stub, PROMPTS[0], 20, "sd")) == 20  # the same link serves the next request


def test_per_session_streams_equal_embedded(cluster, tiny_dirs, tiny_engine):
    """The router's other transport (``--verifier-link stream``): one Session stream per request."""
    _, _, addrs, _ = cluster
    engine, server, _, stub = router(tiny_dirs, addrs, link=False)
    try:
        for p in PROMPTS:
            ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(p), 40, method="vanilla")).result()
            assert stream_ids(stub, p, 40, "sd") == ref["token_ids"], p
    finally:
        server.stop(0)


@pytest.mark.parametrize("link", [True, False], ids=["link", "stream"])
def test_replica_killed_mid_stream_loses_nothing(tiny_dirs, tiny_engine, link):
    slow, addr_slow = start_verifier(tiny_dirs, delay_ms=40)
    other, addr_other = start_verifier(tiny_dirs)
    engine, server, _, stub = router(tiny_dirs, [addr_slow, addr_other], link=link)
    try:
        engine.verifier.load[addr_other] = 100  # steer the session to the slow replica first
        failovers = REGISTRY.get_sample_value("specmesh_verifier_failovers_total", {"stage": "cycle"})
        prompt = "def add(a, b):\n"
        call = stub.Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=60, method="sd"), timeout=120)
        ids = list(next(call).token_ids)
        slow.kill()  # the replica holding the session dies mid-stream
        final = None
        for m in call:
            ids += m.token_ids
            final = m
        ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(prompt), 60, method="vanilla")).result()
        assert ids == ref["token_ids"] and final.finish_reason == gpb.FINISH_REASON_LENGTH
        assert REGISTRY.get_sample_value("specmesh_verifier_failovers_total", {"stage": "cycle"}) == failovers + 1
    finally:
        server.stop(0)
        stop([slow, other])


def test_reset_prefix_cache_reaches_every_replica(cluster):
    """RemoteVerifier.clear_prefix_cache (the router's /reset_prefix_cache): a prompt cached on a
    replica is prefilled whole after it, and placement no longer sends it after those blocks."""
    from services.common.types import CycleRequest, SessionSpec

    engine, _, _, _ = cluster
    pool = engine.verifier
    ids = engine.encode("".join(f"def reset_{i}(x):\n    return x + {i}\n\n" for i in range(6)))
    for _ in range(2):
        s = pool.open(SessionSpec(ids, 4))
        s.cycle(CycleRequest())
        s.close()
    assert pool.affinity.holders(list(ids))
    pool.clear_prefix_cache()
    assert not pool.affinity.holders(list(ids))
    s = pool.open(SessionSpec(ids, 4))
    try:
        assert s.cycle(CycleRequest()).cached_tokens == 0
    finally:
        s.close()
    raw = grpc.insecure_channel(cluster[2][0]).unary_unary(
        "/specmesh.v1.Verifier/ResetPrefixCache", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as e:  # bytes no message parses from: a clear status, and the replica lives
        raw(b"\xff\x00\x13garbage", timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_for(lambda: active(cluster[2][0]) == 0)  # (a session's close travels on its link, after the answer)


def test_malformed_verifier_input_gets_clear_status(cluster):
    _, _, addrs, _ = cluster
    stub = vgrpc.VerifierStub(grpc.insecure_channel(addrs[0]))
    bad = [
        [vpb.SessionRequest(cycle=vpb.Cycle(draft_ids=[1]))],  # cycle before open
        [vpb.SessionRequest(open=vpb.Open(prompt_ids=[], max_new_tokens=5))],  # empty prompt
        [vpb.SessionRequest(open=vpb.Open(prompt_ids=[1], max_new_tokens=5, policy="nope"))],  # unknown policy
        [vpb.SessionRequest(open=vpb.Open(prompt_ids=[99999], max_new_tokens=5))],  # id out of vocab
        [vpb.SessionRequest(open=vpb.Open(prompt_ids=[1], max_new_tokens=4_000_000))],  # huge
        [vpb.SessionRequest(open=vpb.Open(prompt_ids=[1], max_new_tokens=5, logprobs=21))],  # too many alternatives
        [
            vpb.SessionRequest(open=vpb.Open(prompt_ids=[1], max_new_tokens=5, max_draft=2)),
            vpb.SessionRequest(cycle=vpb.Cycle(draft_ids=[1, 2, 3, 4, 5])),
        ],  # draft too long
        [
            vpb.SessionRequest(open=vpb.Open(prompt_ids=[1], max_new_tokens=5, max_draft=4)),
            vpb.SessionRequest(cycle=vpb.Cycle(draft_ids=[1, 2, 3], draft_parents=[-1, 1, 0])),
        ],  # a parent after its child
        [
            vpb.SessionRequest(open=vpb.Open(prompt_ids=[1], max_new_tokens=5, max_draft=4)),
            vpb.SessionRequest(cycle=vpb.Cycle(draft_ids=[1, 2, 3], draft_parents=[-1, 0])),
        ],  # parents ≠ draft_ids
        [vpb.SessionRequest(open=vpb.Open(prompt_ids=[1], max_new_tokens=5, grammar="(a"))],  # bad grammar
        [
            vpb.SessionRequest(open=vpb.Open(prompt_ids=[1, 2], max_new_tokens=5, grammar="a+", generated=1))
        ],  # output off it
    ]
    for msgs in bad:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Session(iter(msgs), timeout=20))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    random_bytes_get_a_clear_status(addrs[0], "Session")
    assert active(addrs[0]) == 0


def random_bytes_get_a_clear_status(addr: str, rpc: str) -> None:
    """Random bytes instead of a protobuf message on a Verifier stream."""
    raw = grpc.insecure_channel(addr).stream_stream(
        f"/specmesh.v1.Verifier/{rpc}", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    for blob in (b"\xff\x00\x13garbage", corrupt_bytes(64)):  # the first never parses; the second may
        with pytest.raises(grpc.RpcError) as e:
            list(raw(iter([blob]), timeout=20))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_link_answers_each_session_and_each_bad_item_alone(cluster):
    """One Link message carries two sessions' opens and cycles and malformed items; each bad
    item gets its own clear status, the good sessions are answered, nothing is left open."""
    _, _, addrs, _ = cluster
    stub = vgrpc.VerifierStub(grpc.insecure_channel(addrs[1]))
    ok = vpb.Open(prompt_ids=[5, 6, 7], max_new_tokens=8, max_draft=2)
    items = [
        vpb.LinkItem(session_id="a", open=ok),
        vpb.LinkItem(session_id="b", open=ok),
        vpb.LinkItem(session_id="a", cycle=vpb.Cycle(draft_ids=[5, 6])),
        vpb.LinkItem(session_id="b", cycle=vpb.Cycle()),
        vpb.LinkItem(session_id="x", cycle=vpb.Cycle()),  # never opened
        vpb.LinkItem(session_id="y"),  # no kind
        vpb.LinkItem(session_id="", open=ok),  # no session id
        vpb.LinkItem(session_id="e", open=vpb.Open(prompt_ids=[], max_new_tokens=5)),  # empty prompt
        vpb.LinkItem(session_id="h", open=vpb.Open(prompt_ids=[1], max_new_tokens=4_000_000)),
        vpb.LinkItem(session_id="p", open=vpb.Open(prompt_ids=[1], max_new_tokens=5, policy="nope")),
    ]
    replies = [r for msg in stub.Link(iter([vpb.LinkRequest(items=items)]), timeout=30) for r in msg.replies]
    by_id = {}
    for r in replies:
        by_id.setdefault(r.session_id, []).append(r)
    assert [r.WhichOneof("kind") for r in by_id["a"]] == ["opened", "result"]
    assert [r.WhichOneof("kind") for r in by_id["b"]] == ["opened", "result"]
    assert len(by_id["b"][1].result.committed) == 1 and 1 <= len(by_id["a"][1].result.committed) <= 3
    for sid, field in (
        ("x", "not open"),
        ("y", "set one of"),
        ("", "session_id"),
        ("e", "prompt_ids"),
        ("h", "max_new_tokens"),
        ("p", "policy"),
    ):
        (err,) = by_id[sid]
        assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and field in err.error.message, err
    random_bytes_get_a_clear_status(addrs[1], "Link")
    end = time.time() + 5
    while active(addrs[1]) and time.time() < end:
        time.sleep(0.05)
    assert active(addrs[1]) == 0  # the half-closed link closed both sessions


def test_a_links_step_by_column_is_answered_by_column_and_bad_columns_get_a_clear_status(cluster):
    """A Link message's step (``StepCycles``) is handled as cycle items would be: good cycles
    are answered by column (``StepResults``), a session not open gets its own status; a step
    whose columns disagree fails its sessions with INVALID_ARGUMENT, and nothing is left open."""
    from services.common.types import CycleRequest
    from services.verifier.wire import results_from_pb, step_to_pb

    _, _, addrs, _ = cluster
    stub = vgrpc.VerifierStub(grpc.insecure_channel(addrs[1]))
    ok = vpb.Open(prompt_ids=[5, 6, 7], max_new_tokens=8, max_draft=2)
    cycles = [
        ("a", CycleRequest(draft_ids=(5, 6), draft_source="suffix")),
        ("b", CycleRequest()),
        ("x", CycleRequest()),
    ]
    msg = vpb.LinkRequest(items=[vpb.LinkItem(session_id=s, open=ok) for s in "ab"], step=step_to_pb(cycles))
    kinds: dict[str, list[str]] = {}
    results = {}
    for out in stub.Link(iter([msg]), timeout=30):
        for r in out.replies:
            kinds.setdefault(r.session_id, []).append(r.WhichOneof("kind"))
            if r.WhichOneof("kind") == "error":
                assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "not open" in r.error.message
        results.update(results_from_pb(out.step))
    assert kinds == {"a": ["opened"], "b": ["opened"], "x": ["error"]}
    assert set(results) == {"a", "b"} and len(results["b"].committed) == 1
    assert 1 <= len(results["a"].committed) <= 3 and results["a"].source == "suffix"

    bad = step_to_pb([("c", CycleRequest(draft_ids=(5, 6)))])
    bad.draft_counts[0] = 3  # more tokens than the step carries
    msg = vpb.LinkRequest(items=[vpb.LinkItem(session_id="c", open=ok)], step=bad)
    replies = [r for out in stub.Link(iter([msg]), timeout=30) for r in out.replies]
    assert [r.WhichOneof("kind") for r in replies] == ["opened", "error"]
    assert replies[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "column" in replies[1].error.message
    end = time.time() + 5
    while active(addrs[1]) and time.time() < end:
        time.sleep(0.05)
    assert active(addrs[1]) == 0


def test_a_lone_session_on_a_link_crosses_no_thread_of_ours_and_two_hand_reading_over(tiny_dirs, tiny_engine):
    """While nothing is in flight the link's writer reads the next message itself, leads the
    step and answers with no hand-off: a lone session's cycles start no reader thread. Two
    routers' sessions cycling at once (one link's step arriving while the other's runs) hand
    reading to the reader thread and back; every output equals vanilla's, and nothing is left
    open."""
    from services.verifier.grpc_server import build_verifier_server

    core = Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=tiny_dirs[1],
            eagle3=None,
            predictor=None,
            ocm_snapshot=None,
            max_new_tokens_limit=200,
        )
    ).verifier
    server, servicer, port = build_verifier_server(core, "127.0.0.1", 0)
    server.start()
    engine, other = (
        Engine(
            EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, max_new_tokens_limit=200),
            verifier=RemoteVerifier([f"127.0.0.1:{port}"], link=True),
        )
        for _ in range(2)
    )
    readers = lambda: [t for t in threading.enumerate() if t.name == "verifier-link"]  # noqa: E731
    try:
        refs = {
            p: tiny_engine.generate(GenerationRequest(tiny_engine.encode(p), 40, method="vanilla")).result()
            for p in PROMPTS
        }
        for method in ("vanilla", "sd"):
            got = engine.generate(GenerationRequest(engine.encode(PROMPTS[1]), 40, method=method)).result()
            assert got["token_ids"] == refs[PROMPTS[1]]["token_ids"], method
        assert not readers()  # every message was read by the writer
        outs = {}
        threads = [
            threading.Thread(
                target=lambda p=p, e=e: outs.__setitem__(
                    p, e.generate(GenerationRequest(e.encode(p), 40, method="sd")).result()
                )
            )
            for p, e in zip(PROMPTS, [engine, other] * len(PROMPTS))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert {p: o["token_ids"] for p, o in outs.items()} == {p: r["token_ids"] for p, r in refs.items()}
        assert any(link._thread is not None for link in servicer.links)  # cycles in flight as others came
        got = engine.generate(GenerationRequest(engine.encode(PROMPTS[0]), 40, method="sd")).result()
        assert got["token_ids"] == refs[PROMPTS[0]]["token_ids"]
        assert all(link._reader == "writer" for link in servicer.links)
        end = time.time() + 5
        while servicer.active and time.time() < end:
            time.sleep(0.01)
        assert not servicer.active
    finally:
        engine.verifier.close()
        other.verifier.close()
        server.stop(0)


def test_a_grammar_compiling_on_the_verifier_does_not_stall_its_link(cluster):
    """A session whose grammar the replica has not compiled opens on a thread of its own: the
    other session on the same link keeps cycling while it compiles (here a pattern that hits
    the 10 s compile limit), then the slow open alone gets INVALID_ARGUMENT."""
    import queue

    _, _, addrs, _ = cluster
    stub = vgrpc.VerifierStub(grpc.insecure_channel(addrs[1]))
    outbox: queue.Queue = queue.Queue()
    call = stub.Link(iter(outbox.get, None), timeout=60)
    inbox: dict[str, queue.Queue] = {"a": queue.Queue(), "slow": queue.Queue()}

    def read():
        for msg in call:
            for r in msg.replies:
                inbox[r.session_id].put((time.monotonic(), r))

    threading.Thread(target=read, daemon=True).start()
    outbox.put(
        vpb.LinkRequest(
            items=[
                vpb.LinkItem(session_id="a", open=vpb.Open(prompt_ids=[5, 6, 7], max_new_tokens=60)),
                vpb.LinkItem(
                    session_id="slow",
                    open=vpb.Open(prompt_ids=[5], max_new_tokens=8, grammar=r"(    [ -~]{0,100}\n){1,16}"),
                ),
            ]
        )
    )
    t0, opened = inbox["a"].get(timeout=10)
    assert opened.WhichOneof("kind") == "opened"
    for _ in range(20):
        outbox.put(vpb.LinkRequest(items=[vpb.LinkItem(session_id="a", cycle=vpb.Cycle())]))
        t, r = inbox["a"].get(timeout=10)
        assert r.WhichOneof("kind") == "result"
    assert t - t0 < 5  # 20 cycles answered while the other open compiled (10 s)
    t_slow, err = inbox["slow"].get(timeout=30)
    assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "too complex" in err.error.message
    assert t_slow > t
    outbox.put(None)
    end = time.time() + 5
    while active(addrs[1]) and time.time() < end:
        time.sleep(0.05)
    assert active(addrs[1]) == 0


def test_a_client_without_a_deadline_is_served(cluster, tiny_dirs, tiny_engine):
    """grpcurl and most clients set no deadline. gRPC then reports the time left as the end of
    its clock, which must not reach the verifier's timeouts (it overflowed the Link's wait, and
    every such call failed UNKNOWN): over the Link and over per-session streams."""
    _, stub, addrs, _ = cluster
    ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(PROMPTS[0]), 24, method="vanilla")).result()
    assert stream_ids(stub, PROMPTS[0], 24, "sd", timeout=None) == ref["token_ids"]
    _, server, _, streams = router(tiny_dirs, addrs, link=False)
    try:
        assert stream_ids(streams, PROMPTS[0], 24, "sd", timeout=None) == ref["token_ids"]
    finally:
        server.stop(0)


def test_client_deadline_reaches_the_verifier(tiny_dirs):
    slow, addr = start_verifier(tiny_dirs, delay_ms=50)
    engine, server, _, stub = router(tiny_dirs, [addr])
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(gpb.GenerateRequest(prompt="def f():", max_new_tokens=150, method="sd"), timeout=0.5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        end = time.time() + 5
        while active(addr) and time.time() < end:
            time.sleep(0.05)
        assert active(addr) == 0  # the verifier's session ended with the client's deadline
    finally:
        server.stop(0)
        stop([slow])


def test_sigterm_drains_in_flight_sessions(tiny_dirs, tiny_engine):
    """Graceful shutdown: a replica told to stop finishes the streams it holds (no other replica exists)."""
    import signal

    proc, addr = start_verifier(tiny_dirs, delay_ms=25)
    engine, server, _, stub = router(tiny_dirs, [addr])
    try:
        prompt = "import os\nimport sys\n"
        call = stub.Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=40, method="sd"), timeout=120)
        ids = list(next(call).token_ids)
        proc.send_signal(signal.SIGTERM)
        for m in call:
            ids += m.token_ids
        ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(prompt), 40, method="vanilla")).result()
        assert ids == ref["token_ids"]
        assert proc.wait(60) == 0
    finally:
        server.stop(0)
        stop([proc])


@pytest.mark.parametrize("link", [True, False], ids=["link", "stream"])
def test_cancel_stops_a_remote_prefill_at_the_next_step(tiny_dirs, link):
    """A router whose client cancels while its prompt prefills in chunks on a remote verifier
    (over the Link or a per-session stream): the cycle ends at once with SessionCancelled (no
    failover), the verifier feeds no more of the prompt and closes the session."""
    from services.common.types import SessionCancelled, SessionSpec
    from services.verifier.grpc_server import build_verifier_server

    core = Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=None,
            eagle3=None,
            predictor=None,
            ocm_snapshot=None,
            max_new_tokens_limit=200,
            prefill_chunk=2,
        )
    ).verifier
    server, servicer, port = build_verifier_server(core, "127.0.0.1", 0)
    server.start()
    idle = core.open(SessionSpec([5], 4))  # another open session: prompts prefill in chunks
    chunks: list[int] = []
    step = core.runner.step
    core.runner.step = lambda v, p, t=None, g=None: chunks.extend(n for _, n in p) or step(v, p, t, g)
    remote = RemoteVerifier([f"127.0.0.1:{port}"], link=link)
    engine = Engine(
        EngineConfig(target=tiny_dirs[0], draft=None, eagle3=None, max_new_tokens_limit=200), verifier=remote
    )
    gen = engine.generate(GenerationRequest(list(range(300, 500)), 4, method="vanilla"))
    err = {}

    def run():
        try:
            gen.result()
        except SessionCancelled as e:
            err["e"] = e

    try:
        t = threading.Thread(target=run)
        t.start()
        end = time.time() + 30
        while len(chunks) < 3 and time.time() < end:
            time.sleep(0.001)
        assert len(chunks) >= 3
        gen.cancel()
        t.join(10)
        assert not t.is_alive() and "e" in err
        end = time.time() + 10
        while len(servicer.active) and time.time() < end:
            time.sleep(0.01)
        assert not servicer.active and sum(chunks) < 150  # closed; the prompt was never fed whole
    finally:
        core.runner.step = step
        idle.close()
        remote.close()
        server.stop(0)


def test_health_follows_the_verifier_replicas(tiny_dirs):
    """With no verifier replica answering, the router's gRPC health is NOT_SERVING and its HTTP
    /health 503 (a load balancer sends requests elsewhere); while one answers, SERVING and 200."""
    import urllib.error
    import urllib.request
    from dataclasses import replace

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.assembly import start_http

    proc, addr = start_verifier(tiny_dirs)
    cfg = ServerConfig(port=0, metrics_port=0)
    engine = Engine(EngineConfig(target=tiny_dirs[0], draft=None, eagle3=None), verifier=RemoteVerifier([addr]))
    server, servicer, grpc_port = build_server(engine, cfg)
    server.start()
    http = start_http(engine, replace(cfg, http_port=0), servicer)
    http_port = http.server.servers[0].sockets[0].getsockname()[1]
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))

    def http_health() -> int:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code

    def grpc_serving() -> bool:
        return (
            health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        )

    try:
        assert http_health() == 200 and grpc_serving()
        stop([proc])
        end = time.time() + 30
        while grpc_serving() and time.time() < end:
            time.sleep(0.2)
        assert not grpc_serving() and http_health() == 503
    finally:
        http.stop()
        server.stop(0)
        stop([proc])


def test_a_router_started_before_its_verifier_waits_for_it(tiny_dirs):
    """Pods of one release start together and a verifier loads its models before it listens:
    the router's verifier pool waits for a replica's answer (within ``start_timeout_s``)
    instead of failing at once; with none by then it says so."""
    from services.common.runtime import free_port
    from services.verifier.grpc_server import build_verifier_server

    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no verifier replica answered within 2 s"):
        RemoteVerifier([f"127.0.0.1:{port}"], start_timeout_s=2.0)
    assert time.monotonic() - t0 < 10
    core = Engine(
        EngineConfig(target=tiny_dirs[0], draft=None, eagle3=None, predictor=None, ocm_snapshot=None)
    ).verifier
    server = None

    def start_late() -> None:
        nonlocal server
        time.sleep(3.0)  # the router asks first
        server = build_verifier_server(core, "127.0.0.1", port)[0]
        server.start()

    late = threading.Thread(target=start_late)
    late.start()
    try:
        pool = RemoteVerifier([f"127.0.0.1:{port}"], start_timeout_s=60.0)
        assert pool.context_len == core.context_len and pool.vocab_size == core.vocab_size
        pool.close()
    finally:
        late.join()
        if server is not None:
            server.stop(0)


@pytest.mark.parametrize("older", [False, True])
def test_a_step_sends_every_session_s_cycle_in_one_link_message(tiny_dirs, tiny_engine, monkeypatch, older):
    """The router's scheduler steps n sessions together over the Link: each step's cycles leave in
    one message, by column (no more cycle-carrying messages than steps, each with every session
    still running), their replies come back by column and are applied from the link's reader
    thread, and every output equals the embedded one. To a replica of an older release (its
    ``Opened`` does not say it reads steps by column) the cycles go as items, one message a step."""
    from services.verifier import grpc_server
    from services.verifier.grpc_server import LinkServer, build_verifier_server

    cycles_per_message: list[int] = []
    results_per_message: list[int] = []
    take = LinkServer._take
    respond = grpc_server.response_of

    def counted(self, msg):
        items = sum(item.WhichOneof("kind") == "cycle" for item in msg.items)
        assert not (items and msg.HasField("step")) and not (items if not older else msg.HasField("step"))
        if items or msg.step.session_ids:
            cycles_per_message.append(items or len(msg.step.session_ids))
        return take(self, msg)

    def answered(replies):
        out = respond(replies)
        single = sum(r.WhichOneof("kind") == "result" for r in out.replies)
        assert not single or older  # by column, unless the cycles came as items
        results_per_message.append(len(out.step.session_ids) + single)
        return out

    if older:

        class Older:  # the messages as a replica of an older release builds them
            def __getattr__(self, name):
                return getattr(vpb, name)

            @staticmethod
            def Opened(step_columns=False, **fields):  # noqa: N802 - the message's name
                return vpb.Opened(**fields)

        monkeypatch.setattr(grpc_server, "pb", Older())
    monkeypatch.setattr(LinkServer, "_take", counted)
    monkeypatch.setattr(grpc_server, "response_of", answered)
    cfg = EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, predictor=None, ocm_snapshot=None)
    server, _, port = build_verifier_server(Engine(cfg).verifier, "127.0.0.1", 0)
    server.start()
    engine = Engine(cfg, verifier=RemoteVerifier([f"127.0.0.1:{port}"], link=True))
    try:
        ids = engine.encode(PROMPTS[0])
        ref = tiny_engine.generate(GenerationRequest(ids, 24, method="vanilla", ignore_eos=True)).result()["token_ids"]
        completions = engine.generate_all(GenerationRequest(ids, 24, method="sd", n=4, ignore_eos=True))
        steps = engine.scheduler.steps
        for _ in completions:
            pass
        assert all(g.output_ids == ref for g in completions.gens)
        assert len(cycles_per_message) <= engine.scheduler.steps - steps
        assert max(cycles_per_message) == 4  # the four sessions' cycles in one message
        assert sum(results_per_message) == sum(cycles_per_message)  # every result, as it was asked
    finally:
        engine.close()
        server.stop(0)
