"""Concurrent sessions are verified together (one ragged forward) and stay exact."""

import threading

from services.common.metrics import VERIFY_BATCH
from services.router.engine import GenerationRequest
from tests.conftest import wait_for

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    pass\n", "x = [1, 2", "for i in range(", "#"]


def histogram(suffix: str) -> float:
    """_count = target forwards, _sum = session-rows verified in them."""
    return next(s.value for s in VERIFY_BATCH.collect()[0].samples if s.name.endswith(suffix))


def concurrently_equal_vanilla(eng, prompts: list[str], methods: tuple[str, ...], n: int) -> dict:
    """Every (prompt, method) at once, each output checked against vanilla's alone; the
    sessions must have shared forwards. → (prompt, method) → its result."""
    refs = {
        p: eng.generate(GenerationRequest(eng.encode(p), n, method="vanilla")).result()["token_ids"] for p in prompts
    }
    before_forwards, before_rows = histogram("_count"), histogram("_sum")
    out = {}

    def run(p, method):
        out[(p, method)] = eng.generate(GenerationRequest(eng.encode(p), n, method=method)).result()

    threads = [threading.Thread(target=run, args=(p, m)) for p in prompts for m in methods]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for (p, m), r in out.items():
        assert r["token_ids"] == refs[p], (m, p)
    assert len(out) == len(threads)
    forwards, rows = histogram("_count") - before_forwards, histogram("_sum") - before_rows
    assert rows / forwards > 1.5, (rows, forwards)  # sessions really were verified together
    return out


def test_concurrent_sessions_share_forwards_and_match_vanilla(tiny_engine):
    concurrently_equal_vanilla(tiny_engine, PROMPTS, ("vanilla", "sd", "suffix"), 60)


def test_speculation_stops_while_the_verifier_step_is_loaded(tiny_dirs, tiny_engine):
    """spec_disable_batch: once a cycle reports a batch above the limit, the next cycles
    verify no draft (plain steps), and the output is still vanilla's; at or under it, drafts go on."""
    from dataclasses import replace

    from services.common.types import CycleResult
    from services.router.engine import Engine

    def loaded(engine, batch):  # every verifier step reports ``batch`` sessions
        step = engine.verifier.step

        def step_loaded(cycles, done):
            step(
                cycles, lambda i, out: done(i, replace(out, batch_size=batch) if isinstance(out, CycleResult) else out)
            )

        engine.verifier.step = step_loaded
        return engine

    cfg = replace(tiny_engine.cfg, spec_disable_batch=4)
    ids = tiny_engine.encode(PROMPTS[0])
    ref = tiny_engine.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"]
    busy = loaded(Engine(cfg), batch=5).generate(GenerationRequest(ids, 40, method="sd")).result()
    assert busy["token_ids"] == ref
    assert busy["stats"]["draft_tokens"] <= 4  # only the first cycle, before any batch was seen
    calm = loaded(Engine(cfg), batch=4).generate(GenerationRequest(ids, 40, method="sd")).result()
    assert calm["token_ids"] == ref and calm["stats"]["draft_tokens"] > 4


def test_chunked_prefill_beside_decoding_sessions_keeps_every_output(tiny_dirs, tiny_eagle3):
    """prefill_chunk 3: prompts that arrive while other sessions decode are fed at most 3 tokens
    per step, all together, beside those sessions' cycles (never a whole prompt in a step that
    carries a decoding cycle), and every output, for each method (EAGLE-3 takes each chunk's
    features in as it comes), still equals its single-request greedy output."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    eng = Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=tiny_dirs[1],
            eagle3=tiny_eagle3,
            num_speculative_tokens=4,
            draft_confidence=0.0,
            max_new_tokens_limit=200,
            predictor=None,
            ocm_snapshot=None,
            prefill_chunk=3,
        )
    )
    runner = eng.verifier.runner
    steps: list[tuple[list[int], list[int]]] = []  # per forward: cycles' pending tokens, prefill chunks
    decoding = threading.Event()
    step = runner.step

    def logged(verify, prefill, trees=None, gates=None):
        steps.append(([len(st.pending) for st, _ in verify], [n for _, n in prefill]))
        if verify and all(len(st.pending) == 1 for st, _ in verify):
            decoding.set()
        return step(verify, prefill, trees, gates)

    long_prompts = [p * 4 for p in PROMPTS[:4]]
    methods = ("vanilla", "sd", "suffix", "eagle3")
    refs = {
        (p, m): eng.generate(GenerationRequest(eng.encode(p), 40, method=m)).result()["token_ids"]
        for p in PROMPTS[:2] + long_prompts
        for m in methods
    }
    runner.step = logged
    out = {}

    def run(p, m, wait):
        if wait:
            decoding.wait(30)
        out[p, m] = eng.generate(GenerationRequest(eng.encode(p), 40, method=m)).result()["token_ids"]

    jobs = [(p, m, False) for p in PROMPTS[:2] for m in methods] + [(p, m, True) for p in long_prompts for m in methods]
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    runner.step = step
    assert out == {(p, m): refs[p, m] for p, m, _ in jobs}
    chunked = [(v, c) for v, c in steps if c]
    assert any(1 in v for v, _ in chunked)  # chunks rode beside other sessions' cycles
    # a step that carries a decoding cycle (one pending token) feeds at most 3 prompt tokens in all
    assert all(sum(x for x in v if x > 1) + sum(c) <= 3 for v, c in steps if 1 in v)


def test_a_drafter_failure_fails_only_its_cycles_and_runs_no_empty_forward(tiny_dirs):
    """When every cycle of a step fails in drafting, the step ends there (no forward over
    nothing); the session's next cycle runs normally."""
    from services.common.config import EngineConfig
    from services.common.types import CycleRequest, SessionSpec
    from services.router.engine import Engine

    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, predictor=None, ocm_snapshot=None))
    core = eng.verifier
    drafter = core.drafters["draft-lm"]
    session = core.open(SessionSpec(eng.encode("def add(a, b):\n"), 8, model_drafter="draft-lm", max_draft=4))
    forwards = []
    step = core.runner.step
    core.runner.step = lambda v, p, t=None, g=None: forwards.append((v, p)) or step(v, p, t, g)
    propose = drafter.propose_batch
    drafter.propose_batch = lambda asks: (_ for _ in ()).throw(RuntimeError("draft failed"))
    try:
        session.cycle(CycleRequest(draft_with="draft-lm", budget=4))
        raise AssertionError("the cycle should have failed")
    except RuntimeError as e:
        assert "draft failed" in str(e)
    assert forwards == []
    drafter.propose_batch = propose
    assert session.cycle(CycleRequest(draft_with="draft-lm", budget=4)).committed and len(forwards) == 1
    session.close()


