"""The router's end of a replica's Link over a stand-in for gRPC's call: a step's cycles leave
in one message (by column), and a sender that asks to wait returns once gRPC has sent it (asked for the
next message), not before."""

import threading
import time

import pytest

from services.common.types import CycleRequest
from services.verifier.client import Posting, ReplicaLink
from specmesh.v1 import verifier_pb2 as pb


class Call:
    """gRPC's stream-stream call as the link sees it: a thread takes each message from the
    request iterator, takes ``send_s`` to send it, then asks for the next; no replies until
    cancelled."""

    def __init__(self, requests, send_s: float):
        self.sent: list[list[str]] = []
        self.kinds: list[set[str]] = []  # per message: its items' kinds, and "step" if it has one
        self._end = threading.Event()
        threading.Thread(target=self._consume, args=(requests, send_s), daemon=True).start()

    def _consume(self, requests, send_s: float) -> None:
        for msg in requests:
            time.sleep(send_s)
            self.sent.append([item.session_id for item in msg.items] + list(msg.step.session_ids))
            self.kinds.append(
                {item.WhichOneof("kind") for item in msg.items} | ({"step"} if msg.HasField("step") else set())
            )

    def __iter__(self):
        self._end.wait()
        return iter(())

    def cancel(self) -> None:
        self._end.set()


class Stub:
    def __init__(self, send_s: float):
        self.send_s, self.call = send_s, None

    def Link(self, requests):  # noqa: N802 - gRPC's method name
        self.call = Call(requests, self.send_s)
        return self.call


def items(*sids: str) -> list[pb.LinkItem]:
    return [pb.LinkItem(session_id=sid, close=pb.Close()) for sid in sids]


def test_a_waiting_sender_returns_once_its_message_is_sent():
    stub = Stub(send_s=0.2)
    link = ReplicaLink(stub, "replica")
    try:
        link.send_all(items("a", "b", "c"), wait_s=5.0)
        assert stub.call.sent == [["a", "b", "c"]]  # one message, sent before the sender went on
        t0 = time.monotonic()
        link.send_all(items("d"))  # not waiting: back before it is sent
        assert time.monotonic() - t0 < 0.1 and stub.call.sent == [["a", "b", "c"]]
        link.send_all(items("e"), wait_s=0.05)  # waits at most wait_s
        assert time.monotonic() - t0 < 0.15
        end = time.monotonic() + 5
        while sum(map(len, stub.call.sent)) < 5 and time.monotonic() < end:
            time.sleep(0.01)
        assert [sid for msg in stub.call.sent for sid in msg] == list("abcde")
    finally:
        link.shut()


def test_deadlines_due_together_run_in_one_wake_up_never_early():
    """Calls due within the slack of the first run together (a step's posted cycles are due
    microseconds apart), each no earlier than it is due, in due order."""
    from services.verifier.backend import Deadlines

    deadlines = Deadlines(slack_s=0.05)
    ran: list[tuple[int, float, float, int]] = []
    wakeups = []
    try:
        for i in range(50):
            due = time.monotonic() + 0.1

            def call(i=i, due=due) -> None:
                ran.append((i, due, time.monotonic(), len(wakeups)))

            deadlines.add(0.1, call)
            time.sleep(0.0005)  # due 25 ms apart first to last: within the slack
        deadlines.add(0.0, lambda: wakeups.append(1))  # due now: runs first, alone
        deadline = time.monotonic() + 5
        while len(ran) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        deadlines.close()
    assert [i for i, *_ in ran] == list(range(50))
    assert all(at >= due for _, due, at, _ in ran)
    assert ran[-1][2] - ran[0][2] < 0.01  # together, not each at its own moment
    assert {w for *_, w in ran} == {1}


def test_an_answered_cycle_cancels_its_deadline_and_an_unanswered_one_stalls():
    """A posted cycle's "no answer in time" call is dropped once its reply comes (out of order
    too): nothing of the cycle stays held for its budget, and the deadline thread has nothing
    left to wake for. A cycle with no reply still gets ``Stalled`` when its budget runs out."""
    import gc
    import queue
    import weakref

    from services.common.types import CycleResult
    from services.verifier.client import Stalled

    link = ReplicaLink(Stub(send_s=0.0), "replica")
    try:
        got: dict[str, object] = {}

        class Answered:  # the posted cycle's callback (weakly referenced: is it freed?)
            def __init__(self, sid: str):
                self.sid = sid

            def __call__(self, outcome) -> None:
                got[self.sid] = outcome

        callbacks = {sid: Answered(sid) for sid in "abcd"}
        postings = []
        for sid, cb in callbacks.items():
            link._inbox[sid] = queue.SimpleQueue()  # opened
            postings.append(Posting(link, sid, CycleRequest(), 1.5 if sid == "d" else 60.0, cb))
        link.post_all(postings)
        assert len(link._deadlines._heap) == 4
        refs = {sid: weakref.ref(cb) for sid, cb in callbacks.items()}
        callbacks.clear()
        postings.clear()
        link._deliver("b", pb.LinkReply(session_id="b", result=pb.CycleResult(committed=[1], source="suffix")))
        link._deliver_all(
            [(sid, pb.LinkReply(session_id=sid, result=pb.CycleResult(committed=[1], source="suffix"))) for sid in "ac"]
        )
        gc.collect()
        assert all(isinstance(got[sid], CycleResult) for sid in "abc")
        assert all(refs[sid]() is None for sid in "abc")  # freed now, not after their 60 s
        assert set(link._timers) == {"d"}  # (the answered ones' entries hold nothing now)
        end = time.monotonic() + 10  # (d's budget is 1.5 s: a full collection above may take a while)
        while "d" not in got and time.monotonic() < end:
            time.sleep(0.01)
        assert isinstance(got["d"], Stalled) and link._deadlines._heap == [] and link._timers == {}
    finally:
        link.shut()


