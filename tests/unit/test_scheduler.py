"""The router's scheduler over a backend stand-in: steps of at most max_batch sessions taken
oldest-waiting first, AGAIN repeats a cycle's request first in the next step, a failure is its
session's alone, cancelled and aborted generations end with their sessions closed, and a remote
backend's sessions step per replica (lane), one step in flight each, a slow replica holding up
only its own."""

import queue
import threading

import pytest

from services.common.types import CycleRequest, CycleResult, SessionCancelled
from services.router.scheduler import Scheduler
from services.verifier.backend import AGAIN, CycleEach, run_step


class Gen:
    """What the scheduler asks of a generation: ``cycles`` cycles of one token each."""

    def __init__(self, name: str, cycles: int = 3):
        self.req_id, self.left = name, cycles
        self.session = name
        self.cancelled = self.aborted = False
        self.finish_reason: str | None = None
        self.prepared = self.applied = 0
        self.released = threading.Event()
        self.out: queue.SimpleQueue = queue.SimpleQueue()

    def prepare(self) -> CycleRequest:
        self.prepared += 1
        return CycleRequest(draft_ids=(self.prepared,))

    def apply(self, res: CycleResult) -> None:
        self.applied += 1
        self.left -= 1
        self.out.put(res.committed)
        if self.left == 0:
            self.finish_reason = "length"

    def end_by_abort(self) -> None:
        self.finish_reason = "abort"

    def release(self) -> None:
        self.released.set()

    def emit(self, item) -> None:
        self.out.put(item)

    def items(self) -> list:
        got = []
        while (item := self.out.get(timeout=10)) is not None and not isinstance(item, BaseException):
            got.append(item)
        return got + ([item] if item is not None else [])


class Backend:
    """In process: ``answer(session, request)`` is each cycle's outcome."""

    def __init__(self, answer):
        self.answer, self.steps = answer, []

    def step(self, cycles, done) -> None:
        self.steps.append([s for s, _ in cycles])
        for i, (s, r) in enumerate(cycles):
            done(i, self.answer(s, r))


def each(gens: list[Gen]) -> list:
    """The step's requests, each generation drafting its own."""
    return [g.prepare() for g in gens]


def ok(session, request) -> CycleResult:
    return CycleResult(committed=[request.draft_ids[0]], drafted=0, accepted=0, source="none")


def run(scheduler: Scheduler, gens: list[Gen]) -> None:
    for g in gens:
        scheduler.add(g)
    for g in gens:
        assert g.released.wait(10), g.req_id


def test_steps_take_at_most_max_batch_sessions_oldest_waiting_first():
    backend = Backend(ok)
    gens = [Gen(n, cycles=2) for n in "abcde"]
    sched = Scheduler(backend, each, max_batch=2)
    with sched._cond:  # added in one turn (the scheduler's thread waits for the lock)
        for g in gens:
            sched.add(g)
    run(sched, [])
    for g in gens:
        assert g.released.wait(10)
    assert backend.steps == [["a", "b"], ["c", "d"], ["e", "a"], ["b", "c"], ["d", "e"]]
    assert all(g.items() == [[1], [2]] for g in gens)  # each cycle's request was drafted for it
    sched.close()


def test_again_repeats_the_same_request_first_and_failures_stay_per_session():
    calls: dict[str, int] = {}

    def answer(session, request):
        calls[session] = calls.get(session, 0) + 1
        if session == "chunked" and calls[session] < 3:
            return AGAIN
        if session == "broken":
            return ValueError("replica said no")
        return ok(session, request)

    backend = Backend(answer)
    chunked, broken, fine = Gen("chunked", 1), Gen("broken"), Gen("fine", 2)
    sched = Scheduler(backend, each)
    run(sched, [chunked, broken, fine])
    assert chunked.prepared == 1 and calls["chunked"] == 3  # drafted once, stepped until done
    assert chunked.items() == [[1]]
    (err,) = broken.items()
    assert isinstance(err, ValueError)
    assert fine.items() == [[1], [2]]
    sched.close()


