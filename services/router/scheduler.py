"""The router's scheduler: one thread owns every running generation of the engine and runs them
in steps, so no request needs a thread of its own to decode.

Per step: take the ready generations (at most ``max_batch``, oldest-waiting first), drop the
cancelled and aborted ones, draft for the rest in one call (``prepare``, the engine's
``prepare_step``: each router drafter asked once for all its sessions, the hybrid's decisions
made together), hand every cycle request to the verifier backend at once
(``VerifierBackend.step``), and as outcomes come back apply them (``Generation.apply``: the
router drafters observe, detokenize, stop checks) and emit each generation's output to its
own queue, where its consumer (a gRPC stream, an HTTP response, ``result()``) reads it.

An in-process backend answers every cycle before ``step`` returns; a remote one answers each
as its replica does, so a slow replica holds up only its own sessions. A generation is ready
again once its outcome is applied; a cycle the backend only advanced (``AGAIN``: a prompt fed
a chunk) goes first into the next step with the same request.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from services.common.types import CycleRequest, CycleResult, SessionCancelled
from services.verifier.backend import Again, Outcome, VerifierBackend

if TYPE_CHECKING:
    from services.router.engine import Generation

log = logging.getLogger("specmesh.scheduler")

# micro_batches 0 (auto): a remote backend's sessions alternate in two micro-batches from this many
# running, one below it; in process always one (bench/results/control_plane_batched_after.md)
SPLIT_AT = 128


class Publisher:
    """Deferred work (outputs to their queues, metrics), run in order on a thread of its own
    while the step it waited for runs; ``drain`` waits until all handed over has run."""

    def __init__(self):
        self._cond = threading.Condition()
        self._batches: deque[list[Callable[[], None]]] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None

    def hand(self, fns: list[Callable[[], None]]) -> None:
        if not fns:
            return
        with self._cond:
            self._batches.append(fns)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self) -> None:
        with self._cond:
            while self._batches or self._busy:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            self._next()

    def _next(self) -> None:
        """Run the next batch handed over. (A method of its own so that nothing of a finished
        generation outlives the batch in a local: its caches go back to the K/V pool when
        collected.)"""
        with self._cond:
            while not self._batches:
                self._cond.wait()
            fns, self._busy = self._batches.popleft(), True
        run_all(fns)
        with self._cond:
            self._busy = False
            self._cond.notify_all()


def run_all(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        try:
            fn()
        except Exception:
            log.exception("deferred work failed")


class Scheduler:
    def __init__(
        self,
        backend: VerifierBackend,
        prepare: Callable[[list[Any]], list[CycleRequest | BaseException]],
        max_batch: int = 0,
        micro_batches: int = 0,
        offload: bool = False,
    ):
        """``prepare``: the generations' cycle requests for one step (an error: that one's
        failure). ``max_batch``: sessions one step takes (0: every ready one). ``micro_batches`` > 1: the
        sessions run in that many alternating steps, each at most its share of them, and at most
        that many steps in flight, so the router drafts for one while another is verified (0:
        two for a remote backend from ``SPLIT_AT`` sessions on, else one);
        ``offload``: the backend answers in the caller's thread (in process): with one
        micro-batch the scheduler runs each step itself, with more on a thread of their own (one
        at a time); either way what is deferred (``defer``) runs on a publisher thread meanwhile.
        Rule: a step's deferred work has run before the next step's outcomes are applied (they
        touch the same generations), and no thread hand-off lies between two in-process steps."""
        self.backend, self.prepare, self.max_batch, self.micro_batches = backend, prepare, max_batch, micro_batches
        self._cond = threading.Condition()
        self._added: list[Generation] = []
        self._outcomes: list[tuple[Generation, Outcome]] = []
        self._ready: deque[Generation] = deque()
        self._requests: dict[int, CycleRequest] = {}  # id(gen) -> its cycle in flight or to repeat
        self._in_flight = 0  # cycles sent, not yet settled
        self._step_of: dict[int, list[int]] = {}  # id(gen) -> its step's count of cycles not yet settled
        self._steps_in_flight = 0
        self._device = ThreadPoolExecutor(1, thread_name_prefix="step") if offload else None
        self._publisher = Publisher() if offload else None
        self._later: list[Callable[[], None]] = []  # what waits for the next step to be sent
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0

    def add(self, gen: Generation) -> None:
        """Run ``gen`` (its session open) from the next step on; any thread."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._added.append(gen)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop once every generation has ended (waiting at most ``timeout_s``)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                if not self._turn():
                    return
            except Exception:  # a bug of ours: said loudly, and the sessions' next turns go on
                log.exception("scheduler turn failed")

    def _turn(self) -> bool:
        """Settle the outcomes that came in, then run the next step; False once closed and idle.
        (A method of its own so that nothing of a finished generation outlives it in a local:
        its caches go back to the K/V pool when collected.)"""
        with self._cond:
            while not (self._added or self._outcomes or (self._ready and self._room())):
                if self._closed and not self._in_flight:
                    if self._device is not None:
                        self._device.shutdown(wait=False)
                    if self._publisher is not None:
                        self._publisher.drain()
                    return False
                self._cond.wait()
            added, self._added = self._added, []
            outcomes, self._outcomes = self._outcomes, []
        if self._publisher is not None:
            self._publisher.drain()  # the last step's outputs are out before its sessions move on
        self._ready.extend(added)
        for gen, outcome in outcomes:
            self._in_flight -= 1
            left = self._step_of.pop(id(gen))
            left[0] -= 1
            self._steps_in_flight -= left[0] == 0
            self._settle(gen, outcome)
        while self._ready and self._room():
            self._step(self._take())
            if self._micro() == 1:  # one step a turn: the next takes the outcomes settled first
                break
        self._run_later()
        return True

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (in order) once the next step is sent: work no step waits for (outputs to
        their queues, metrics) overlaps the step, on the publisher thread in process, else on the
        scheduler's thread; the scheduler's thread only (it is not locked)."""
        self._later.append(fn)

    def _run_later(self) -> None:
        later, self._later = self._later, []
        if self._publisher is not None:
            self._publisher.hand(later)
        else:
            run_all(later)

    def _micro(self) -> int:
        """Micro-batches now (``micro_batches``, or auto's choice for the sessions running)."""
        if self.micro_batches:
            return self.micro_batches
        return 2 if self._device is None and len(self._ready) + self._in_flight >= SPLIT_AT else 1

    def _room(self) -> bool:
        """Whether another step may go out now: at most ``micro_batches`` in flight (a remote
        backend's one micro-batch: any number, each session's cycle its own business)."""
        micro = self._micro()
        if micro == 1 and self._device is None:
            return True
        return self._steps_in_flight < micro

    def _share(self) -> int:
        """The most sessions the next step takes."""
        cap = self.max_batch or len(self._ready) + self._in_flight
        if (micro := self._micro()) > 1:
            cap = min(cap, -(-(len(self._ready) + self._in_flight) // micro))
        return max(1, cap)

    def _take(self) -> list[tuple[Generation, CycleRequest]]:
        """The next step's generations and their cycle requests; the cancelled and aborted end here."""
        batch: list[tuple[Generation, CycleRequest]] = []
        fresh: list[Generation] = []  # their cycle to draft
        share = self._share()
        while self._ready and len(batch) + len(fresh) < share:
            gen = self._ready.popleft()
            if gen.cancelled:
                self._end(gen, SessionCancelled(f"request {gen.req_id} was cancelled"))
            elif gen.aborted:
                self._guarded(gen, gen.end_by_abort)
            elif gen.finish_reason is not None:  # started again once finished: nothing to step
                self._end(gen, None)
            elif (req := self._requests.pop(id(gen), None)) is not None:
                batch.append((gen, req))
            else:
                fresh.append(gen)
        for gen, made in zip(fresh, self._prepare(fresh)):
            if isinstance(made, BaseException):
                log.debug("request %r failed", gen.req_id, exc_info=made)
                self._end(gen, made)
            else:
                batch.append((gen, made))
        return batch

    def _prepare(self, gens: list[Generation]) -> list[CycleRequest | BaseException]:
        if not gens:
            return []
        try:
            return self.prepare(gens)
        except Exception as e:  # a bug of ours: the step's cycles fail, not the scheduler
            log.exception("drafting a step failed")
            return [e] * len(gens)

    def _step(self, batch: list[tuple[Generation, CycleRequest]]) -> None:
        if not batch:
            return
        self.steps += 1
        self._in_flight += len(batch)
        self._steps_in_flight += 1
        left = [len(batch)]
        for gen, req in batch:
            self._requests[id(gen)] = req
            self._step_of[id(gen)] = left

        answered: list[tuple[Generation, Outcome]] = []

        def done(i: int, outcome: Outcome) -> None:
            with self._cond:
                answered.append((batch[i][0], outcome))
                # an in-process step's outcomes are settled together (they come together, and one
                # settled alone would step alone); a remote one's as they come
                if self._device is None or len(answered) == len(batch):
                    self._outcomes.extend(answered)
                    answered.clear()
                    self._cond.notify()

        cycles = [(gen.session, req) for gen, req in batch]
        if self._device is not None and self._micro() == 1:
            # in process, one micro-batch: the outputs of the last step go to the publisher and
            # the step runs here (the device holds it, the GIL is free): nothing to hand over
            self._run_later()
            self._send(cycles, done)
        elif self._device is not None:
            # the step thread starts the step before anything deferred runs here, so it holds the
            # GIL until the device has the step (else it waits out this thread's turn: a switch
            # interval); behind another step in flight, it starts when that one ends
            started = threading.Event()
            self._device.submit(self._send, cycles, done, started)
            if self._steps_in_flight == 1:
                started.wait()
        else:
            self._send(cycles, done)

    def _send(self, cycles, done, started: threading.Event | None = None) -> None:
        if started is not None:
            started.set()
        try:
            self.backend.step(cycles, done)
        except Exception as e:  # the backend could not take the step: every cycle's failure
            for i in range(len(cycles)):
                done(i, e)

    def _settle(self, gen: Generation, outcome: Outcome) -> None:
        if isinstance(outcome, Again) and not gen.cancelled:
            self._ready.appendleft(gen)  # its request is kept: the prompt goes on feeding
            return
        self._requests.pop(id(gen), None)
        if gen.cancelled:
            self._end(gen, SessionCancelled(f"request {gen.req_id} was cancelled"))
        elif isinstance(outcome, BaseException):
            self._end(gen, outcome)
        elif isinstance(outcome, CycleResult):
            self._guarded(gen, gen.apply, outcome)

    def _guarded(self, gen: Generation, fn, *args, then_ready: bool = True):
        """``fn(*args)``, a step of ``gen``'s (it emits what it makes); ``gen`` ends once
        finished, else (``then_ready``) waits for the next step. A failure is ``gen``'s alone."""
        try:
            value = fn(*args)
        except Exception as e:
            log.debug("request %r failed", gen.req_id, exc_info=True)
            self._end(gen, e)
            return None
        if gen.finish_reason is not None:
            self._end(gen, None)
            return None
        if then_ready:
            self._ready.append(gen)
        return value

    def _end(self, gen: Generation, error: BaseException | None) -> None:
        self._requests.pop(id(gen), None)
        try:
            gen.release()
        except Exception:
            log.exception("request %r: closing its session failed", gen.req_id)
        gen.emit(error)  # the consumer sees the end (or the error) only once the session is closed
