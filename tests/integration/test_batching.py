"""Concurrent sessions are verified together (one ragged forward) and stay exact."""
import threading

from services.common.metrics import VERIFY_BATCH
from services.router.engine import GenerationRequest

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    pass\n", "x = [1, 2", "for i in range(", "#"]


def histogram(suffix: str) -> float:
    """_count = target forwards, _sum = session-rows verified in them."""
    return next(s.value for s in VERIFY_BATCH.collect()[0].samples if s.name.endswith(suffix))


def test_concurrent_sessions_share_forwards_and_match_vanilla(tiny_engine):
    eng = tiny_engine
    refs = {p: eng.generate(GenerationRequest(eng.encode(p), 60, method="vanilla")).result()["token_ids"]
            for p in PROMPTS}
    before_forwards, before_rows = histogram("_count"), histogram("_sum")
    out = {}

    def run(i, p, method):
        out[i] = eng.generate(GenerationRequest(eng.encode(p), 60, method=method)).result()["token_ids"]

    jobs = [(i, p, m) for i, (p, m) in enumerate((p, m) for p in PROMPTS for m in ("vanilla", "sd", "suffix"))]
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, p, _ in jobs:
        assert out[i] == refs[p]
    forwards, rows = histogram("_count") - before_forwards, histogram("_sum") - before_rows
    assert rows / forwards > 1.5, (rows, forwards)  # sessions really were verified together


def test_speculation_stops_while_the_verifier_step_is_loaded(tiny_dirs, tiny_engine):
    """spec_disable_batch: once a cycle reports a batch above the limit, the next cycles
    verify no draft (plain steps), and the output is still vanilla's; at or under it, drafts go on."""
    from dataclasses import replace

    from services.common.config import EngineConfig
    from services.router.engine import Engine

    def loaded(engine, batch):  # every verifier step reports ``batch`` sessions
        open_ = engine.verifier.open

        def open_loaded(spec):
            s = open_(spec)
            cycle = s.cycle
            s.cycle = lambda req: replace(cycle(req), batch_size=batch)
            return s
        engine.verifier.open = open_loaded
        return engine

    cfg = replace(tiny_engine.cfg, spec_disable_batch=4)
    ids = tiny_engine.encode(PROMPTS[0])
    ref = tiny_engine.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"]
    busy = loaded(Engine(cfg), batch=5).generate(GenerationRequest(ids, 40, method="sd")).result()
    assert busy["token_ids"] == ref
    assert busy["stats"]["draft_tokens"] <= 4      # only the first cycle, before any batch was seen
    calm = loaded(Engine(cfg), batch=4).generate(GenerationRequest(ids, 40, method="sd")).result()
    assert calm["token_ids"] == ref and calm["stats"]["draft_tokens"] > 4


def test_chunked_prefill_beside_decoding_sessions_keeps_every_output(tiny_dirs, tiny_eagle3):
    """prefill_chunk 3: prompts that arrive while other sessions decode are fed at most 3 tokens
    per step, all together, beside those sessions' cycles (never a whole prompt in a step that
    carries a decoding cycle), and every output, for each method (EAGLE-3 takes each chunk's
    features in as it comes), still equals its single-request greedy output."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=tiny_eagle3, num_speculative_tokens=4,
                              draft_confidence=0.0, max_new_tokens_limit=200, predictor=None, ocm_snapshot=None,
                              prefill_chunk=3))
    runner = eng.verifier.runner
    steps: list[tuple[list[int], list[int]]] = []      # per forward: cycles' pending tokens, prefill chunks
    decoding = threading.Event()
    step = runner.step

    def logged(verify, prefill):
        steps.append(([len(st.pending) for st, _ in verify], [n for _, n in prefill]))
        if verify and all(len(st.pending) == 1 for st, _ in verify):
            decoding.set()
        return step(verify, prefill)

    long_prompts = [p * 4 for p in PROMPTS[:4]]
    methods = ("vanilla", "sd", "suffix", "eagle3")
    refs = {(p, m): eng.generate(GenerationRequest(eng.encode(p), 40, method=m)).result()["token_ids"]
            for p in PROMPTS[:2] + long_prompts for m in methods}
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
    assert any(1 in v for v, _ in chunked)               # chunks rode beside other sessions' cycles
    # a step that carries a decoding cycle (one pending token) feeds at most 3 prompt tokens in all
    assert all(sum(x for x in v if x > 1) + sum(c) <= 3 for v, c in steps if 1 in v)


def test_a_drafter_failure_fails_only_its_cycles_and_runs_no_empty_forward(tiny_dirs):
    """When every cycle of a step fails in drafting, the step ends there (no forward over
    nothing); the session's next cycle runs normally."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine
    from services.verifier.core import CycleRequest, SessionSpec

    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, predictor=None, ocm_snapshot=None))
    core = eng.verifier
    drafter = core.drafters["draft-lm"]
    session = core.open(SessionSpec(eng.encode("def add(a, b):\n"), 8, model_drafter="draft-lm", max_draft=4))
    forwards = []
    step = core.runner.step
    core.runner.step = lambda v, p: forwards.append((v, p)) or step(v, p)
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
