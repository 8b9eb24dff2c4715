"""Shared suffix-cache feed: finished outputs of every replica, through one Redis stream.

- ``publish`` queues an output; a writer thread XADDs it (stream capped with MAXLEN ~N),
  so the decode loop never waits on Redis.
- A reader thread XREADs new entries and inserts other replicas' outputs into the local
  global tree; its cursor survives outages, so after Redis comes back it resyncs from
  where it stopped (entries trimmed meanwhile are lost, as in any bounded cache).
- ``start`` first warms the tree with the whole stream (a restarted replica's cache).
- ``close`` flushes queued outputs before returning.
"""

from __future__ import annotations

import array
import logging
import queue
import threading
import time
import uuid
from typing import cast

from services.common.metrics import SUFFIX_FEED_INGESTED, SUFFIX_FEED_PUBLISHED
from services.drafter.suffix import GlobalSuffixCache
from services.memory.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("specmesh.suffix_feed")
Entries = list[tuple[bytes, dict[bytes, bytes]]]  # a Redis stream's (id, fields), as redis-py returns them

STREAM = "specmesh:suffix:outputs"


def pack(tokens: list[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def unpack(data: bytes) -> list[int]:
    a = array.array("I")
    a.frombytes(data)
    return a.tolist()


class SuffixFeed:
    def __init__(
        self,
        link: RedisLink,
        cache: GlobalSuffixCache,
        maxlen: int = 10_000,
        origin: str | None = None,
        stream: str = STREAM,
    ):
        self.link, self.cache, self.maxlen, self.stream = link, cache, maxlen, stream
        self.origin = origin or uuid.uuid4().hex[:12]
        self.last_id = b"0-0"
        self._out: queue.Queue[list[int] | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "SuffixFeed":
        self._warm()
        for target in (self._write_loop, self._read_loop):
            t = threading.Thread(target=target, name=f"suffix-feed-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def publish(self, tokens: list[int]) -> None:
        if tokens:
            self._out.put(list(tokens))

    def _warm(self) -> None:
        try:
            entries = cast(Entries, self.link.call(lambda r: r.xrange(self.stream, "-", "+")))
        except RedisUnavailable as e:
            log.warning("suffix feed: cannot warm from Redis (%s); starting with a local cache", e)
            return
        for entry_id, fields in entries:
            self.cache.insert(unpack(fields[b"tokens"]))
            self.last_id = entry_id
        log.info("suffix feed: warmed global tree with %d outputs", len(entries))

    def _xadd(self, tokens: list[int]) -> None:
        self.link.call(
            lambda r: r.xadd(
                self.stream, {"origin": self.origin, "tokens": pack(tokens)}, maxlen=self.maxlen, approximate=True
            )
        )
        SUFFIX_FEED_PUBLISHED.inc()

    def _write_loop(self) -> None:
        pending: list[int] | None = None
        while True:
            if pending is None:
                pending = self._out.get()
                if pending is None:
                    return
            try:
                self._xadd(pending)
                pending = None
            except RedisUnavailable:
                if self._stop.is_set():
                    return
                time.sleep(max(0.05, self.link.seconds_to_retry()))

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            try:
                resp = self.link.call(lambda r: r.xread({self.stream: self.last_id}, count=256, block=200))
            except RedisUnavailable:
                self._stop.wait(max(0.05, self.link.seconds_to_retry()))
                continue
            for _, entries in cast(list[tuple[bytes, Entries]], resp or []):
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    if fields[b"origin"].decode() != self.origin:
                        self.cache.insert(unpack(fields[b"tokens"]))
                        SUFFIX_FEED_INGESTED.inc()

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued outputs (best effort within ``timeout``), then stop both threads."""
        self._out.put(None)
        writer = self._threads[0] if self._threads else None
        if writer:
            writer.join(timeout)
        self._stop.set()
        for t in self._threads[1:]:
            t.join(timeout)
