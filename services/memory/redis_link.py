"""A Redis connection that fails fast and recovers with backoff.

Rule: callers never wait long on Redis (short socket timeouts); while Redis is down, calls
raise ``RedisUnavailable`` immediately until the next retry time (redis-py's
``ExponentialBackoff``, 0.5 s doubling to 30 s; calls themselves are never retried in line); the outage is logged once when it starts and once when it ends, counted in
``specmesh_redis_errors_total`` and shown in ``specmesh_redis_up``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff

from services.common.metrics import REDIS_BAD_ENTRIES, REDIS_ERRORS, REDIS_UP
from services.common.security import redacted

log = logging.getLogger("specmesh.redis")
T = TypeVar("T")


class RedisUnavailable(RuntimeError):
    pass


class RedisLink:
    def __init__(self, url: str, component: str, timeout_s: float = 0.5):
        """``rediss://`` URLs use TLS; a private CA comes from SPECMESH_REDIS_CA (a PEM file). The
        password comes from the URL or, better, from SPECMESH_REDIS_PASSWORD (then it needs no URL
        escaping and the URL holds no secret)."""
        self.url = redacted(url)  # what messages show: never the password
        self.component = component
        tls = (
            {"ssl_ca_certs": os.environ["SPECMESH_REDIS_CA"]}
            if url.startswith("rediss://") and os.environ.get("SPECMESH_REDIS_CA")
            else {}
        )
        password = os.environ.get("SPECMESH_REDIS_PASSWORD") or None  # the URL's own wins
        self.client = redis.Redis.from_url(
            url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **tls
        )
        self.healthy = True
        self._backoff = ExponentialBackoff(cap=30.0, base=0.5)
        self._failures = 0  # in a row: the backoff's exponent
        self._retry_at = 0.0
        self._lock = threading.Lock()
        REDIS_UP.labels(component).set(1)

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        if not self.healthy and time.monotonic() < self._retry_at:
            raise RedisUnavailable(f"{self.component}: Redis at {self.url} is down; retrying later")
        try:
            result = fn(self.client)
        except redis.RedisError as e:
            self._failed(e)
            raise RedisUnavailable(f"{self.component}: {e}") from e
        if not self.healthy:
            with self._lock:
                self.healthy, self._failures = True, 0
            REDIS_UP.labels(self.component).set(1)
            log.warning("%s: Redis at %s is back", self.component, self.url)
        return result

    def _failed(self, e: Exception) -> None:
        REDIS_ERRORS.labels(self.component).inc()
        with self._lock:
            if self.healthy:
                log.warning("%s: Redis at %s unavailable (%s); serving from local state", self.component, self.url, e)
            self.healthy = False
            self._retry_at = time.monotonic() + self._backoff.compute(self._failures)
            self._failures += 1
        REDIS_UP.labels(self.component).set(0)

    def seconds_to_retry(self) -> float:
        return max(0.0, self._retry_at - time.monotonic()) if not self.healthy else 0.0


class BadEntries:
    """Entries read back from Redis that fail validation (Redis is shared, so its data is input,
    not trusted state): each is skipped and counted (``specmesh_redis_bad_entries_total``), the
    first is logged, and none stops the reader."""

    def __init__(self, source: str):
        self.source, self._said = source, False

    def skip(self, why: str) -> None:
        REDIS_BAD_ENTRIES.labels(self.source).inc()
        if not self._said:
            self._said = True
            log.warning(
                "Redis %s: skipped an entry that fails validation (%s); later ones are only counted", self.source, why
            )
