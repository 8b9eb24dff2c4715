"""Admission order: (priority, arrival), and only the queue's head takes slots."""

import threading
import time

from services.common.refusals import Cancelled, Overloaded
from services.router.admission import Admission
from tests.conftest import wait_for


class Call:
    """What Admission reads of a call: still wanted, and its time left."""

    def __init__(self, deadline_s: float | None = None):
        self.active, self.end = True, None if deadline_s is None else time.monotonic() + deadline_s

    def is_active(self) -> bool:
        return self.active

    def time_remaining(self):
        return None if self.end is None else self.end - time.monotonic()


def queue_up(adm: Admission, order: list, requests: list[tuple[str, int, int]]) -> list[threading.Thread]:
    """One waiting thread per (name, slots, priority), queued in list order; each appends its
    name to ``order`` when admitted."""
    threads = []
    for name, n, priority in requests:
        t = threading.Thread(target=lambda name=name, n=n, p=priority: (adm.acquire(Call(), n, p), order.append(name)))
        t.start()
        threads.append(t)
        assert wait_for(lambda k=len(threads): adm.waiting == k)
    return threads


def test_waiters_are_served_first_come_first_served():
    adm, order = Admission(max_sessions=1, max_queue=8), []
    assert adm.acquire(Call()) is None
    threads = queue_up(adm, order, [("a", 1, 0), ("b", 1, 0), ("c", 1, 0)])
    for expected in (["a"], ["a", "b"], ["a", "b", "c"]):
        adm.release()
        assert wait_for(lambda expected=expected: order == expected), order
    for t in threads:
        t.join(5)


def test_lower_priority_values_go_first_then_arrival():
    adm, order = Admission(max_sessions=1, max_queue=8), []
    assert adm.acquire(Call()) is None
    threads = queue_up(adm, order, [("late-0", 1, 0), ("urgent", 1, -5), ("low", 1, 3), ("next-0", 1, 0)])
    for _ in threads:
        adm.release()
        time.sleep(0.05)
    assert wait_for(lambda: len(order) == 4) and order == ["urgent", "late-0", "next-0", "low"]


def test_a_request_for_several_slots_is_not_passed_over_by_later_single_ones():
    adm, order = Admission(max_sessions=2, max_queue=8), []
    assert adm.acquire(Call(), 2) is None
    threads = queue_up(adm, order, [("pair", 2, 0), ("single", 1, 0)])
    adm.release()  # one slot free: the head needs two, so nobody goes
    time.sleep(0.3)
    assert order == [] and adm.running == 1
    adm.release()
    assert wait_for(lambda: order == ["pair"]) and adm.running == 2
    adm.release(2)
    assert wait_for(lambda: order == ["pair", "single"])
    for t in threads:
        t.join(5)


def test_a_head_that_leaves_lets_the_next_in_and_a_full_queue_refuses():
    adm = Admission(max_sessions=1, max_queue=2)
    assert adm.acquire(Call()) is None
    gone, got = Call(), {}
    leaver = threading.Thread(target=lambda: got.setdefault("gone", adm.acquire(gone)))
    leaver.start()
    assert wait_for(lambda: adm.waiting == 1)
    waiter = threading.Thread(target=lambda: got.setdefault("next", adm.acquire(Call())))
    waiter.start()
    assert wait_for(lambda: adm.waiting == 2)
    assert isinstance(adm.acquire(Call()), Overloaded)
    assert isinstance(adm.acquire(Call(deadline_s=0.0)), Overloaded)  # refused before waiting
    gone.active = False
    leaver.join(5)
    assert isinstance(got["gone"], Cancelled) and adm.waiting == 1
    adm.release()
    waiter.join(5)
    assert got["next"] is None and adm.running == 1 and adm.waiting == 0
