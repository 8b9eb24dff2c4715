"""Correction memory shared through a store (Redis directly, or the memory service).

The hot path never waits on the store: ``lookup`` reads a local view; ``record`` updates the
view and a pending batch. A background thread flushes the batch and refreshes the view
(store counts + still-pending counts) every few seconds. Store down: the view keeps serving,
pending counts are kept and re-sent on the store's retry schedule; ``close`` flushes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from services.common.metrics import OCM_PAIRS
from services.memory.correction_memory import Pair

log = logging.getLogger("specmesh.ocm")


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached right now; try again after ``retry_in()``."""


class MemoryStore(Protocol):
    def read(self) -> Counter: ...  # prior + live online counts

    def write(self, batch: Counter) -> None: ...

    def replace_prior(self, counts: dict[Pair, float]) -> None: ...

    def has_prior(self) -> bool: ...

    def retry_in(self) -> float: ...


class WriteBehindMemory:
    def __init__(self, store: MemoryStore, flush_interval_s: float = 0.5, refresh_interval_s: float = 2.0):
        self.store = store
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
    def flush(self) -> None:
        with self._lock:
            batch, self.pending = self.pending, Counter()
        if not batch:
            return
        try:
            self.store.write(batch)
        except StoreUnavailable:
            with self._lock:
                self.pending.update(batch)  # kept for the retry
            raise

    def refresh(self) -> None:
        counts = self.store.read()
        with self._lock:
            counts.update(self.pending)
            self.view = dict(counts)
        OCM_PAIRS.set(len(self.view))

    def _try(self, fn) -> bool:
        try:
            fn()
            return True
        except StoreUnavailable:
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
        self.store.replace_prior(counts)
        self._try(self.refresh)

    def ensure_prior(self, counts: dict[Pair, float]) -> None:
        """Install ``counts`` as the shared prior unless another replica already did."""
        try:
            if not self.store.has_prior():
                self.restore(counts)
        except StoreUnavailable:
            log.warning("OCM: shared store unavailable at start; calibration prior not installed")

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
            time.sleep(min(0.2, max(0.01, self.store.retry_in())))
        if self.pending:
            log.warning("OCM: %d pending pair counts could not be flushed", sum(self.pending.values()))