def test_a_step_s_generations_draft_in_one_call_and_a_failed_draft_is_its_own():
    """``prepare`` is called once per step with every generation that drafts in it; an error
    in its answer ends that generation alone, and a prepare that raises fails only its step's."""
    calls: list[list[str]] = []

    def prepare(gens):
        calls.append([g.req_id for g in gens])
        return [ValueError("no draft") if g.req_id == "bad" else g.prepare() for g in gens]

    gens = [Gen(n, cycles=2) for n in ("a", "bad", "c")]
    sched = Scheduler(Backend(ok), prepare)
    with sched._cond:  # all three are in the first step
        for g in gens:
            sched.add(g)
    assert all(g.released.wait(10) for g in gens)
    assert calls == [["a", "bad", "c"], ["a", "c"]]
    (err,) = gens[1].items()
    assert isinstance(err, ValueError) and gens[0].items() == [[1], [2]] == gens[2].items()

    def broken(gens):
        raise RuntimeError("a bug")

    late = Gen("late")
    sched2 = Scheduler(Backend(ok), broken)
    sched2.add(late)
    assert late.released.wait(10)
    (err,) = late.items()
    assert isinstance(err, RuntimeError)
    sched.close()
    sched2.close()


def test_cancelled_and_aborted_generations_end_with_their_sessions_closed():
    release = threading.Event()

    def answer(session, request):
        if session == "slow":
            release.wait(10)
        return ok(session, request)

    cancelled, aborted, slow = Gen("cancelled", 100), Gen("aborted", 100), Gen("slow", 1)
    sched = Scheduler(Backend(answer), each)
    sched.add(slow)  # holds the step while the others are set
    cancelled.cancelled = True
    aborted.aborted = True
    sched.add(cancelled)
    sched.add(aborted)
    release.set()
    run(sched, [])
    assert cancelled.released.wait(10) and aborted.released.wait(10)
    (err,) = cancelled.items()
    assert isinstance(err, SessionCancelled)
    assert aborted.items() == [] and aborted.finish_reason == "abort"
    assert cancelled.prepared == 0 and aborted.prepared == 0
    sched.close()


class Replica:
    """A remote backend's sessions: each cycle on a pooled thread, answered as it ends; every
    step's sessions recorded."""

    def __init__(self):
        self.each, self.steps = CycleEach(8), []

    def step(self, cycles, done):
        self.steps.append(sorted(s.name for s, _ in cycles))
        self.each.step(cycles, done)


class Held:
    """A session whose cycles wait for ``gate`` while ``held``."""

    def __init__(self, name: str, gate: threading.Event, held: bool = True):
        self.name, self.gate, self.held = name, gate, held

    def cycle(self, request):
        if self.held:
            self.gate.wait(10)
        return ok(self.name, request)


def test_a_slow_replica_holds_up_only_its_own_lane():
    """Sessions on two replicas (lanes): the slow replica's session holds up only itself, the
    fast one's lane steps on and finishes first."""
    gate = threading.Event()
    slow, fast = Gen("slow", 1), Gen("fast", 5)
    slow.session, fast.session = Held("slow", gate), Held("fast", gate, held=False)
    sched = Scheduler(Replica(), each, lane=lambda s: s.name)
    sched.add(slow)
    sched.add(fast)
    assert fast.released.wait(10) and not slow.released.is_set()
    gate.set()
    assert slow.released.wait(10)
    assert fast.items() == [[1], [2], [3], [4], [5]] and slow.items() == [[1]]
    sched.close()


def test_a_lane_s_sessions_step_together_one_step_in_flight():
    """One replica (lane): while its step is in flight, a session added or answered early
    waits for it and goes out in the lane's next step with the others, never in a step alone."""
    gate = threading.Event()
    replica = Replica()
    a, b, late = Gen("a", 3), Gen("b", 3), Gen("late", 2)
    a.session, b.session, late.session = Held("a", gate), Held("b", gate, held=False), Held("late", gate, held=False)
    sched = Scheduler(replica, each, lane=lambda s: "one")
    with sched._cond:
        sched.add(a)
        sched.add(b)
    while not replica.steps:
        threading.Event().wait(0.001)
    sched.add(late)  # the step of a and b is in flight, a held
    threading.Event().wait(0.05)
    assert replica.steps == [["a", "b"]]  # b answered and late came: both wait for a
    gate.set()
    assert all(g.released.wait(10) for g in (a, b, late))
    assert replica.steps == [["a", "b"], ["a", "b", "late"], ["a", "b", "late"]]
    assert a.items() == b.items() == [[1], [2], [3]] and late.items() == [[1], [2]]
    sched.close()


