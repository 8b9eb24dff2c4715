"""Correction memory shared through a store (Redis directly, or the memory service).

The hot path never waits on the store: ``lookup`` reads a local view; ``record`` updates the
view and a pending batch. A background thread flushes the batch and refreshes the view
(store counts + still-pending counts) every few seconds. Store down: the view keeps serving,
pending counts are kept and re-sent on the store's retry schedule. ``close`` flushes, retrying
for a bounded grace period; what the store still does not take is written to a spill file in
``spill_dir``, and the next memory opened over that directory claims every spill file there
(younger than ``spill_max_age_s``) into its pending counts: no count is lost at shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
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

    def offer_prior(self, counts: dict[Pair, float]) -> None: ...  # the prior, unless one is installed

    def retry_in(self) -> float: ...


class WriteBehindMemory:
    def __init__(
        self,
        store: MemoryStore,
        flush_interval_s: float = 0.5,
        refresh_interval_s: float = 2.0,
        spill_dir: Path | None = None,
        spill_max_age_s: float = 86400.0,
    ):
        self.store = store
        self.flush_interval_s, self.refresh_interval_s = flush_interval_s, refresh_interval_s
        self.view: dict[Pair, float] = {}
        self.pending: Counter = Counter()
        self.spill_dir = spill_dir
        if spill_dir is not None:
            self.pending.update(claim_spills(spill_dir, spill_max_age_s))
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time: a flush returns with every earlier count sent
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
        """Send the pending counts. On return, every count recorded before the call is in the store,
        including a batch another thread's flush had in flight."""
        with self._flushing:
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
            self.store.offer_prior(counts)
            self._try(self.refresh)
        except StoreUnavailable:
            log.warning("OCM: shared store unavailable at start; the calibration prior goes in when it answers")

    def __len__(self) -> int:
        return len(self.view)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop syncing and flush pending counts, retrying until ``timeout_s``; then spill what
        is left to a file in ``spill_dir`` (the next start there sends it)."""
        self._stop.set()
        self._thread.join(timeout_s)
        end = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < end:
            if self._try(self.flush):
                break
            time.sleep(min(0.2, max(0.01, self.store.retry_in())))
        if not self.pending:
            return
        n = int(sum(self.pending.values()))
        if self.spill_dir is None:
            log.warning("OCM: %d pending pair counts could not be flushed (no spill directory)", n)
            return
        path = spill(self.spill_dir, self.pending)
        log.warning(
            "OCM: the shared store did not answer; %d pending pair counts kept in %s for the next start", n, path
        )


# -- spill files: pending counts a closed memory could not write, for the next start -------------------
SPILL_FORMAT = "specmesh-ocm-pending/1"


def spill(directory: Path, counts: Counter) -> Path:
    """Write ``counts`` to a new spill file in ``directory`` (atomically: a temporary file renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ocm-pending-{os.getpid()}-{time.time_ns()}.json"
    tmp = path.with_suffix(".tmp")
    body = {"format": SPILL_FORMAT, "written_at": time.time(), "pairs": [[d, t, n] for (d, t), n in counts.items()]}
    tmp.write_text(json.dumps(body))
    tmp.rename(path)
    return path


def claim_spills(directory: Path, max_age_s: float) -> Counter:
    """The counts of every spill file in ``directory``, each claimed by renaming it first (two
    processes starting together never both take one) and then deleted; files older than
    ``max_age_s`` (their counts would have expired from the store) are dropped."""
    counts: Counter = Counter()
    for path in sorted(directory.glob("ocm-pending-*.json")):
        claimed = path.with_suffix(f".claimed-{os.getpid()}")
        try:
            path.rename(claimed)
        except OSError:  # another process claimed it
            continue
        try:
            body = json.loads(claimed.read_text())
            if body.get("format") != SPILL_FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
            if time.time() - float(body["written_at"]) <= max_age_s:
                counts.update({(int(d), int(t)): n for d, t, n in body["pairs"]})
            claimed.unlink()
        except (ValueError, KeyError, TypeError) as e:
            log.warning("OCM: spill file %s is not readable (%s); left as %s", path, e, claimed)
    if counts:
        log.warning(
            "OCM: %d pair counts from a previous shutdown's spill files will be sent", int(sum(counts.values()))
        )
    return counts
