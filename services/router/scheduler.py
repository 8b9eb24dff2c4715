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
as its replica does. Sessions step in lanes, one per replica (``lane``): a lane has at most
its micro-batch count of steps in flight, so each replica gets all its ready sessions in one
step (one message), a session that opens or comes back early waits for its lane's step
instead of going out alone into a step of its own, and a slow replica holds up only its own
lane. A generation is ready again once its outcome is applied; a cycle the backend only
advanced (``AGAIN``: a prompt fed a chunk) goes first into the next step with the same request.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.metrics import ROUTER_MICRO_BATCHES
from services.common.types import CycleRequest, CycleResult, SessionCancelled
from services.router.overlap import OverlapTuner
from services.verifier.backend import Again, Outcome, VerifierBackend

if TYPE_CHECKING:
    from services.router.engine import Generation

log = logging.getLogger("specmesh.scheduler")


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


@dataclass
class _Step:
    """A step's cycles on one lane."""

    lane: Hashable
    left: int = 0  # cycles not yet settled


class Scheduler:
    def __init__(
        self,
        backend: VerifierBackend,
        prepare: Callable[[list[Any]], list[CycleRequest | BaseException]],
        max_batch: int = 0,
        micro_batches: int = 0,
        offload: bool = False,
        lane: Callable[[Any], Hashable] | None = None,
        split_at: int = 0,
    ):
        """``prepare``: the generations' cycle requests for one step (an error: that one's
        failure). ``max_batch``: sessions one step takes (0: every ready one). ``micro_batches`` > 1: the
        sessions of a lane run in that many alternating steps, each at most its share of them,
        and at most that many steps in flight, so the router drafts for one while another is
        verified (0: two for a lane from ``split_at`` sessions running on it, else one; a
        ``split_at`` of 0 in process: as ``OverlapTuner`` measures faster, else one);
        ``lane(session)``: the replica a session's cycles go to (None: one lane);
        ``offload``: the backend answers in the caller's thread (in process): with one
        micro-batch the scheduler runs each step itself, with more on a thread of their own (one
        at a time); either way what is deferred (``defer``) runs on a publisher thread meanwhile.
        Rule: a step's deferred work has run before the next step's outcomes are applied (they
        touch the same generations), and no thread hand-off lies between two in-process steps."""
        self.backend, self.prepare, self.max_batch, self.micro_batches = backend, prepare, max_batch, micro_batches
        self._cond = threading.Condition()
        self._added: list[Generation] = []
        self._outcomes: list[tuple[Generation, Outcome]] = []
        self._lane = lane or (lambda session: None)
        self._split_at = split_at
        self._ready: dict[Hashable, deque[Generation]] = {}  # per lane, oldest waiting first
        self._requests: dict[int, CycleRequest] = {}  # id(gen) -> its cycle in flight or to repeat
        self._in_flight = 0  # cycles sent, not yet settled
        self._step_of: dict[int, _Step] = {}  # id(gen) -> its step
        self._lane_cycles: Counter[Hashable] = Counter()  # per lane: cycles sent, not yet settled
        self._lane_steps: Counter[Hashable] = Counter()  # per lane: steps with a cycle not yet settled
        self._device = ThreadPoolExecutor(1, thread_name_prefix="step") if offload else None
        self._publisher = Publisher() if offload else None
        self.tuner = OverlapTuner() if offload and not micro_batches and not split_at else None
        self._shown = micro_batches or 1  # what specmesh_router_micro_batches says (in process)
        if offload:
            ROUTER_MICRO_BATCHES.set(self._shown)
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
            while not (self._added or self._outcomes or self._room()):
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
        for gen in added:
            self._enqueue(gen)
        for gen, outcome in outcomes:
            self._in_flight -= 1
            step = self._step_of.pop(id(gen))
            step.left -= 1
            self._lane_cycles[step.lane] -= 1
            self._lane_steps[step.lane] -= step.left == 0
            self._settle(gen, outcome)
        if self.tuner is not None and outcomes:
            self._tune(outcomes)
        while self._room():
            self._step(self._take())
            if self._inline():
                break  # one in-process step a turn: the next takes the outcomes settled first
        self._run_later()
        return True

    def _tune(self, outcomes: list[tuple[Generation, Outcome]]) -> None:
        """The in-process lane's micro-batches from now on (``OverlapTuner``), told what settled."""
        assert self.tuner is not None
        tokens = sum(len(o.committed) for _, o in outcomes if isinstance(o, CycleResult))
        before, chosen = self.tuner.chosen, self.tuner.observe(tokens, self._running(None))
        if chosen != self._shown:  # the gauge is set when the shape changes, not every turn
            ROUTER_MICRO_BATCHES.set(chosen)
            self._shown = chosen
        if self.tuner.chosen != before:
            rates = ", ".join(f"{m}: {r:,.0f}" for m, r in sorted(self.tuner.rates.items()))
            log.info("in-process steps in %d micro-batch(es) from now on (tokens/s by micro-batches %s)", chosen, rates)

    def _inline(self) -> bool:
        """Whether the scheduler runs the next step itself (in process, one micro-batch)."""
        return self._device is not None and self._micro(None) <= 1

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

    def _enqueue(self, gen: Generation, first: bool = False) -> None:
        """``gen`` waits for its lane's next step (``first``: at its head)."""
        lane = self._lane(gen.session)
        ready = self._ready.get(lane)
        if ready is None:
            ready = self._ready[lane] = deque()
        (ready.appendleft if first else ready.append)(gen)

    def _running(self, lane: Hashable) -> int:
        return len(self._ready.get(lane, ())) + self._lane_cycles[lane]

    def _micro(self, lane: Hashable) -> int:
        """A lane's micro-batches now (``micro_batches``, or auto's choice for its sessions)."""
        if self.micro_batches:
            return self.micro_batches
        if self.tuner is not None:
            return self.tuner.mode
        return 2 if self._split_at and self._running(lane) >= self._split_at else 1

    def _open(self, lane: Hashable) -> bool:
        """Whether a step may go out on ``lane`` now: sessions wait, and fewer than its
        micro-batches are in flight."""
        return bool(self._ready.get(lane)) and self._lane_steps[lane] < self._micro(lane)

    def _room(self) -> bool:
        """Whether a step may go out on some lane now."""
        return any(self._open(lane) for lane in self._ready)

    def _share(self, lane: Hashable) -> int:
        """The most sessions the lane's next step takes."""
        running = self._running(lane)
        cap = self.max_batch or running
        if (micro := self._micro(lane)) > 1:
            cap = min(cap, -(-running // micro))
        return max(1, cap)

    def _take(self) -> list[tuple[Generation, CycleRequest]]:
        """The next step's generations and their cycle requests, from every lane that may step;
        the cancelled and aborted end here."""
        batch: list[tuple[Generation, CycleRequest]] = []
        fresh: list[Generation] = []  # their cycle to draft
        for lane in [lane for lane in self._ready if self._open(lane)]:
            self._take_lane(self._ready[lane], self._share(lane), batch, fresh)
        for gen, made in zip(fresh, self._prepare(fresh)):
            if isinstance(made, BaseException):
                log.debug("request %r failed", gen.req_id, exc_info=made)
                self._end(gen, made)
            else:
                batch.append((gen, made))
        return batch

    def _take_lane(self, ready: deque, share: int, batch: list, fresh: list) -> None:
        """Up to ``share`` of a lane's ready generations into ``batch`` (a request to repeat) or
        ``fresh`` (a cycle to draft)."""
        taken = 0
        while ready and taken < share:
            gen = ready.popleft()
            if gen.cancelled:
                self._end(gen, SessionCancelled(f"request {gen.req_id} was cancelled"))
            elif gen.aborted:
                self._guarded(gen, gen.end_by_abort)
            elif gen.finish_reason is not None:  # started again once finished: nothing to step
                self._end(gen, None)
            elif (req := self._requests.pop(id(gen), None)) is not None:
                batch.append((gen, req))
                taken += 1
            else:
                fresh.append(gen)
                taken += 1

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
        steps: dict[Hashable, _Step] = {}  # one per lane
        for gen, req in batch:
            lane = self._lane(gen.session)
            step = steps.get(lane) or steps.setdefault(lane, _Step(lane))
            step.left += 1
            self._requests[id(gen)] = req
            self._step_of[id(gen)] = step
        for lane, step in steps.items():
            self._lane_cycles[lane] += step.left
            self._lane_steps[lane] += 1
        self.steps += len(steps)
        self._in_flight += len(batch)

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
        if self._inline():
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
            if self._lane_steps[next(iter(steps))] == 1:  # (in process: one lane)
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
            self._enqueue(gen, first=True)  # its request is kept: the prompt goes on feeding
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
            self._enqueue(gen)
        return value

    def _end(self, gen: Generation, error: BaseException | None) -> None:
        self._requests.pop(id(gen), None)
        try:
            gen.release()
        except Exception:
            log.exception("request %r: closing its session failed", gen.req_id)
        gen.emit(error)  # the consumer sees the end (or the error) only once the session is closed
