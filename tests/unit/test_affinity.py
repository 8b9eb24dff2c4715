"""Prefix affinity: where a prompt's start was placed, and the placement rule that uses it."""

from services.common.affinity import PrefixAffinity, choose, session_loads, unreported

A, B = "a:1", "b:1"


def test_holders_are_the_replicas_last_given_each_leading_block():
    aff = PrefixAffinity(block=4)
    long = list(range(20))
    aff.placed(long, A)
    assert aff.holders(long) == {A: 4}  # 5 blocks, but the newest token is never cached
    assert aff.holders(list(range(9)) + [99] * 8) == {A: 2}
    assert aff.holders([99] + list(range(1, 20))) == {}
    aff.placed(list(range(9)), B)  # a shorter prompt with the same start, later
    assert aff.holders(long) == {B: 2, A: 4}
    aff.forget(A)
    assert aff.holders(long) == {B: 2}
    assert aff.holders(long, salt="tenant") == {}  # blocks are shared only within a cache salt
    aff.placed(long, A, salt="tenant")
    assert aff.holders(long, salt="tenant") == {A: 4} and aff.holders(long) == {B: 2}


def test_the_map_is_bounded():
    aff = PrefixAffinity(block=2, capacity=3)
    aff.placed(list(range(9)), A)  # 4 blocks: the oldest one goes
    assert len(aff._where) == 3 and aff.holders(list(range(9))) == {}


def test_choose_prefers_the_holder_within_the_slack_else_the_least_loaded():
    live = [A, B]
    assert choose(live, {A: 1, B: 0}, {A: 3}, slack=2) == A
    assert choose(live, {A: 1, B: 0}, {A: 3}, slack=0) == B
    assert choose(live, {A: 3, B: 0}, {A: 3}, slack=2) == B
    assert choose(live, {A: 0, B: 0}, {A: 1, B: 3}, slack=0) == B
    assert choose(live, {A: 0, B: 0}, {}, slack=2) == A  # no holder: least loaded, first on ties
    assert choose(live, {A: 2, B: 1}, {}, slack=2) == B


def test_session_loads_merge_the_replicas_reports_with_this_routers_changes_since():
    reported = {A: ["s1", "s2", "other-router"], B: []}
    assert session_loads([A, B], reported, {}, set()) == {A: 3, B: 0}
    # this router opened s3 on B and closed s2 since the reports; s1 is in both (counted once)
    assert session_loads([A, B], reported, {"s1": A, "s3": B}, {"s2"}) == {A: 2, B: 1}
    assert session_loads([A, B], {}, {"s1": A}, set()) == {A: 1, B: 0}  # no report yet
    assert session_loads([B], reported, {"s1": A}, set()) == {B: 0}  # only live replicas


def test_unreported_sessions_are_those_a_report_taken_long_after_their_placement_does_not_list():
    placed = {"old-gone": (A, 0.0), "old-live": (A, 0.0), "new": (A, 9.0), "elsewhere": (B, 0.0)}
    reported = {A: (10.0, ["old-live"])}  # B has not reported yet
    assert unreported(placed, reported, lag=5.0) == ["old-gone"]
    # a report taken before the lag ran out (a busy replica's, late) proves no session gone
    assert unreported(placed, {A: (4.0, [])}, lag=5.0) == []
