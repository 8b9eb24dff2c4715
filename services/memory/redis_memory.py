"""Redis store of the shared correction memory (see ``write_behind`` for the sync rules).

Keys (``prefix`` = ``specmesh:ocm``): ``{prefix}:prior`` — calibration counts, no TTL;
``{prefix}:b:{bucket}`` — online counts of one time bucket, key-level TTL of the whole
window (Redis 7.0 has no per-field expiry); ``{prefix}:epoch`` — a token naming this store's
life, no TTL. Fields are ``"draft:target"``.

Reset rule: a Redis restarted without persistence (or flushed) has lost every count. Each
replica keeps a ledger of the counts it wrote itself in the buckets still in the window; a write
lands only while the epoch is the one the replica joined (a Lua script checks both at once), so
a replica finds the reset at its next write or read, and rejoins: one script creates a new epoch
unless another replica already did, installs the calibration prior unless it is there, and adds
back the replica's own ledger. Every count was written by exactly one replica, so once each
live replica has rejoined the store holds every count again, none twice. (Counts of replicas
that have left are gone with Redis's memory; run Redis with persistence to keep them.)
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter
from pathlib import Path

from services.memory.correction_memory import OCMConfig, Pair, decode_pair, encode_pair
from services.memory.redis_link import BadEntries, RedisLink, RedisUnavailable
from services.memory.write_behind import StoreUnavailable, WriteBehindMemory

log = logging.getLogger("specmesh.ocm")

# KEYS: epoch, bucket. ARGV: the epoch joined, ttl, then field, count pairs. 1 = written, 0 = reset.
_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""

# KEYS: epoch, prior, bucket... ARGV: a new epoch token, then per hash of KEYS[2..]: its expiry
# (unix seconds, 0 = none), its field count, then field, count pairs. The prior is set only when
# absent; buckets are added to. Returns the epoch now in force.
_JOIN = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  redis.call('SET', KEYS[1], ARGV[1])
  epoch = ARGV[1]
end
local i = 2
for k = 2, #KEYS do
  local expire_at, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  local prior_present = k == 2 and redis.call('EXISTS', KEYS[k]) == 1
  for j = 1, n do
    if k > 2 then
      redis.call('HINCRBY', KEYS[k], ARGV[i], ARGV[i + 1])
    elseif not prior_present then
      redis.call('HSET', KEYS[k], ARGV[i], ARGV[i + 1])
    end
    i = i + 2
  end
  if n > 0 and expire_at > 0 then redis.call('EXPIREAT', KEYS[k], expire_at) end
end
return epoch
"""


def read_count(field: bytes, n: bytes) -> tuple[Pair, float]:
    """A hash field and its count, validated (``"draft:target"`` of token ids, a finite count
    of at least 0); ValueError naming what is wrong."""
    try:
        pair = decode_pair(field)
        count = float(n)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"field {field[:40]!r}: not a 'draft:target' pair of token ids with a count") from e
    if min(pair) < 0 or not math.isfinite(count) or count < 0:
        raise ValueError(f"field {field[:40]!r}: negative token ids or a count that is not a finite number >= 0")
    return pair, count


def _fields(counts: Counter | dict[Pair, float]) -> list:
    return [x for p, n in counts.items() if int(round(n)) for x in (encode_pair(p), int(round(n)))]


