"""Online Correction Memory (OCM) of Calibrated Speculative Decoding (arXiv 2604.13634).

Counts of (draft_token, target_token) pairs seen at the first true rejection of a cycle.

Decay scheme (one rule for every backend): counts = a calibration *prior* (kept until
replaced) + a sliding window of online *buckets* of ``bucket_seconds`` each; only the last
``num_buckets`` buckets count, so online evidence fades out entirely after
``bucket_seconds × num_buckets`` (default 24 h) while fresh evidence enters at once.

This module is pure: the Redis backend (``redis_memory``) shares the same window rule.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

Pair = tuple[int, int]


@dataclass(frozen=True)
class OCMConfig:
    bucket_seconds: float = 3600.0
    num_buckets: int = 24


class CorrectionMemory(Protocol):
    def lookup(self, draft_token: int, target_token: int) -> float: ...

    def record(self, pairs: Iterable[Pair]) -> None: ...

    def snapshot(self) -> dict[Pair, float]: ...

    def restore(self, counts: dict[Pair, float]) -> None: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


def encode_pair(p: Pair) -> str:
    return f"{p[0]}:{p[1]}"


def decode_pair(s: str | bytes) -> Pair:
    a, b = (s.decode() if isinstance(s, bytes) else s).split(":")
    return int(a), int(b)


class LocalCorrectionMemory:
    """In-process OCM (the default; one per process). ``lookup`` is a dict read."""

    def __init__(self, cfg: OCMConfig = OCMConfig(), clock: Callable[[], float] = time.time):
        self.cfg, self.clock = cfg, clock
        self.prior: dict[Pair, float] = {}
        self.buckets: dict[int, Counter] = {}
        self.view: dict[Pair, float] = {}
        self._lock = threading.Lock()

    def bucket_now(self) -> int:
        return int(self.clock() // self.cfg.bucket_seconds)

    def lookup(self, draft_token: int, target_token: int) -> float:
        return self.view.get((draft_token, target_token), 0.0)

    def record(self, pairs: Iterable[Pair]) -> None:
        with self._lock:
            self._expire()
            bucket = self.buckets.setdefault(self.bucket_now(), Counter())
            for p in pairs:
                bucket[p] += 1
                self.view[p] = self.view.get(p, 0.0) + 1

    def _expire(self) -> None:
        oldest = self.bucket_now() - self.cfg.num_buckets + 1
        for b in [b for b in self.buckets if b < oldest]:
            for p, n in self.buckets.pop(b).items():
                left = self.view.get(p, 0.0) - n
                if left > 0:
                    self.view[p] = left
                else:
                    self.view.pop(p, None)

    def snapshot(self) -> dict[Pair, float]:
        with self._lock:
            self._expire()
            return dict(self.view)

    def restore(self, counts: dict[Pair, float]) -> None:
        """Replace the prior (e.g. with a calibration snapshot); online buckets stay."""
        with self._lock:
            self.prior = dict(counts)
            view = Counter(self.prior)
            for bucket in self.buckets.values():
                view.update(bucket)
            self.view = dict(view)

    def __len__(self) -> int:
        return len(self.view)

    def close(self) -> None:
        pass


class SaltedMemories:
    """The correction memories of salted requests (``cache_salt``, a tenant's): one per salt,
    in process, each started from the calibration prior and never shared (Redis, the memory
    service), so one tenant's divergence pairs never change another's accepted tokens. At most
    ``limit`` salts are kept; the least recently used is dropped (its pairs with it)."""

    def __init__(self, prior: dict[Pair, float] | None = None, limit: int = 64):
        self.prior, self.limit = dict(prior or {}), limit
        self._by_salt: OrderedDict[str, LocalCorrectionMemory] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, salt: str) -> LocalCorrectionMemory:
        with self._lock:
            memory = self._by_salt.pop(salt, None)
            if memory is None:
                memory = LocalCorrectionMemory()
                memory.restore(self.prior)
            self._by_salt[salt] = memory
            while len(self._by_salt) > self.limit:
                self._by_salt.popitem(last=False)
            return memory

    def __len__(self) -> int:
        return len(self._by_salt)
