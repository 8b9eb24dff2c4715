"""Who decodes now: admission to session slots (a bounded, prioritised queue), the registry
of active completions, and aborts shared across front-end replicas. Pure: every front end
(gRPC, HTTP, Ray, batch files) maps a refusal to its own code."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Protocol

from services.common.metrics import QUEUE_DEPTH, QUEUE_TIME, REQUESTS_RUNNING
from services.common.refusals import Cancelled, DeadlineExceeded, Overloaded, Refusal
from services.router import openai_api as oa
from services.router.engine import Generation, InvalidRequest


class Waiter(Protocol):
    """What a queued request tells admission about its client."""

    def is_active(self) -> bool: ...

    def time_remaining(self) -> float | None: ...


def check_completions(n: int, max_sessions: int) -> None:
    """A request's completions must fit the server's sessions at once (each is a session)."""
    if n > max_sessions:
        raise InvalidRequest(f"n: at most {max_sessions} completions (this server's sessions)")


class Admission:
    """At most ``max_sessions`` streams decode at once; up to ``max_queue`` more wait for slots,
    served in order of (priority, arrival): lower priority values first, as vLLM's, and
    first come, first served among equals. Only the head of the queue takes slots, so a request
    that needs several (its n completions) is not passed over forever by later single ones.
    Beyond the queue, refuse at once."""

    def __init__(self, max_sessions: int, max_queue: int):
        self.max_sessions, self.max_queue = max_sessions, max_queue
        # requests a front end holds at once (a thread each, parsing, queued or decoding): what
        # could decode, wait, and one more to be told the queue is full
        self._entered = threading.BoundedSemaphore(max_sessions + max_queue + 1)
        self._cond = threading.Condition()
        self.running = 0
        self._queue: list[tuple[int, int]] = []  # heap of (priority, ticket)
        self._tickets = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def acquire(self, context: Waiter, n: int = 1, priority: int = 0) -> Refusal | None:
        """``context``: anything with ``is_active()`` and ``time_remaining()`` (a gRPC call's
        context, an HTTP request's ``_Run``).
        None when ``n`` slots (a request's completions) are taken; else why not: Overloaded
        (queue full), DeadlineExceeded (the deadline passed in the queue) or Cancelled."""
        with self._cond:
            if not self._queue and self.running + n <= self.max_sessions:
                self.running += n
                QUEUE_TIME.observe(0.0)
                return None
            if len(self._queue) >= self.max_queue:
                return self._full()
            me, since = (priority, next(self._tickets)), time.perf_counter()
            heapq.heappush(self._queue, me)
            QUEUE_DEPTH.set(len(self._queue))
            try:
                while self._queue[0] != me or self.running + n > self.max_sessions:
                    left = context.time_remaining()
                    if left is not None and left <= 0.005:
                        return DeadlineExceeded("deadline passed while queued for a session slot")
                    if not context.is_active():
                        return Cancelled("the client went away while queued for a session slot")
                    self._cond.wait(timeout=min(0.5, left) if left is not None else 0.5)
                self.running += n
                QUEUE_TIME.observe(time.perf_counter() - since)
                return None
            finally:
                self._queue.remove(me)
                heapq.heapify(self._queue)
                QUEUE_DEPTH.set(len(self._queue))
                self._cond.notify_all()  # a new head, which free slots may fit

    def enter(self) -> Refusal | None:
        """A request arrives at a front end that gives it a thread: None, or Overloaded when as
        many as could decode or wait are already in (``leave`` when it is done)."""
        return None if self._entered.acquire(blocking=False) else self._full()

    def leave(self) -> None:
        self._entered.release()

    def _full(self) -> Overloaded:
        return Overloaded(
            f"server is at its limit of {self.max_sessions} concurrent sessions and "
            f"{self.max_queue} queued requests; retry later"
        )

    def release(self, n: int = 1) -> None:
        with self._cond:
            self.running -= n
            self._cond.notify_all()


ABORT_WINDOW_S = 60.0  # an abort also ends the requests made before it that start within this time


class ActiveSessions:
    """The completions decoding now, over both front ends; ``specmesh_requests_running`` follows.
    ``abort`` ends them by request id, or all of them; a request still queued for admission
    then is aborted as it starts (an abort holds for requests made before it, ABORT_WINDOW_S).
    ``publish(request_id, wall_time)``, when given, hears of every abort made here, for the
    other front-end replicas (``AbortLog``), whose aborts come back through ``abort(..., at=)``."""

    def __init__(self, publish: Callable[[str | None, float], None] | None = None):
        self._lock = threading.Lock()
        self._gens: dict[str, Generation] = {}
        self._aborts: dict[str | None, float] = {}  # request id (None: all) → when aborted
        self.publish = publish

    def add(self, gens) -> None:
        with self._lock:
            self._gens.update((g.session_id, g) for g in gens)
            REQUESTS_RUNNING.set(len(self._gens))
            now = time.perf_counter()
            for g in gens:
                if any(g.timings.start < t and now - t < ABORT_WINDOW_S for t in self._aborts_of(g)):
                    g.abort()

    def _aborts_of(self, g: Generation) -> list[float]:
        """When the aborts that name ``g`` (by its request id, or all) came."""
        names = (*oa.request_ids(g.req.request_id), None)
        return [self._aborts[n] for n in names if n in self._aborts]

    def abort(self, request_id: str | None, at: float | None = None) -> int:
        """SGLang's /abort_request: end the completions of ``request_id`` (every request when
        None) before their next cycle, each answered with what it has and finish_reason
        "abort". Returns how many were decoding. ``at``: another replica's abort, made at
        this perf_counter time; it ends only the requests made before it, and is not
        published again."""
        now = time.perf_counter()
        when = now if at is None else min(at, now)
        with self._lock:
            self._aborts = {r: t for r, t in self._aborts.items() if now - t < ABORT_WINDOW_S}
            self._aborts[request_id] = max(when, self._aborts.get(request_id, when))
            hit = [
                g
                for g in self._gens.values()
                if g.timings.start < when or at is None
                if request_id is None or request_id in oa.request_ids(g.req.request_id)
            ]
        for g in hit:
            g.abort()
        if at is None and self.publish is not None:
            self.publish(request_id, time.time())
        return len(hit)

    def remove(self, gens) -> None:
        with self._lock:
            for g in gens:
                self._gens.pop(g.session_id, None)
            REQUESTS_RUNNING.set(len(self._gens))

    def __len__(self) -> int:
        return len(self._gens)


class AbortLog:
    """Aborts made at any front-end replica, kept ABORT_WINDOW_S, for each replica to apply
    the others' (``relay``): entries (origin, request id or None for all, wall time), numbered
    from 1 in arrival order."""

    def __init__(self):
        self._entries: list[tuple[int, str, str | None, float]] = []
        self._seq = 0

    def post(self, origin: str, request_id: str | None, wall: float) -> int:
        self._seq += 1
        self._entries = [e for e in self._entries if time.time() - e[3] < ABORT_WINDOW_S]
        self._entries.append((self._seq, origin, request_id, wall))
        return self._seq

    def since(self, seq: int) -> tuple[int, list[tuple[str, str | None, float]]]:
        """The entries after ``seq``, and the newest number."""
        return self._seq, [e[1:] for e in self._entries if e[0] > seq]


def relay(entries: list[tuple[str, str | None, float]], origin: str, active: ActiveSessions) -> int:
    """Apply the aborts other replicas made (not ``origin``'s own) to ``active``, each at the
    local time it was made (wall clocks agree across nodes to well under an abort's window).
    Returns the completions ended."""
    skew = time.perf_counter() - time.time()
    return sum(active.abort(rid, at=wall + skew) for o, rid, wall in entries if o != origin)
