"""Redis-backed OCM shared by every verifier replica.

Keys (``prefix`` = ``specmesh:ocm``): ``{prefix}:prior`` — calibration counts, no TTL;
``{prefix}:b:{bucket}`` — online counts of one time bucket, key-level TTL of the whole
window (Redis 7.0 has no per-field expiry). Fields are ``"draft:target"``.

Hot path: ``lookup`` reads the local view only; ``record`` updates the local view and a
pending batch. A background thread flushes the batch (one pipelined HINCRBY per pair +
EXPIRE) and refreshes the view (prior + live buckets + still-pending counts). Redis down:
the view keeps serving, pending counts are kept and re-sent with backoff, errors counted;
``close`` flushes what is pending.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Iterable

from services.common.metrics import OCM_PAIRS
from services.memory.correction_memory import OCMConfig, Pair, decode_pair, encode_pair
from services.memory.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("specmesh.ocm")


class RedisCorrectionMemory:
    def __init__(self, link: RedisLink, cfg: OCMConfig = OCMConfig(), prefix: str = "specmesh:ocm",
                 flush_interval_s: float = 0.5, refresh_interval_s: float = 2.0):
        self.link, self.cfg, self.prefix = link, cfg, prefix
        self.flush_interval_s, self.refresh_interval_s = flush_interval_s, refresh_interval_s
        self.view: dict[Pair, float] = {}
        self.pending: Counter = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._try(self.refresh)
        self._thread = threading.Thread(target=self._loop, name="ocm-sync", daemon=True)
        self._thread.start()

    # -- hot path --------------------------------------------------------------------------
    def lookup(self, draft_token: int, target_token: int) -> float:
        return self.view.get((draft_token, target_token), 0.0)

    def record(self, pairs: Iterable[Pair]) -> None:
        with self._lock:
            for p in pairs:
                self.pending[p] += 1
                self.view[p] = self.view.get(p, 0.0) + 1

    # -- background sync -------------------------------------------------------------------
    def _bucket_keys(self) -> list[str]:
        now = int(time.time() // self.cfg.bucket_seconds)
        return [f"{self.prefix}:b:{b}" for b in range(now - self.cfg.num_buckets + 1, now + 1)]

    def flush(self) -> None:
        with self._lock:
            batch, self.pending = self.pending, Counter()
        if not batch:
            return
        key = self._bucket_keys()[-1]
        ttl = int(self.cfg.bucket_seconds * (self.cfg.num_buckets + 1))

        def write(r):
            pipe = r.pipeline(transaction=False)
            for p, n in batch.items():
                pipe.hincrby(key, encode_pair(p), n)
            pipe.expire(key, ttl)
            pipe.execute()

        try:
            self.link.call(write)
        except RedisUnavailable:
            with self._lock:
                self.pending.update(batch)  # keep for the retry
            raise

    def refresh(self) -> None:
        keys = [f"{self.prefix}:prior", *self._bucket_keys()]

        def read(r):
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            return pipe.execute()

        counts: Counter = Counter()
        for h in self.link.call(read):
            for field, n in h.items():
                counts[decode_pair(field)] += float(n)
        with self._lock:
            counts.update(self.pending)
            self.view = dict(counts)
        OCM_PAIRS.set(len(self.view))

    def _try(self, fn) -> bool:
        try:
            fn()
            return True
        except RedisUnavailable:
            return False

    def _loop(self) -> None:
        last_refresh = time.monotonic()
        while not self._stop.wait(self.flush_interval_s):
            if not self._try(self.flush):
                continue
            if time.monotonic() - last_refresh >= self.refresh_interval_s and self._try(self.refresh):
                last_refresh = time.monotonic()

    # -- snapshot / lifecycle ----------------------------------------------------------------
    def snapshot(self) -> dict[Pair, float]:
        return dict(self.view)

    def restore(self, counts: dict[Pair, float]) -> None:
        """Replace the shared calibration prior for every replica."""
        key = f"{self.prefix}:prior"

        def write(r):
            pipe = r.pipeline(transaction=True)
            pipe.delete(key)
            if counts:
                pipe.hset(key, mapping={encode_pair(p): int(round(n)) for p, n in counts.items()})
            pipe.execute()

        self.link.call(write)
        self._try(self.refresh)

    def ensure_prior(self, counts: dict[Pair, float]) -> None:
        """Install ``counts`` as the shared prior unless another replica already did."""
        try:
            if not self.link.call(lambda r: r.exists(f"{self.prefix}:prior")):
                self.restore(counts)
        except RedisUnavailable:
            log.warning("OCM: Redis unavailable at start; calibration prior not installed")

    def __len__(self) -> int:
        return len(self.view)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop syncing and flush pending counts (retrying until ``timeout_s``)."""
        self._stop.set()
        self._thread.join(timeout_s)
        end = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < end:
            if self._try(self.flush):
                break
            time.sleep(min(0.2, max(0.01, self.link.seconds_to_retry())))
        if self.pending:
            log.warning("OCM: %d pending pair counts could not be flushed to Redis", sum(self.pending.values()))
