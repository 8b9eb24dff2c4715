"""Cycle batcher: all sessions of a replica step together, one thread doing the work.

Rule (leader/follower): a session submitting a cycle joins the pending list; if no step is
running it leads — waits up to ``window_s`` for the sessions it expects (those served by
the previous step and those opened since; at most ``max_batch``), then runs the whole step
for all that have submitted: drafting (batched per drafter), one ragged target forward,
each session's policy and commit. Followers only block on their result, so the Python work
of a step is done by one thread instead of contending for the interpreter across request
threads. A session that misses the window is not waited for again until it is back, so an
idle client costs at most one window; a lone session never waits.

``post_all`` is the non-blocking entry (the multiplexed link and Serve, where one call
carries a router's whole step): each finished item is handed to its callback. Posted cycles
wait for no one (the router's scheduler batched them; the window is for per-session streams
and for a prompt's next chunk): they are led at once by the batcher's own stepper thread, or
by the posting thread itself when it asks to and no step is running.

A step may leave an item unfinished (``again``: its prompt is being prefilled in chunks); the
item goes back to the head of the queue for the next step, and its caller keeps waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Pending:
    session: Any
    request: Any
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    on_done: Callable[["Pending"], None] | None = None
    again: bool = False  # set by a step that advanced the cycle without finishing it (a prefill chunk)
    carried: bool = False  # put back for the next step (again): no longer its sender's whole step
    arrived: float = field(default_factory=time.perf_counter)
    wake: threading.Condition | None = None  # its submitter waits on it (``submit``); posted items have none


class CycleBatcher:
    def __init__(
        self,
        step: Callable[[list[Pending]], None],
        max_batch: int = 16,
        window_s: float = 0.005,
        chunk_delay_s: float = 0.0,
    ):
        """``step(batch)`` sets ``result`` or ``error`` on every item of the batch.
        ``chunk_delay_s``: fault injection (``faults.chunk_delay_s``), a step that feeds a
        prompt's next chunk waits this long first."""
        self.step, self.max_batch, self.window_s = step, max_batch, window_s
        self.chunk_delay_s = chunk_delay_s
        self._lock = threading.RLock()  # a done-callback may call back in (``closed``)
        self._cond = threading.Condition(self._lock)
        self._queue: list[Pending] = []
        self._expected: set[int] = set()  # id() of the sessions served by the last step
        self._fresh: set[int] = set()  # id() of sessions opened since the last step began
        self._running = False
        self._stepper: threading.Thread | None = None

    def opened(self, session) -> None:
        with self._cond:
            self._fresh.add(id(session))

    def closed(self, session) -> None:
        with self._cond:
            self._expected.discard(id(session))
            self._fresh.discard(id(session))
            self._cond.notify_all()

    def _ready(self) -> bool:
        """Whether the next step may start without waiting: the queue is full, every expected
        session has submitted, or a posted cycle is queued (posts are their sender's whole step,
        a router's scheduler having batched them: nothing more of that sender's is coming). A
        prompt's next chunk (carried) waits for the expected sessions as a submitted cycle does,
        so that chunks are fed beside the decoding sessions rather than in steps of their own."""
        if len(self._queue) >= self.max_batch or any(b.on_done is not None and not b.carried for b in self._queue):
            return True
        queued = {id(b.session) for b in self._queue}
        return (self._expected | self._fresh) <= queued

    def submit(self, session, request):
        """Rule: a submitter sleeps on its own item's condition, woken when its item is done or
        when it is to lead the next step; only a leader in its window (or the stepper) waits on
        the shared one. So a step wakes each waiter once, not every waiter per arrival."""
        item = Pending(session, request, wake=threading.Condition(self._lock))
        with self._cond:
            self._queue.append(item)
            self._cond.notify_all()  # the leader in its window, or the stepper
            while not item.done:
                if self._running:
                    item.wake.wait()  # type: ignore[union-attr]
                else:
                    self._lead()
        if item.error is not None:
            raise item.error
        return item.result

    def post_all(self, cycles: list[tuple[Any, Any, Callable[[Pending], None]]], lead: bool = False) -> None:
        """Queue cycles without waiting; each item's ``on_done(item)`` runs once it has a result
        or error. With ``lead``, the calling thread runs the step itself when no step is running
        and every expected session is queued (the window would not wait): a lone session's
        cycle then skips the hand-off to the stepper thread. Otherwise the stepper leads."""
        with self._cond:
            self._queue.extend(Pending(s, r, on_done=cb) for s, r, cb in cycles)
            if lead and not self._running and self._queue and self._ready():
                self._lead()
                if not self._queue:
                    return
            if self._stepper is None:
                self._stepper = threading.Thread(target=self._step_posted, name="cycle-stepper", daemon=True)
                self._stepper.start()
            self._cond.notify_all()

    def _step_posted(self) -> None:
        with self._cond:
            while True:
                while self._running or not self._queue:
                    self._cond.wait()
                self._lead()

    def _hand_off(self) -> None:
        """With the lock held and no step running: wake whoever leads the next step, the
        submitter of the first submitted item queued, else the stepper (posted items only)."""
        if not self._queue:
            return
        first = next((b for b in self._queue if b.wake is not None), None)
        if first is not None:
            first.wake.notify()  # type: ignore[union-attr]
        else:
            self._cond.notify_all()

    def _lead(self) -> None:
        """Called with the lock held; runs one step without it."""
        self._running = True
        end = time.perf_counter() + self.window_s
        while not self._ready() and time.perf_counter() < end:
            self._cond.wait(end - time.perf_counter())
        batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        self._expected = {id(b.session) for b in batch}
        self._fresh = set()  # had their window; those opened from now on are awaited next
        self._cond.release()
        try:
            if self.chunk_delay_s and any(b.carried for b in batch):
                time.sleep(self.chunk_delay_s)
            self.step(batch)
        except BaseException as e:  # a failure of the step itself reaches every waiter
            for b in batch:
                if b.result is None and b.error is None:
                    b.error = e
        finally:
            self._cond.acquire()
            self._running = False
            again: list[Pending] = []
            finished: list[Pending] = []
            for b in batch:  # an unfinished item without an error goes first in the next step
                (again if b.again and b.result is None and b.error is None else finished).append(b)
                b.again = False
            for b in again:
                b.carried = True
            self._queue[:0] = again
            batch = finished
            for b in batch:
                b.done = True
                if b.wake is not None:
                    b.wake.notify()
            self._hand_off()
            for b in batch:
                if b.on_done is not None:
                    try:
                        b.on_done(b)
                    except Exception:  # a callback's failure must not stop the stepper
                        log.exception("cycle callback failed")
