"""``ray_app.close_at``: a session's close is sent again while it lands on another replica than
its own (Serve once handed 2 of 140 closes sent at once to the wrong replica, leaving those
sessions open there)."""

from services.ray_app import CLOSE_TRIES, close_at


class Answer:
    def __init__(self, landing):
        self.landing = landing

    def result(self, timeout_s):
        if isinstance(self.landing, Exception):
            raise self.landing
        return self.landing


class Handle:
    """A Serve handle whose ``close`` calls land as ``landings`` say, in turn."""

    def __init__(self, landings):
        self.landings, self.homes = list(landings), []
        self.close = self

    def remote(self, home):
        self.homes.append(home)
        return Answer(self.landings.pop(0))


def test_a_close_that_lands_on_another_replica_is_sent_again_until_it_reaches_home():
    h = Handle([{"replica": "B", "closed": False}, {"replica": "A", "closed": True}])
    assert close_at(h, "A") and h.homes == ["A", "A"]


def test_a_close_that_reaches_home_is_not_resent_held_or_not():
    h = Handle([{"replica": "A", "closed": False}])
    assert not close_at(h, "A") and h.homes == ["A"]


def test_close_gives_up_after_its_tries_and_on_a_failed_call():
    h = Handle([{"replica": "B", "closed": False}] * CLOSE_TRIES)
    assert not close_at(h, "A") and len(h.homes) == CLOSE_TRIES
    h = Handle([TimeoutError("no answer")])
    assert not close_at(h, "A") and len(h.homes) == 1
