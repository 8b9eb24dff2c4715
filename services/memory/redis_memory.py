"""Redis store of the shared correction memory (see ``write_behind`` for the sync rules).

Keys (``prefix`` = ``specmesh:ocm``): ``{prefix}:prior`` — calibration counts, no TTL;
``{prefix}:b:{bucket}`` — online counts of one time bucket, key-level TTL of the whole
window (Redis 7.0 has no per-field expiry). Fields are ``"draft:target"``. Writes are one
pipelined HINCRBY per pair + EXPIRE.
"""

from __future__ import annotations

import time
from collections import Counter

from services.memory.correction_memory import OCMConfig, Pair, decode_pair, encode_pair
from services.memory.redis_link import RedisLink, RedisUnavailable
from services.memory.write_behind import StoreUnavailable, WriteBehindMemory


class RedisStore:
    def __init__(self, link: RedisLink, cfg: OCMConfig = OCMConfig(), prefix: str = "specmesh:ocm"):
        self.link, self.cfg, self.prefix = link, cfg, prefix

    def _bucket_keys(self) -> list[str]:
        now = int(time.time() // self.cfg.bucket_seconds)
        return [f"{self.prefix}:b:{b}" for b in range(now - self.cfg.num_buckets + 1, now + 1)]

    def _call(self, fn):
        try:
            return self.link.call(fn)
        except RedisUnavailable as e:
            raise StoreUnavailable(str(e)) from e

    def write(self, batch: Counter) -> None:
        key = self._bucket_keys()[-1]
        ttl = int(self.cfg.bucket_seconds * (self.cfg.num_buckets + 1))

        def write(r):
            pipe = r.pipeline(transaction=False)
            for p, n in batch.items():
                pipe.hincrby(key, encode_pair(p), int(n))
            pipe.expire(key, ttl)
            pipe.execute()

        self._call(write)

    def read(self) -> Counter:
        keys = [f"{self.prefix}:prior", *self._bucket_keys()]

        def read(r):
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            return pipe.execute()

        counts: Counter = Counter()
        for h in self._call(read):
            for field, n in h.items():
                counts[decode_pair(field)] += float(n)
        return counts

    def replace_prior(self, counts: dict[Pair, float]) -> None:
        key = f"{self.prefix}:prior"

        def write(r):
            pipe = r.pipeline(transaction=True)
            pipe.delete(key)
            if counts:
                pipe.hset(key, mapping={encode_pair(p): int(round(n)) for p, n in counts.items()})
            pipe.execute()

        self._call(write)

    def has_prior(self) -> bool:
        return bool(self._call(lambda r: r.exists(f"{self.prefix}:prior")))

    def retry_in(self) -> float:
        return self.link.seconds_to_retry()


class RedisCorrectionMemory(WriteBehindMemory):
    """The OCM every verifier replica shares through Redis."""

    def __init__(
        self,
        link: RedisLink,
        cfg: OCMConfig = OCMConfig(),
        prefix: str = "specmesh:ocm",
        flush_interval_s: float = 0.5,
        refresh_interval_s: float = 2.0,
    ):
        self.link = link
        super().__init__(RedisStore(link, cfg, prefix), flush_interval_s, refresh_interval_s)