class RedisStore:
    def __init__(self, link: RedisLink, cfg: OCMConfig = OCMConfig(), prefix: str = "specmesh:ocm"):
        self.link, self.cfg, self.prefix = link, cfg, prefix
        self.epoch: str | None = None  # the store's life this replica joined
        self.prior: dict[Pair, float] = {}  # installed by whichever replica joins a store without one
        self.ledger: dict[int, Counter] = {}  # bucket -> counts this replica wrote there
        self.rejoins = 0
        self.bad = BadEntries("correction_memory")
        self._write_script = link.client.register_script(_WRITE)
        self._join_script = link.client.register_script(_JOIN)

    def _bucket_now(self) -> int:
        return int(time.time() // self.cfg.bucket_seconds)

    def _key(self, bucket: int) -> str:
        return f"{self.prefix}:b:{bucket}"

    def _live_buckets(self) -> range:
        now = self._bucket_now()
        return range(now - self.cfg.num_buckets + 1, now + 1)

    def _call(self, fn):
        try:
            return self.link.call(fn)
        except RedisUnavailable as e:
            raise StoreUnavailable(str(e)) from e

    def join(self) -> None:
        """Join the store's life (a new one when Redis lost it): prior if absent, own ledger back."""
        live = set(self._live_buckets())
        self.ledger = {b: c for b, c in self.ledger.items() if b in live}
        keys = [f"{self.prefix}:epoch", f"{self.prefix}:prior"]
        prior = _fields(self.prior)
        args: list = [uuid.uuid4().hex, 0, len(prior) // 2, *prior]
        for b, counts in sorted(self.ledger.items()):
            fields = _fields(counts)
            keys.append(self._key(b))
            args += [int((b + self.cfg.num_buckets + 1) * self.cfg.bucket_seconds), len(fields) // 2, *fields]
        epoch = self._call(lambda r: self._join_script(keys=keys, args=args, client=r))
        epoch = epoch.decode() if isinstance(epoch, bytes) else epoch
        if self.epoch is not None and epoch != self.epoch:
            self.rejoins += 1
            log.warning(
                "OCM: Redis lost the shared memory (a restart without persistence?); added back this "
                "replica's %d counts",
                int(sum(sum(c.values()) for c in self.ledger.values())),
            )
        self.epoch = epoch

    def write(self, batch: Counter) -> None:
        if self.epoch is None:
            self.join()
        bucket = self._bucket_now()
        keys = [f"{self.prefix}:epoch", self._key(bucket)]
        ttl = int(self.cfg.bucket_seconds * (self.cfg.num_buckets + 1))
        for _ in range(2):  # a reset found here: rejoin, then write into the new life
            args = [self.epoch, ttl, *_fields(batch)]
            if self._call(lambda r, args=args: self._write_script(keys=keys, args=args, client=r)):
                self.ledger.setdefault(bucket, Counter()).update(batch)
                return
            self.join()
        raise StoreUnavailable("OCM: the Redis store was reset twice during one write")

    def read(self) -> Counter:
        keys = [f"{self.prefix}:prior", *map(self._key, self._live_buckets())]

        def read(r):
            pipe = r.pipeline(transaction=True)
            pipe.get(f"{self.prefix}:epoch")
            for k in keys:
                pipe.hgetall(k)
            return pipe.execute()

        epoch, *hashes = self._call(read)
        if self.epoch is None or (epoch.decode() if epoch else None) != self.epoch:
            self.join()
            return self.read()
        counts: Counter = Counter()
        for h in hashes:
            for field, n in h.items():
                try:
                    pair, count = read_count(field, n)
                except ValueError as e:  # another writer's, or a tampered entry: skipped, counted
                    self.bad.skip(str(e))
                    continue
                counts[pair] += count  # type: ignore[assignment]  # Redis floats
        return counts

    def replace_prior(self, counts: dict[Pair, float]) -> None:
        self.prior = dict(counts)
        key = f"{self.prefix}:prior"

        def write(r):
            pipe = r.pipeline(transaction=True)
            pipe.delete(key)
            if counts:
                pipe.hset(key, mapping={encode_pair(p): int(round(n)) for p, n in counts.items()})
            pipe.execute()

        self._call(write)

    def offer_prior(self, counts: dict[Pair, float]) -> None:
        """Install ``counts`` as the shared prior unless the store has one (now, or after a reset)."""
        self.prior = dict(counts)
        self.join()

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
        spill_dir: Path | None = None,
    ):
        self.link = link
        window_s = cfg.bucket_seconds * cfg.num_buckets
        store = RedisStore(link, cfg, prefix)
        super().__init__(store, flush_interval_s, refresh_interval_s, spill_dir=spill_dir, spill_max_age_s=window_s)