def test_a_cancelled_prompt_stops_prefilling_at_the_next_step(tiny_dirs):
    """A client that goes away while its long prompt is prefilling in chunks: the cycle fails
    with SessionCancelled at the next step, no more of the prompt is fed, the session is freed,
    and the stream decoding beside it finishes with its own output."""
    import time

    from services.common.config import EngineConfig
    from services.common.types import SessionCancelled
    from services.router.engine import Engine

    eng = Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=tiny_dirs[1],
            eagle3=None,
            predictor=None,
            ocm_snapshot=None,
            max_new_tokens_limit=200,
            prefill_chunk=4,
        )
    )
    runner = eng.verifier.runner
    short = eng.encode(PROMPTS[0])
    ref = eng.generate(GenerationRequest(short, 120, method="sd")).result()["token_ids"]
    long_ids = eng.encode(" ".join(PROMPTS * 12))[:200]
    fed: list[int] = []  # prompt chunks fed for the long request's session
    step = runner.step
    long_gen = eng.generate(GenerationRequest(long_ids, 8, method="sd"))

    def logged(verify, prefill, trees=None, gates=None):
        target = long_gen._session.target if long_gen._session is not None else None
        fed.extend(n for st, n in prefill if st is target)
        return step(verify, prefill, trees, gates)

    runner.step = logged
    out, err = {}, {}

    def decode():
        out["short"] = eng.generate(GenerationRequest(short, 120, method="sd")).result()["token_ids"]

    def prefill_long():
        try:
            long_gen.result()
        except SessionCancelled as e:
            err["long"] = (e, time.monotonic())

    t_short = threading.Thread(target=decode)
    t_short.start()
    time.sleep(0.05)
    t_long = threading.Thread(target=prefill_long)
    t_long.start()
    end = time.monotonic() + 30
    while len(fed) < 3 and time.monotonic() < end:
        time.sleep(0.001)
    assert len(fed) >= 3, "the long prompt never prefilled in chunks"
    long_gen.cancel()
    at_cancel = len(fed)
    t_long.join(30)
    t_short.join(60)
    runner.step = step
    assert "long" in err and len(fed) <= at_cancel + 1  # at most the step already running
    assert sum(fed) < len(long_ids) - 1  # the prompt was never fed whole
    assert long_gen._session.closed and long_gen._session.session_id not in eng.verifier.sessions
    assert out["short"] == ref