def test_run_step_reports_each_item_and_a_failed_step_fails_every_cycle():
    def step(items):
        items[0].result = CycleResult(committed=[7], drafted=0, accepted=0, source="none")
        items[1].again = True
        items[2].error = KeyError("x")

    got: dict[int, object] = {}
    run_step(step, [("a", CycleRequest()), ("b", CycleRequest()), ("c", CycleRequest())], got.__setitem__)
    assert (
        got[0] == CycleResult(committed=[7], drafted=0, accepted=0, source="none")
        and got[1] is AGAIN
        and isinstance(got[2], KeyError)
    )

    def broken(items):
        raise RuntimeError("device lost")

    got.clear()
    run_step(broken, [("a", CycleRequest()), ("b", CycleRequest())], got.__setitem__)
    assert [type(v) for v in got.values()] == [RuntimeError, RuntimeError]


def test_a_closed_scheduler_takes_no_more_generations():
    sched = Scheduler(Backend(ok), each)
    run(sched, [Gen("a", 1)])
    sched.close()
    with pytest.raises(RuntimeError, match="closed"):
        sched.add(Gen("b"))


def test_two_micro_batches_alternate_and_overlap_the_router_s_work_with_a_step():
    """micro_batches 2 over an in-process backend: the sessions split into two steps of half
    each, at most two in flight, the steps run on a thread of their own, so the scheduler
    drafts for one half while the other's step runs."""
    step_threads, overlapped = set(), threading.Event()
    running = threading.Event()

    class Slow(Backend):
        def step(self, cycles, done):
            step_threads.add(threading.current_thread().name)
            running.set()
            threading.Event().wait(0.02)  # the modelled device step
            running.clear()
            super().step(cycles, done)

    class Watched(Gen):
        def prepare(self):
            if running.is_set():
                overlapped.set()
            return super().prepare()

    backend = Slow(ok)
    gens = [Watched(n, cycles=4) for n in "abcdef"]
    sched = Scheduler(backend, each, micro_batches=2, offload=True)
    with sched._cond:
        for g in gens:
            sched.add(g)
    assert all(g.released.wait(10) for g in gens)
    assert all(len(s) <= 3 for s in backend.steps) and backend.steps[0] == ["a", "b", "c"]
    assert threading.current_thread().name not in step_threads and "scheduler" not in step_threads
    assert overlapped.is_set()  # a half was drafted while the other's step ran
    assert all(g.items() == [[1], [2], [3], [4]] for g in gens)
    sched.close()


def test_an_in_process_step_runs_on_the_scheduler_while_its_deferred_work_is_published():
    """In process (offload), one micro-batch: the scheduler runs each step itself (no hand-off
    between two steps) after handing what waited for it (outputs, metrics) to the publisher
    thread, which runs it while the step runs; a step's deferred work has all run before the
    next step's outcomes are applied."""
    order: list[str] = []
    threads: set[tuple[str, str]] = set()
    pending: dict[int, int] = {}  # steps sent when it was deferred -> deferred calls not yet run

    class Recording(Backend):
        def step(self, cycles, done):
            order.append("step")
            threads.add(("step", threading.current_thread().name))
            threading.Event().wait(0.005)  # the device holds the step; the GIL is free
            super().step(cycles, done)

    class Deferring(Gen):
        def apply(self, res):
            sent = sched.steps
            assert not any(n for s, n in pending.items() if s < sent), "an earlier step's deferred work is pending"
            super().apply(res)
            pending[sent] = pending.get(sent, 0) + 1
            sched.defer(lambda: deferred(sent))

    def deferred(sent: int):
        threading.Event().wait(0.004)  # two of them outlast the step: the next turn must wait for them
        threads.add(("deferred", threading.current_thread().name))
        order.append("deferred")
        pending[sent] -= 1

    gens = [Deferring(n, cycles=5) for n in "ab"]
    sched = Scheduler(Recording(ok), each, offload=True)
    with sched._cond:
        for g in gens:
            sched.add(g)
    assert all(g.released.wait(10) for g in gens)
    sched.close()
    # each step's outcomes defer their work into the next turn, whose step starts first
    assert order == ["step"] + ["step", "deferred", "deferred"] * 4 + ["deferred", "deferred"]
    assert threads == {("step", "scheduler"), ("deferred", "publisher")}
    assert all(g.items() == [[1], [2], [3], [4], [5]] for g in gens)  # no apply failed


