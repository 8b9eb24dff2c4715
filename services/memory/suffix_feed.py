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
from services.memory.redis_link import BadEntries, RedisLink, RedisUnavailable

log = logging.getLogger("specmesh.suffix_feed")
Entries = list[tuple[bytes, dict[bytes, bytes]]]  # a Redis stream's (id, fields), as redis-py returns them

STREAM = "specmesh:suffix:outputs"
MAX_ENTRY_TOKENS = 1 << 20  # an output longer than any context: a bad entry


def pack(tokens: list[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def unpack(data: bytes) -> list[int]:
    a = array.array("I")
    a.frombytes(data)
    return a.tolist()


def entry_tokens(fields: dict, vocab: int) -> list[int]:
    """An entry's output tokens, validated (whole 4-byte ids, at most ``MAX_ENTRY_TOKENS``, each
    below ``vocab`` when known); ValueError naming what is wrong."""
    data = fields.get(b"tokens")
    if not isinstance(data, bytes) or len(data) % 4:
        raise ValueError("tokens: not a whole number of 4-byte token ids")
    if len(data) > 4 * MAX_ENTRY_TOKENS:
        raise ValueError(f"tokens: more than {MAX_ENTRY_TOKENS}")
    tokens = unpack(data)
    if vocab and tokens and max(tokens) >= vocab:
        raise ValueError(f"tokens: ids must be < {vocab}")
    return tokens


class SuffixFeed:
    def __init__(
        self,
        link: RedisLink,
        cache: GlobalSuffixCache,
        maxlen: int = 10_000,
        origin: str | None = None,
        stream: str = STREAM,
        vocab: int = 0,
    ):
        """``vocab``: the target's vocabulary size, the bound of a read token id (0: unchecked)."""
        self.link, self.cache, self.maxlen, self.stream, self.vocab = link, cache, maxlen, stream, vocab
        self.bad = BadEntries("suffix_feed")
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
            self._ingest(fields)
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
                    if fields.get(b"origin") != self.origin.encode() and self._ingest(fields):
                        SUFFIX_FEED_INGESTED.inc()

    def _ingest(self, fields: dict) -> bool:
        """Insert an entry's output into the global tree unless it fails validation (skipped, counted)."""
        try:
            tokens = entry_tokens(fields, self.vocab)
        except ValueError as e:
            self.bad.skip(str(e))
            return False
        self.cache.insert(tokens)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued outputs (best effort within ``timeout``), then stop both threads."""
        self._out.put(None)
        writer = self._threads[0] if self._threads else None
        if writer:
            writer.join(timeout)
        self._stop.set()
        for t in self._threads[1:]:
            t.join(timeout)
