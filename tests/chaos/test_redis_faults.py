"""The shared correction memory when Redis fails: restarted without persistence mid-serving (every
replica adds back the counts it wrote: none lost, none twice; the prior comes back; lossless
outputs unchanged), and down at shutdown (the pending counts go to a spill file that the next
start sends)."""

import threading
import time

import redis

from services.memory.redis_link import RedisLink
from services.memory.redis_memory import RedisCorrectionMemory
from tests.conftest import wait_for

PREFIX = "chaos:ocm"


def stored(url: str, prefix: str = PREFIX) -> dict[str, int]:
    """Online counts in the store, summed over its buckets, by field."""
    r = redis.Redis.from_url(url)
    out: dict[str, int] = {}
    for key in r.keys(f"{prefix}:b:*"):
        for field, n in r.hgetall(key).items():
            out[field.decode()] = out.get(field.decode(), 0) + int(n)
    return out


def prior(url: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in redis.Redis.from_url(url).hgetall(f"{PREFIX}:prior").items()}


def memory(url: str, **kw) -> RedisCorrectionMemory:
    return RedisCorrectionMemory(
        RedisLink(url, "ocm"), prefix=PREFIX, flush_interval_s=0.05, refresh_interval_s=0.1, **kw
    )


def test_a_redis_restart_without_persistence_loses_no_count_and_doubles_none(private_redis):
    a, b = memory(private_redis.url), memory(private_redis.url)
    try:
        a.ensure_prior({(9, 9): 5.0})
        b.ensure_prior({(9, 9): 5.0})
        a.record([(1, 2)] * 3)
        b.record([(1, 2)] * 4 + [(3, 4)] * 2)
        assert wait_for(lambda: stored(private_redis.url) == {"1:2": 7, "3:4": 2})
        private_redis.stop()
        private_redis.start()  # empty: --save "" --appendonly no
        a.record([(1, 2)])  # during and after the restart
        want = {"1:2": 8, "3:4": 2}
        assert wait_for(lambda: stored(private_redis.url) == want, timeout=30)
        assert prior(private_redis.url) == {"9:9": 5}
        assert a.store.rejoins == 1 and b.store.rejoins == 1
        time.sleep(1.0)  # further refreshes and writes add nothing twice
        assert stored(private_redis.url) == want
        assert wait_for(lambda: a.lookup(1, 2) == 8 + 0 and b.lookup(3, 4) == 2)
    finally:
        a.close()
        b.close()


def test_counts_pending_at_shutdown_while_redis_is_down_reach_it_on_the_next_start(private_redis, tmp_path):
    m = memory(private_redis.url, spill_dir=tmp_path)
    m.record([(5, 6)])
    assert wait_for(lambda: stored(private_redis.url) == {"5:6": 1})
    private_redis.stop()
    m.record([(7, 8)] * 5)
    m.close(timeout_s=1.0)  # Redis in backoff for the whole grace period
    assert len(list(tmp_path.glob("ocm-pending-*.json"))) == 1
    private_redis.start()
    later = memory(private_redis.url, spill_dir=tmp_path)
    try:
        assert not list(tmp_path.iterdir())  # claimed
        assert wait_for(lambda: stored(private_redis.url).get("7:8") == 5, timeout=30)
    finally:
        later.close()
    again = memory(private_redis.url, spill_dir=tmp_path)
    again.close()
    assert stored(private_redis.url).get("7:8") == 5  # sent once


def test_serving_through_a_redis_restart_keeps_lossless_outputs_and_every_count(private_redis, tiny_dirs, tiny_engine):
    """An engine whose correction memory is in Redis serves sd (lossless) and csd streams while
    Redis is killed (SIGKILL) and restarts empty: sd equals vanilla greedy throughout, and afterwards the store holds
    exactly the counts the engine wrote (its ledger)."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine, GenerationRequest

    cfg = EngineConfig(
        target=tiny_dirs[0],
        draft=tiny_dirs[1],
        eagle3=None,
        predictor=None,
        ocm_snapshot=None,
        redis_url=private_redis.url,
        max_new_tokens_limit=200,
    )
    engine = Engine(cfg)
    memory = engine.verifier.memory
    prompts = ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    pass\n", "x = [1, 2"]
    ref = {
        p: tiny_engine.generate(GenerationRequest(tiny_engine.encode(p), 40, method="vanilla")).result()["token_ids"]
        for p in prompts
    }
    errors: list[str] = []
    restarted = threading.Event()

    def serve() -> None:
        """Rounds of every prompt until two have run since Redis came back (however fast they go,
        the serving spans the outage)."""
        since = 0
        while since < 2:
            for p in prompts:
                got = engine.generate(GenerationRequest(engine.encode(p), 40, method="sd")).result()["token_ids"]
                if got != ref[p]:
                    errors.append(p)
                engine.generate(GenerationRequest(engine.encode(p), 40, method="csd")).result()
            since += restarted.is_set()

    try:
        worker = threading.Thread(target=serve)
        worker.start()
        time.sleep(1.0)
        private_redis.stop(kill=True)
        time.sleep(0.5)
        private_redis.start()
        restarted.set()
        worker.join(300)
        assert not worker.is_alive() and errors == []
        assert wait_for(lambda: memory._try(memory.flush), timeout=30)
        ledger: dict[str, int] = {}
        for counts in memory.store.ledger.values():
            for (d, t), n in counts.items():
                ledger[f"{d}:{t}"] = ledger.get(f"{d}:{t}", 0) + int(n)
        assert ledger, "csd recorded no divergence pair: the test proves nothing"
        assert memory.store.rejoins >= 1
        assert wait_for(lambda: stored(private_redis.url, memory.store.prefix) == ledger, timeout=30)
    finally:
        engine.close()
