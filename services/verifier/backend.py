"""The router's verifier interface, declared once: ``VerifierBackend``. The router's scheduler
(``services/router/scheduler.py``) opens sessions on it and hands it one step at a time: every
ready session's cycle request together. Implemented in process (``VerifierCore``: the step runs
in the caller's thread, one batched target forward), over gRPC (``RemoteVerifier``) and through
Ray Serve (``RayVerifier``).

A step's outcomes come back through ``done(i, outcome)``, one call per cycle ``i`` of the step:
a ``CycleResult``, the exception that failed that cycle alone, or ``AGAIN`` when the step only
advanced the cycle (a prompt fed a chunk) and the same request goes into the next step. An
in-process backend calls ``done`` for every cycle before ``step`` returns; a remote one may call
it later, from its own threads, in any order.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol

from services.common.types import CycleRequest, CycleResult, Session, SessionSpec
from services.verifier.batcher import Pending

log = logging.getLogger(__name__)


class Again:
    """The step advanced the cycle without finishing it: send the same request next step."""

    def __repr__(self) -> str:
        return "AGAIN"


AGAIN = Again()
Outcome = CycleResult | BaseException | Again
Done = Callable[[int, Outcome], None]
Cycles = Sequence[tuple[Session, CycleRequest]]


class VerifierBackend(Protocol):
    # True: ``step`` runs the device in the caller's thread and answers every cycle before it
    # returns (the scheduler gives it a thread of its own and caps its batch at ``max_batch``);
    # False: a remote backend, whose replicas answer later and batch their sessions themselves
    in_process: bool
    # micro_batches 0 (auto): a replica's sessions run in two alternating steps from this many on,
    # so the router's work and the round trip for one overlap the other's step; 0: never
    split_at: int

    @property
    def context_len(self) -> int: ...  # positions a request may fill (prompt + new tokens)

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_draft(self) -> dict[str, int]: ...  # the drafters beside the target, and their longest draft

    def open(self, spec: SessionSpec) -> Session: ...

    # the replica a session's cycles go to: the scheduler sends each replica's sessions in one
    # step (in process: one device, one lane)
    def lane(self, session: Session) -> Hashable: ...

    def step(self, cycles: Cycles, done: Done) -> None: ...

    def close(self) -> None: ...


def run_step(step: Callable[[list[Pending]], None], cycles: Cycles, done: Done) -> None:
    """One batched step in this thread (``step`` as ``VerifierCore._step``: it sets each item's
    result or error, or marks it ``again``), each cycle's outcome reported through ``done``."""
    items = [Pending(session, request) for session, request in cycles]
    try:
        step(items)
    except Exception as e:  # a failure of the step itself is every cycle's
        for it in items:
            if it.result is None and it.error is None:
                it.error = e
    for i, it in enumerate(items):
        if it.error is not None:
            done(i, it.error)
        elif it.result is not None:
            done(i, it.result)
        else:
            done(i, AGAIN if it.again else RuntimeError("the verifier's step left a cycle without a result"))


class CycleEach:
    """A step over sessions that cycle one by one (a remote replica's session: its transport
    batches the cycles that travel together): each cycle on a pooled thread, its outcome
    reported as it comes, so a slow replica holds up only its own sessions."""

    def __init__(self, workers: int = 256):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="verifier-cycle")

    def step(self, cycles: Cycles, done: Done) -> None:
        for i, (session, request) in enumerate(cycles):
            self.run(partial(session.cycle, request), partial(done, i))

    def run(self, fn: Callable[[], CycleResult], done: Callable[[Outcome], None]) -> None:
        """``fn()`` on a pooled thread (a cycle, or a failover and the cycle again), its result
        or the exception that ended it to ``done``."""
        self._pool.submit(self._call, fn, done)

    @staticmethod
    def _call(fn: Callable[[], CycleResult], done: Callable[[Outcome], None]) -> None:
        try:
            outcome: Outcome = fn()
        except BaseException as e:  # the cycle's own failure, reported to its request
            outcome = e
        done(outcome)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Deadlines:
    """Calls due after a delay, on one thread: a posted cycle's \"no answer in time\" (the call
    itself checks whether the answer came meanwhile). Rule: a call runs at most ``slack_s``
    after it is due, together with every other call due by then, so a step's cycles (posted
    together, due microseconds apart) take one wake-up of this thread, not one each. A
    cancelled call (its answer came) is dropped: what it holds is freed at once, and the heap
    keeps only calls still wanted from its head on, so the thread sleeps until the oldest
    unanswered one is due. An idle thread looks again every ``idle_s``, and a call due later
    than it will look wakes nothing: each step's calls (due a replica's budget, seconds, away)
    cost no wake-up of this thread, though each step finds the heap empty again."""

    idle_s = 1.0

    def __init__(self, slack_s: float = 0.005):
        self.slack_s = slack_s
        self._heap: list[list] = []  # [due, id, fn]: fn None once cancelled
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wake_at = -math.inf  # when the sleeping thread looks next (-inf: it is awake)

    def add(self, delay_s: float, fn: Callable[[], None]) -> list:
        """Run ``fn`` in ``delay_s``; returns its handle for ``cancel``."""
        return self.add_all([(delay_s, fn)])[0]

    def add_all(self, calls: list[tuple[float, Callable[[], None]]]) -> list[list]:
        """``add`` for each ``(delay_s, fn)`` under one lock (a step's cycles); their handles."""
        now = time.monotonic()
        entries = [[now + delay_s, next(self._ids), fn] for delay_s, fn in calls]
        with self._cond:
            head = self._heap[0] if self._heap else None
            for entry in entries:
                heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="verifier-deadlines", daemon=True)
                self._thread.start()
            elif self._heap and self._heap[0] is not head and self._heap[0][0] + self.slack_s < self._wake_at:
                self._cond.notify()
        return entries

    def cancel(self, entry: list) -> None:
        """``entry``'s call will not run (a no-op once it has run or been cancelled)."""
        self.cancel_all([entry])

    def cancel_all(self, entries: list[list]) -> None:
        """``cancel`` for each of ``entries`` under one lock."""
        with self._cond:
            for entry in entries:
                entry[2] = None
            self._drop_cancelled()

    def _drop_cancelled(self) -> None:
        """Pop the cancelled calls at the heap's head (the lock held)."""
        while self._heap and self._heap[0][2] is None:
            heapq.heappop(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._drop_cancelled()
                while not self._closed and (not self._heap or self._heap[0][0] + self.slack_s > time.monotonic()):
                    now = time.monotonic()
                    self._wake_at = self._heap[0][0] + self.slack_s if self._heap else now + self.idle_s
                    self._cond.wait(self._wake_at - now)
                self._wake_at = -math.inf
                if self._closed:
                    return
                now, due = time.monotonic(), []
                while self._heap and self._heap[0][0] <= now:
                    fn = heapq.heappop(self._heap)[2]
                    if fn is not None:
                        due.append(fn)
                self._drop_cancelled()
            for fn in due:
                try:
                    fn()
                except Exception:
                    log.exception("a deadline's call failed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