def test_auto_micro_batches_split_a_lane_s_sessions_from_split_at():
    """micro_batches 0 (the default): a backend's sessions run in two alternating halves once
    its ``split_at`` of them are running, in one step below it; a ``split_at`` of 0 (in process)
    as the overlap tuner chooses, in one below its ``min_sessions`` (32)."""
    for names, offload, split_at, first in (
        ("abcdef", False, 6, 3),
        ("abcde", False, 6, 5),
        ("abcdef", True, 0, 6),
    ):
        backend = Backend(ok)
        gens = [Gen(n, cycles=2) for n in names]
        sched = Scheduler(backend, each, offload=offload, split_at=split_at)
        with sched._cond:  # all of them before the first step
            for g in gens:
                sched.add(g)
        assert all(g.released.wait(10) for g in gens)
        assert len(backend.steps[0]) == first, (names, offload, backend.steps)
        assert all(g.items() == [[1], [2]] for g in gens)
        sched.close()


def test_in_process_auto_micro_batches_follow_the_tuner_and_switch_between_steps():
    """In process, auto: the lane runs in the micro-batches the tuner returns after each turn,
    told the tokens committed and the sessions running: two halves on the step thread while it
    says 2, whole steps on the scheduler itself once it says 1 (after the halves in flight); the
    gauge ``specmesh_router_micro_batches`` follows."""
    from services.common.metrics import ROUTER_MICRO_BATCHES

    step_threads: list[tuple[int, str]] = []
    gauge: list[float] = []

    class Recording(Backend):
        def step(self, cycles, done):
            step_threads.append((len(cycles), threading.current_thread().name))
            gauge.append(ROUTER_MICRO_BATCHES._value.get())
            threading.Event().wait(0.005)
            super().step(cycles, done)

    class Scripted:
        """Two for the first 6 turns, then one."""

        mode, chosen, rates = 2, 2, {}

        def __init__(self):
            self.seen: list[tuple[int, int]] = []

        def observe(self, tokens: int, sessions: int) -> int:
            self.seen.append((tokens, sessions))
            self.mode = self.chosen = 2 if len(self.seen) < 6 else 1
            return self.mode

    backend = Recording(ok)
    gens = [Gen(n, cycles=8) for n in "abcdef"]
    sched = Scheduler(backend, each, offload=True)
    assert sched.tuner is not None  # auto, in process
    sched.tuner = tuner = Scripted()  # type: ignore[assignment]
    with sched._cond:
        for g in gens:
            sched.add(g)
    assert all(g.released.wait(10) for g in gens)
    sched.close()
    assert step_threads[0] == (3, "step_0") and step_threads[1][0] == 3  # halves, on the step thread
    first = next(i for i, (_, t) in enumerate(step_threads) if t == "scheduler")
    assert all(t == "scheduler" for _, t in step_threads[first:])  # once it said 1, on the scheduler
    assert (6, "scheduler") in step_threads  # whole (the halves' last cycles may end a step apart)
    assert all(n <= 3 for n, t in step_threads[:first])
    assert tuner.seen[0] == (3, 6)  # a half's 3 tokens settled, 6 sessions running
    assert 2 in gauge[:first] and gauge[-1] == 1  # specmesh_router_micro_batches says which, as it goes
    assert all(g.items() == [[i] for i in range(1, 9)] for g in gens)