@pytest.mark.parametrize("columns", [True, False])
def test_a_steps_postings_leave_in_one_message_and_a_closed_sessions_is_refused(columns):
    """``post_all``: every posting's cycle in one message, by column where the replica reads
    them so (else as items: a replica of an older release); a session not open on the link is
    answered UNAVAILABLE (off the caller's thread) while the others wait for their replies,
    which may come by column too (``CycleResult``s already)."""
    import queue

    import grpc

    from services.common.types import CycleResult

    stub = Stub(send_s=0.0)
    link = ReplicaLink(stub, "replica")
    link.columns = columns
    try:
        got: dict[str, object] = {}
        for sid in "ab":
            link._inbox[sid] = queue.SimpleQueue()
        postings = [
            Posting(link, sid, CycleRequest(draft_ids=(4, 5)), 60.0, lambda o, sid=sid: got.__setitem__(sid, o))
            for sid in "abc"
        ]
        link.post_all(postings, wait_s=5.0)
        assert stub.call.sent == [["a", "b", "c"]]
        assert stub.call.kinds == [{"step"} if columns else {"cycle"}]
        end = time.monotonic() + 5
        while "c" not in got and time.monotonic() < end:
            time.sleep(0.01)
        assert got["c"].code() == grpc.StatusCode.UNAVAILABLE and set(got) == {"c"}
        assert set(link._waiters) == set(link._timers) == {"a", "b"}
        reply = pb.LinkReply(result=pb.CycleResult(committed=[7], source="suffix"))
        link._deliver_all([("a", reply), ("b", CycleResult(committed=[7], drafted=2, accepted=0, source="suffix"))])
        assert [got[sid].committed for sid in "ab"] == [[7], [7]] and isinstance(got["a"], CycleResult)
        assert link._waiters == link._timers == {} and link._deadlines._heap == []
    finally:
        link.shut()


def test_a_call_due_after_the_deadline_thread_looks_next_does_not_wake_it():
    """A step's "no answer in time" calls are due a budget (seconds) away: adding them wakes
    the sleeping thread only when one is due before it would look anyway."""
    from services.verifier.backend import Deadlines

    deadlines = Deadlines(slack_s=0.01)
    notified = []
    try:
        first = deadlines.add(30.0, lambda: None)  # starts the thread, which sleeps until it is due
        time.sleep(0.05)
        deadlines.cancel(first)  # answered: the heap is empty, as after each step's replies
        notify = deadlines._cond.notify
        deadlines._cond.notify = lambda *a: (notified.append(1), notify(*a))  # type: ignore[method-assign]
        deadlines.cancel_all(deadlines.add_all([(30.0, lambda: None)] * 64))
        assert notified == []
        assert deadlines.add_all([]) == [] and notified == []  # nothing to add, on an empty heap
        ran = threading.Event()
        deadlines.add(0.0, ran.set)  # due now: wakes it
        assert ran.wait(5) and notified == [1]
    finally:
        deadlines.close()


def test_a_reply_whose_columns_disagree_breaks_the_link_and_fails_its_cycles():
    """A step's results that do not parse (``StepResults`` columns of different lengths) leave
    the link broken: its posted cycles get UNAVAILABLE (their sessions fail over), not silence."""
    import queue

    import grpc

    class Garbled(Call):
        def __iter__(self):
            while not self.sent:
                time.sleep(0.01)
            return iter([pb.LinkResponse(step=pb.StepResults(session_ids=["a"]))])  # no other column

    class GarbledStub(Stub):
        def Link(self, requests):  # noqa: N802 - gRPC's method name
            self.call = Garbled(requests, self.send_s)
            return self.call

    link = ReplicaLink(GarbledStub(send_s=0.0), "replica")
    try:
        got: list = []
        link._inbox["a"] = queue.SimpleQueue()
        link.post_all([Posting(link, "a", CycleRequest(), 60.0, got.append)])
        end = time.monotonic() + 5
        while not got and time.monotonic() < end:
            time.sleep(0.01)
        assert got and got[0].code() == grpc.StatusCode.UNAVAILABLE and "column" in got[0].details()
        assert link.broken is not None
    finally:
        link.shut()
