"""The verifier's protobuf edge: session specs and cycle results survive the round trip."""

from services.common.types import CycleResult, Sampling, SessionSpec, TokenLogprob
from services.verifier.wire import result_from_pb, result_to_pb, spec_from_pb, spec_to_pb


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
