"""Redis-shared OCM against the real Redis: replicas aggregate, outages degrade and resync."""

import subprocess
import sys
import time
import uuid

import redis

from services.common.metrics import REDIS_ERRORS
from services.memory.redis_link import RedisLink
from services.memory.redis_memory import RedisCorrectionMemory
from tests.conftest import wait_for

WORKER = """
import sys
from services.memory.redis_link import RedisLink
from services.memory.redis_memory import RedisCorrectionMemory
url, prefix, base = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = RedisCorrectionMemory(RedisLink(url, "ocm"), prefix=prefix, flush_interval_s=0.05)
for i in range(200):
    m.record([(base, 1), (7, 8)])
m.close()
"""


def cleanup(url, prefix):
    r = redis.Redis.from_url(url)
    keys = r.keys(f"{prefix}:*")
    if keys:
        r.delete(*keys)


def test_two_verifier_processes_aggregate_into_one_memory(redis_url):
    prefix = f"test:ocm:{uuid.uuid4().hex}"
    try:
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, redis_url, prefix, str(b)]) for b in (100, 200)]
        assert [p.wait(60) for p in procs] == [0, 0]
        reader = RedisCorrectionMemory(RedisLink(redis_url, "ocm"), prefix=prefix)
        assert reader.lookup(7, 8) == 400 and reader.lookup(100, 1) == 200 and reader.lookup(200, 1) == 200
        reader.close()
    finally:
        cleanup(redis_url, prefix)


def test_replicas_see_each_others_evidence_and_shared_prior(redis_url):
    prefix = f"test:ocm:{uuid.uuid4().hex}"
    a = RedisCorrectionMemory(RedisLink(redis_url, "ocm"), prefix=prefix, flush_interval_s=0.05, refresh_interval_s=0.1)
    b = RedisCorrectionMemory(RedisLink(redis_url, "ocm"), prefix=prefix, flush_interval_s=0.05, refresh_interval_s=0.1)
    try:
        a.record([(1, 2)] * 3)
        assert a.lookup(1, 2) == 3  # own evidence is visible at once
        assert wait_for(lambda: b.lookup(1, 2) == 3)
        a.ensure_prior({(9, 9): 5.0})
        b.ensure_prior({(9, 9): 1.0})  # a prior already exists: not replaced
        assert wait_for(lambda: b.lookup(9, 9) == 5.0)
    finally:
        a.close()
        b.close()
        cleanup(redis_url, prefix)


def test_redis_restart_keeps_pending_and_flushes_after(private_redis):
    prefix = "test:ocm:outage"
    m = RedisCorrectionMemory(RedisLink(private_redis.url, "ocm"), prefix=prefix, flush_interval_s=0.05)
    before = REDIS_ERRORS.labels("ocm")._value.get()
    private_redis.stop()
    t0 = time.perf_counter()
    m.record([(4, 5)] * 2)
    assert time.perf_counter() - t0 < 0.01 and m.lookup(4, 5) == 2  # hot path unaffected
    assert wait_for(lambda: REDIS_ERRORS.labels("ocm")._value.get() > before)
    private_redis.start()
    m.close(timeout_s=40)  # flush retries until Redis answers
    r = redis.Redis.from_url(private_redis.url)
    assert sum(int(r.hget(k, "4:5") or 0) for k in r.keys(f"{prefix}:b:*")) == 2
