"""The verifier's protobuf edge: session specs, cycle results and a step's cycles and results
by column survive the round trip."""

import pytest

from services.common.types import CycleRequest, CycleResult, Sampling, SessionSpec, TokenLogprob
from services.verifier.wire import (
    packable,
    result_from_pb,
    result_to_pb,
    results_from_pb,
    results_to_pb,
    spec_from_pb,
    spec_to_pb,
    step_from_pb,
    step_to_pb,
)


def test_session_spec_round_trip_keeps_every_field_but_the_deadline():
    spec = SessionSpec(
        prompt_ids=[5, 6, 7],
        max_new_tokens=9,
        sampling=Sampling(0.75, 0.5, 5, 11, 1.25, 0.5, -0.25, min_p=0.125),
        policy="csd",
        model_drafter="eagle3",
        on_demand=True,
        max_draft=4,
        session_id="s-1",
        logprobs=3,
        cache_salt="tenant",
        ignore_eos=True,
        min_tokens=4,
        generated=2,
        prompt_logprobs=0,
    )
    assert spec_from_pb(spec_to_pb(spec)) == spec
    plain = SessionSpec(prompt_ids=[1], max_new_tokens=2)
    assert spec_from_pb(spec_to_pb(plain)) == plain  # logprobs stays None, not 0


def test_cycle_result_round_trip_keeps_logprobs_and_the_cache_hit():
    lps = (TokenLogprob(4, -0.5, ((4, -0.5), (9, -1.25))), TokenLogprob(8, -2.0, ((3, -0.75), (8, -2.0))))
    res = CycleResult(
        committed=[4, 8],
        drafted=3,
        accepted=1,
        source="draft-lm",
        rescued_pairs=((4, 2),),
        rejected=True,
        draft_s=0.25,
        verify_s=0.5,
        batch_size=3,
        cached_tokens=64,
        logprobs=lps,
        prompt_logprobs=(TokenLogprob(6, -1.5, ((7, -0.25), (6, -1.5))),) + lps,
    )
    assert result_from_pb(result_to_pb(res)) == res
    own = CycleResult(committed=[4], drafted=0, accepted=0, source="none", logprobs=(TokenLogprob(4, -0.5),))
    assert result_from_pb(result_to_pb(own)).logprobs == own.logprobs
    plain = CycleResult(committed=[4, 5], drafted=2, accepted=1, source="suffix", server_s=0.5, batch_size=7)
    assert result_from_pb(result_to_pb(plain)) == plain  # nothing optional set: the fast path


def test_a_resumed_spec_carries_the_output_so_far():
    spec = SessionSpec(prompt_ids=[1, 2], max_new_tokens=9, min_tokens=4, prompt_logprobs=2)
    assert spec.resumed([]) is spec
    again = spec.resumed([7, 8, 9])
    assert (again.prompt_ids, again.max_new_tokens, again.min_tokens, again.generated, again.prompt_logprobs) == (
        [1, 2, 7, 8, 9],
        6,
        1,
        3,
        None,
    )
    assert spec.resumed([5] * 12).max_new_tokens == 1 and spec.resumed([5] * 12).min_tokens == 0


def test_a_link_frees_its_session_before_answering_the_cycle():
    """The router sends a session's next cycle as soon as the answer arrives; had the link
    queued the answer first, that cycle could find the session still busy (CI once did)."""
    from types import SimpleNamespace

    from services.verifier.grpc_server import LinkServer

    link = LinkServer(servicer=None)
    link.sessions["s"] = object()
    link.busy.add("s")
    busy_at_reply = []
    link._out = SimpleNamespace(put=lambda reply: busy_at_reply.append("s" in link.busy))
    link._done(
        "s", SimpleNamespace(error=None, result=CycleResult(committed=[4], drafted=0, accepted=0, source="none"))
    )
    assert busy_at_reply == [False]


def test_a_steps_cycles_by_column_round_trip_chains_trees_and_delegations():
    cycles = [
        ("a", CycleRequest(draft_ids=(5, 6, 7), draft_source="suffix")),
        ("b", CycleRequest()),  # nothing to draft (a prompt's chunk)
        ("c", CycleRequest(draft_ids=(8, 9, 10), draft_parents=(-1, 0, 0), draft_source="suffix")),  # a tree
        ("d", CycleRequest(draft_with="eagle3", budget=4, draft_ids=(11,), draft_source="suffix")),
        ("e", CycleRequest(draft_with="draft-lm", budget=6)),
    ]
    assert step_from_pb(step_to_pb(cycles)) == cycles
    assert step_from_pb(step_to_pb([])) == []


def test_a_steps_columns_that_disagree_are_refused():
    good = step_to_pb([("a", CycleRequest(draft_ids=(5, 6))), ("b", CycleRequest(draft_ids=(7,)))])
    for spoil in (
        lambda m: m.draft_ids.pop(),  # fewer tokens than the counts say
        lambda m: m.budgets.pop(),  # a column one short
        lambda m: m.session_ids.append("c"),  # a cycle with no columns
        lambda m: m.parent_counts.__setitem__(0, 1),  # parents that are not there
    ):
        bad = type(good)()
        bad.CopyFrom(good)
        spoil(bad)
        with pytest.raises(ValueError, match="column"):
            step_from_pb(bad)


def test_a_steps_plain_results_by_column_round_trip_and_the_rest_are_not_packable():
    results = [
        ("a", CycleResult(committed=[4, 5], drafted=3, accepted=1, source="suffix", rejected=True, server_s=0.5)),
        ("b", CycleResult(committed=[], drafted=0, accepted=0, source="none", batch_size=7, cached_tokens=64)),
        ("c", CycleResult(committed=[9], drafted=4, accepted=0, source="eagle3", draft_s=0.25, verify_s=0.125)),
    ]
    assert all(packable(r) for _, r in results)
    assert results_from_pb(results_to_pb(results)) == results
    broken = results_to_pb(results)
    broken.committed.pop()
    with pytest.raises(ValueError, match="column"):
        results_from_pb(broken)
    assert not packable(CycleResult(committed=[4], drafted=1, accepted=0, source="suffix", rescued_pairs=((4, 2),)))
    assert not packable(
        CycleResult(committed=[4], drafted=0, accepted=0, source="x", logprobs=(TokenLogprob(4, -0.5),))
    )
    assert not packable(
        CycleResult(committed=[4], drafted=0, accepted=0, source="x", prompt_logprobs=(TokenLogprob(4, -0.5),))
    )
