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