def test_closing_a_busy_session_on_the_link_cancels_its_prefill(tiny_dirs):
    """Over the Link, a close for a session whose cycle is in flight (a router whose deadline
    passed) stops that cycle at the next step: a CANCELLED reply, no more prompt fed, and the
    session closes."""
    import queue
    import time

    import grpc

    from services.common.config import EngineConfig
    from services.router.engine import Engine
    from services.verifier.grpc_server import build_verifier_server
    from specmesh.v1 import verifier_pb2 as vpb
    from specmesh.v1 import verifier_pb2_grpc as vgrpc

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
    chunks: list[int] = []
    step = core.runner.step
    core.runner.step = lambda v, p, t=None, g=None: chunks.extend(n for _, n in p) or step(v, p, t, g)
    items: queue.Queue = queue.Queue()

    def requests():
        while (item := items.get()) is not None:
            yield vpb.LinkRequest(items=[item])

    try:
        replies = vgrpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{port}")).Link(requests(), timeout=60)
        items.put(vpb.LinkItem(session_id="idle", open=vpb.Open(prompt_ids=[5], max_new_tokens=4)))
        items.put(vpb.LinkItem(session_id="long", open=vpb.Open(prompt_ids=list(range(300, 500)), max_new_tokens=4)))
        items.put(vpb.LinkItem(session_id="long", cycle=vpb.Cycle()))
        end = time.time() + 30
        while len(chunks) < 3 and time.time() < end:  # the open idle session makes "long" prefill in chunks
            time.sleep(0.001)
        assert len(chunks) >= 3
        items.put(vpb.LinkItem(session_id="long", close=vpb.Close()))
        got = []
        for msg in replies:
            got += [r for r in msg.replies if r.session_id == "long"]
            if any(r.WhichOneof("kind") != "opened" for r in got):
                break
        assert got[-1].error.code == grpc.StatusCode.CANCELLED.value[0], got[-1]
        assert sum(chunks) < 150  # stopped long before the whole prompt
        end = time.time() + 5
        while len(servicer.active) > 1 and time.time() < end:
            time.sleep(0.01)
        assert len(servicer.active) == 1  # "long" is closed, "idle" is still open
        items.put(None)
    finally:
        core.runner.step = step
        server.stop(0)


def test_concurrent_tree_sessions_verify_together_and_match_vanilla(tiny_eagle_engine):
    """eagle3-tree and suffix-tree sessions beside chain ones: their trees grow in one head
    step per depth, verify in one ragged forward with tree masks, and every output is
    vanilla's."""
    out = concurrently_equal_vanilla(
        tiny_eagle_engine, [p * 2 for p in PROMPTS], ("eagle3-tree", "suffix-tree", "eagle3"), 48
    )
    assert sum(r["stats"]["draft_tokens"] for (_, m), r in out.items() if m == "eagle3-tree") > 0


def test_pooled_kv_sessions_verify_together_match_vanilla_and_give_their_slots_back(
    tiny_dirs, tiny_eagle3, tiny_engine
):
    """--kv-pool: the target's and the draft LM's sessions sit in pooled slots and attend in one
    call per layer; chains, trees and the prefix cache's loads into slots keep every output
    equal to vanilla's without the pool, and once the requests end no slot is held."""
    import gc

    from services.common.config import EngineConfig
    from services.router.engine import Engine

    eng = Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=tiny_dirs[1],
            eagle3=tiny_eagle3,
            eagle3_k=4,
            num_speculative_tokens=4,
            draft_confidence=0.0,
            max_new_tokens_limit=200,
            predictor=None,
            ocm_snapshot=None,
            kv_pool=True,
        )
    )
    target, draft = eng.verifier.runner.model, eng.verifier.drafters["draft-lm"].model
    assert target.kv_pool is not None and draft.kv_pool is not None
    prompts = [p * 2 for p in PROMPTS]
    refs = {
        p: tiny_engine.generate(GenerationRequest(tiny_engine.encode(p), 40, method="vanilla")).result()["token_ids"]
        for p in prompts
    }
    for _ in range(2):  # the second round loads the first's prompt blocks from the prefix cache into slots
        out = concurrently_equal_vanilla(eng, prompts, ("sd", "suffix-tree", "eagle3-tree"), 40)
        assert all(r["token_ids"] == refs[p] for (p, _), r in out.items())
    assert eng.verifier.runner.prefix is not None and eng.verifier.runner.prefix.bytes > 0
    assert max(len(segs) for segs in target.kv_pool.segments.values()) >= 2  # 18 sessions: several segments
    # the scheduler's thread lets go of a generation just after its end reaches the client
    assert wait_for(lambda: (gc.collect(), target.kv_pool.used == 0 and draft.kv_pool.used == 0)[-1], timeout=10)
