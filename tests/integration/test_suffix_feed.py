"""Global suffix cache shared across replicas through the real Redis."""

import time
import uuid

import redis

from services.common.config import SuffixConfig
from services.common.metrics import REDIS_ERRORS
from services.drafter.suffix import GlobalSuffixCache, SuffixDrafter
from services.memory.redis_link import RedisLink
from services.memory.suffix_feed import SuffixFeed
from tests.conftest import wait_for


def replica(url: str, stream: str) -> tuple[SuffixDrafter, SuffixFeed]:
    cache = GlobalSuffixCache(64, 100)
    feed = SuffixFeed(RedisLink(url, "suffix_feed"), cache, stream=stream).start()
    return SuffixDrafter(SuffixConfig(), cache, feed.publish), feed


def test_output_finished_on_one_replica_hits_on_the_other(redis_url):
    stream = f"test:suffix:{uuid.uuid4().hex}"
    (a, fa), (b, fb) = replica(redis_url, stream), replica(redis_url, stream)
    try:
        answer = list(range(3000, 3040))
        b.start("q", [7, 7])
        b.observe("q", answer[:6])
        assert b.propose("q", 16).token_ids == []  # nothing known yet
        a.start("r", [1, 2, 3])
        a.observe("r", answer)
        a.stop("r")
        assert wait_for(lambda: b.global_cache.version > 0)
        b.observe("q", answer[6:8])
        draft = b.propose("q", 16)
        assert draft.token_ids == answer[8:16] and draft.features["tree"] == "global"
        assert len(a.global_cache) == 1  # its own output is not ingested twice
    finally:
        fa.close()
        fb.close()
        redis.Redis.from_url(redis_url).delete(stream)


def test_restarted_replica_warms_from_redis(redis_url):
    stream = f"test:suffix:{uuid.uuid4().hex}"
    a, fa = replica(redis_url, stream)
    for i in range(3):
        a.start(f"r{i}", [1])
        a.observe(f"r{i}", [500 + i, 600 + i, 700 + i])
        a.stop(f"r{i}")
    fa.close()  # flushes
    b, fb = replica(redis_url, stream)
    try:
        assert len(b.global_cache) == 3 and b.global_cache.tree.count([501, 601, 701]) == 1
    finally:
        fb.close()
        redis.Redis.from_url(redis_url).delete(stream)


def test_redis_outage_degrades_then_resyncs(private_redis):
    stream = "test:suffix:outage"
    (a, fa), (b, fb) = replica(private_redis.url, stream), replica(private_redis.url, stream)
    errors_before = REDIS_ERRORS.labels("suffix_feed")._value.get()
    try:
        private_redis.stop()
        t0 = time.perf_counter()
        a.start("r", [1])
        a.observe("r", [11, 12, 13, 14])
        a.stop("r")  # publishing never blocks the request
        assert time.perf_counter() - t0 < 0.05
        assert a.global_cache.tree.count([11, 12, 13]) == 1  # local cache still serves
        assert wait_for(lambda: REDIS_ERRORS.labels("suffix_feed")._value.get() > errors_before)
        assert not fa.link.healthy
        private_redis.start()  # empty server on the same port: the queued output is re-sent
        assert wait_for(lambda: b.global_cache.tree.count([11, 12, 13]) == 1, timeout=40)
        assert fa.link.healthy
    finally:
        fa.close(timeout=1)
        fb.close(timeout=1)
