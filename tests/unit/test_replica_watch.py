"""ReplicaWatch: when a verifier replica counts as hung, and when a failed one comes back."""

import pytest

from services.verifier.watch import ReplicaWatch


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_budget_is_the_floor_until_cycles_are_slow_then_follows_them_and_decays():
    w = ReplicaWatch(floor_s=2.0, factor=10.0, decay=0.5)
    assert w.budget("a") == 2.0
    w.answered("a", 0.05)
    assert w.budget("a") == 2.0  # 10 x 0.05 is under the floor
    w.answered("a", 1.0)  # a long prefill
    assert w.budget("a") == 10.0
    w.answered("a", 0.01)
    w.answered("a", 0.01)
    assert w.budget("a") == pytest.approx(2.5)  # 10 x 1.0 x 0.5 x 0.5
    assert w.budget("b") == 2.0  # per replica
    assert w.budget("b", prefill=5000) == pytest.approx(2.0 + 5000 * w.prefill_s_per_token)  # a first cycle


def test_a_failed_replica_is_left_out_for_a_quarantine_that_doubles_and_ends_with_an_answered_cycle():
    clock = Clock()
    w = ReplicaWatch(first_quarantine_s=1.0, max_quarantine_s=3.0, clock=clock)
    assert w.failed("a") == 1.0 and w.out(["a", "b"]) == {"a"}
    clock.t += 1.0
    assert w.usable("a")
    assert w.failed("a") == 2.0  # failed again, first thing after
    assert w.failed("a") == 3.0  # capped
    clock.t += 3.0
    w.answered("a", 0.1)
    assert w.failed("a") == 1.0  # the run of failures ended


def test_a_probe_keeps_a_silent_replica_out_past_its_quarantine_and_lets_an_answering_one_in():
    clock = Clock()
    w = ReplicaWatch(first_quarantine_s=1.0, clock=clock)
    w.failed("a")
    w.probed("a", False)  # still in quarantine: no change
    clock.t += 1.0
    w.probed("a", False)
    assert not w.usable("a")  # out again, for 2 s
    clock.t += 2.0
    w.probed("a", True)
    assert w.usable("a")
    w.probed("b", False)  # a healthy replica that stops answering a probe goes out
    assert w.out(["a", "b"]) == {"b"}


def test_a_timeout_of_zero_is_refused():
    with pytest.raises(ValueError, match="verifier timeout"):
        ReplicaWatch(floor_s=0)
