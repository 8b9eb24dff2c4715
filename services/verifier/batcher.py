"""Cycle batcher: all sessions of a replica step together, one thread doing the work.

Rule (leader/follower): a session submitting a cycle joins the pending list; if no step is
running it leads — waits up to ``window_s`` until every open session has submitted (at
most ``max_batch``), then runs the whole step for all of them: drafting (batched per
drafter), one ragged target forward, each session's policy and commit. Followers only
block on their result, so the Python work of a step is done by one thread instead of
contending for the interpreter across request threads. A lone session never waits.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Pending:
    session: Any
    request: Any
    result: Any = None
    error: BaseException | None = None
    done: bool = False


class CycleBatcher:
    def __init__(self, step: Callable[[list[Pending]], None], max_batch: int = 16, window_s: float = 0.002):
        """``step(batch)`` sets ``result`` or ``error`` on every item of the batch."""
        self.step, self.max_batch, self.window_s = step, max_batch, window_s
        self.open_sessions = 0
        self._cond = threading.Condition()
        self._queue: list[Pending] = []
        self._running = False

    def opened(self) -> None:
        with self._cond:
            self.open_sessions += 1

    def closed(self) -> None:
        with self._cond:
            self.open_sessions -= 1
            self._cond.notify_all()

    def submit(self, session, request):
        item = Pending(session, request)
        with self._cond:
            self._queue.append(item)
            self._cond.notify_all()
            while not item.done:
                if self._running:
                    self._cond.wait()
                else:
                    self._lead()
        if item.error is not None:
            raise item.error
        return item.result

    def _lead(self) -> None:
        """Called with the lock held; runs one step without it."""
        self._running = True
        end = time.perf_counter() + self.window_s
        while len(self._queue) < min(self.open_sessions, self.max_batch) and time.perf_counter() < end:
            self._cond.wait(end - time.perf_counter())
        batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
        self._cond.release()
        try:
            self.step(batch)
        except BaseException as e:  # a failure of the step itself reaches every waiter
            for b in batch:
                if b.result is None and b.error is None:
                    b.error = e
        finally:
            self._cond.acquire()
            self._running = False
            for b in batch:
                b.done = True
            self._cond.notify_all()
