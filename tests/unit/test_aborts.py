"""Aborts across front-end replicas: each replica's ActiveSessions publishes its own aborts to
an AbortLog and applies the others' at the time they were made."""

import time
from types import SimpleNamespace

from services.router.admission import AbortLog, ActiveSessions, relay


class Gen:
    def __init__(self, request_id: str, started: float):
        self.req_id = request_id + "-0"
        self.session_id = f"{request_id}-{started}"
        self.req = SimpleNamespace(request_id=request_id)
        self.timings = SimpleNamespace(start=started)
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_an_abort_made_on_one_replica_ends_the_request_on_another():
    board = AbortLog()
    a = ActiveSessions(lambda rid, wall: board.post("a", rid, wall))
    b = ActiveSessions(lambda rid, wall: board.post("b", rid, wall))
    old = Gen("x", time.perf_counter() - 2.0)
    other = Gen("y", time.perf_counter() - 2.0)
    b.add([old, other])
    assert a.abort("x") == 0  # nothing of "x" decodes on a
    seq, entries = board.since(0)
    assert seq == 1 and [e[:2] for e in entries] == [("a", "x")]
    assert relay(entries, "a", a) == 0  # a skips its own
    assert relay(entries, "b", b) == 1 and old.aborted and not other.aborted
    assert board.since(seq) == (1, [])  # b relays without posting again
    # a request "x" made after the abort, on b, is not ended by it, however late the relay comes
    late = Gen("x", time.perf_counter())
    b.add([late])
    relay(entries, "b", b)
    assert not late.aborted
    # one made before it and still queued when the relay came is ended as it starts
    queued = Gen("y", time.perf_counter() - 1.0)
    relay([("a", None, time.time() - 0.5)], "b", b)  # abort_all on a, half a second ago
    assert other.aborted and not late.aborted
    b.add([queued])
    assert queued.aborted


def test_the_log_forgets_aborts_past_their_window(monkeypatch):
    import services.router.admission as srv

    board = AbortLog()
    board.post("a", "x", time.time() - srv.ABORT_WINDOW_S - 1)
    board.post("a", "y", time.time())
    assert [e[1] for e in board.since(0)[1]] == ["y"] and board.since(0)[0] == 2
