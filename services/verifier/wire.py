"""The verifier's protobuf edge: ``specmesh.v1.verifier`` messages <-> the shared dataclasses
(``SessionSpec``, ``CycleRequest``, ``CycleResult``). The only module besides the verifier's
``grpc_server`` and ``client`` that sees its generated code."""

from __future__ import annotations

from services.common.types import CycleRequest, CycleResult, Sampling, SessionSpec, TokenLogprob
from specmesh.v1 import verifier_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name


def spec_to_pb(s: SessionSpec) -> pb.Open:
    sp = s.sampling
    return pb.Open(
        session_id=s.session_id,
        prompt_ids=s.prompt_ids,
        max_new_tokens=s.max_new_tokens,
        sampling=pb.Sampling(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            repetition_penalty=sp.repetition_penalty,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            logit_bias=dict(sp.logit_bias),
            allowed_token_ids=sp.allowed_token_ids,
            bad_words=[pb.TokenIds(ids=w) for w in sp.bad_words],
            min_p=sp.min_p,
        ),
        policy=s.policy,
        model_drafter=s.model_drafter or "",
        on_demand=s.on_demand,
        max_draft=s.max_draft,
        logprobs=s.logprobs,
        cache_salt=s.cache_salt,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        generated=s.generated,
        prompt_logprobs=s.prompt_logprobs,
        grammar=s.grammar or "",
    )


def spec_from_pb(o: pb.Open) -> SessionSpec:
    sp = o.sampling
    return SessionSpec(
        prompt_ids=list(o.prompt_ids),
        max_new_tokens=o.max_new_tokens,
        sampling=Sampling(
            sp.temperature,
            sp.top_p or 1.0,
            sp.top_k,
            sp.seed if sp.HasField("seed") else None,
            sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            sp.presence_penalty,
            sp.frequency_penalty,
            tuple(sorted(sp.logit_bias.items())),
            tuple(sp.allowed_token_ids),
            tuple(tuple(w.ids) for w in sp.bad_words),
            sp.min_p,
        ),
        policy=o.policy or "lossless",
        model_drafter=o.model_drafter or None,
        on_demand=o.on_demand,
        max_draft=o.max_draft,
        session_id=o.session_id,
        logprobs=o.logprobs if o.HasField("logprobs") else None,
        cache_salt=o.cache_salt,
        ignore_eos=o.ignore_eos,
        min_tokens=o.min_tokens,
        generated=o.generated,
        prompt_logprobs=o.prompt_logprobs if o.HasField("prompt_logprobs") else None,
        grammar=o.grammar or None,
    )


def cycle_to_pb(c: CycleRequest) -> pb.Cycle:
    return pb.Cycle(
        draft_ids=c.draft_ids,
        draft_source=c.draft_source,
        draft_with=c.draft_with or "",
        budget=c.budget,
        draft_parents=c.draft_parents,
    )


def cycle_from_pb(c: pb.Cycle) -> CycleRequest:
    return CycleRequest(
        draft_ids=tuple(c.draft_ids),
        draft_source=c.draft_source or "none",
        draft_with=c.draft_with or None,
        budget=c.budget,
        draft_parents=tuple(c.draft_parents),
    )


def result_to_pb(r: CycleResult) -> pb.CycleResult:
    """Rule: a field left empty is not built (most cycles carry no log-probabilities and no
    rescued pairs, and each of a step's results is converted on its critical path)."""
    out = pb.CycleResult(
        committed=r.committed,
        drafted=r.drafted,
        accepted=r.accepted,
        source=r.source,
        rejected=r.rejected,
        draft_s=r.draft_s,
        verify_s=r.verify_s,
        gate_s=r.gate_s,
        server_s=r.server_s,
        batch_size=r.batch_size,
        cached_tokens=r.cached_tokens,
    )
    if r.rescued_pairs:
        out.rescued.extend(pb.RescuedPair(draft=d, target=t) for d, t in r.rescued_pairs)
    if r.logprobs:
        out.logprobs.extend(x.logprob for x in r.logprobs)
        out.top_ids.extend(i for x in r.logprobs for i, _ in x.top)
        out.top_logprobs.extend(v for x in r.logprobs for _, v in x.top)
    if r.prompt_logprobs:
        out.prompt_ids.extend(x.token_id for x in r.prompt_logprobs)
        out.prompt_logprobs.extend(x.logprob for x in r.prompt_logprobs)
        out.prompt_top_ids.extend(i for x in r.prompt_logprobs for i, _ in x.top)
        out.prompt_top_logprobs.extend(v for x in r.prompt_logprobs for _, v in x.top)
    return out


def result_from_pb(r: pb.CycleResult) -> CycleResult:
    """Rule: as ``result_to_pb``, an empty field is not walked."""
    return CycleResult(
        committed=list(r.committed),
        drafted=r.drafted,
        accepted=r.accepted,
        source=r.source,
        rescued_pairs=tuple((p.draft, p.target) for p in r.rescued) if r.rescued else (),
        rejected=r.rejected,
        draft_s=r.draft_s,
        verify_s=r.verify_s,
        gate_s=r.gate_s,
        server_s=r.server_s,
        batch_size=max(1, r.batch_size),
        cached_tokens=r.cached_tokens,
        logprobs=logprobs_from_pb(r.committed, r.logprobs, r.top_ids, r.top_logprobs) if r.logprobs else (),
        prompt_logprobs=(
            logprobs_from_pb(r.prompt_ids, r.prompt_logprobs, r.prompt_top_ids, r.prompt_top_logprobs)
            if r.prompt_logprobs
            else ()
        ),
    )


def logprobs_from_pb(tokens, lps, top_ids, top_lps) -> tuple[TokenLogprob, ...]:
    """Per token: its log-probability and an equal share of the flattened alternatives."""
    n = len(lps)
    k = len(top_ids) // n if n else 0
    return tuple(
        TokenLogprob(t, lp, tuple(zip(top_ids[j * k : (j + 1) * k], top_lps[j * k : (j + 1) * k])))
        for j, (t, lp) in enumerate(zip(tokens, lps))
    )


def step_to_pb(cycles: list[tuple[str, CycleRequest]]) -> pb.StepCycles:
    """A step's cycles on one link, by column (``StepCycles``)."""
    sids, counts, pcounts, sources, withs, budgets = [], [], [], [], [], []
    ids: list[int] = []
    parents: list[int] = []
    for sid, c in cycles:
        sids.append(sid)
        counts.append(len(c.draft_ids))
        ids += c.draft_ids
        pcounts.append(len(c.draft_parents))
        parents += c.draft_parents
        sources.append(c.draft_source)
        withs.append(c.draft_with or "")
        budgets.append(c.budget)
    return pb.StepCycles(
        session_ids=sids,
        draft_counts=counts,
        draft_ids=ids,
        parent_counts=pcounts,
        draft_parents=parents,
        draft_sources=sources,
        draft_with=withs,
        budgets=budgets,
    )


def step_from_pb(s: pb.StepCycles) -> list[tuple[str, CycleRequest]]:
    """``step_to_pb``'s cycles. Raises ``ValueError`` when the columns disagree in length."""
    n = len(s.session_ids)
    counts, pcounts = list(s.draft_counts), list(s.parent_counts)
    ids, parents = list(s.draft_ids), list(s.draft_parents)
    columns = (counts, pcounts, s.draft_sources, s.draft_with, s.budgets)
    if any(len(c) != n for c in columns) or sum(counts) != len(ids) or sum(pcounts) != len(parents):
        raise ValueError("step: every column must have one entry per cycle, and the counts must sum to the tokens")
    out, at, pat = [], 0, 0
    for sid, k, pk, source, with_, budget in zip(
        s.session_ids, counts, pcounts, s.draft_sources, s.draft_with, s.budgets
    ):
        req = CycleRequest(
            draft_ids=tuple(ids[at : at + k]),
            draft_source=source or "none",
            draft_with=with_ or None,
            budget=budget,
            draft_parents=tuple(parents[pat : pat + pk]),
        )
        out.append((sid, req))
        at, pat = at + k, pat + pk
    return out


def packable(r: CycleResult) -> bool:
    """Whether ``r`` fits ``StepResults`` (no rescued pairs, no log-probabilities)."""
    return not (r.rescued_pairs or r.logprobs or r.prompt_logprobs)


def results_to_pb(results: list[tuple[str, CycleResult]]) -> pb.StepResults:
    """Plain results (``packable``) by column (``StepResults``)."""
    out = pb.StepResults(session_ids=[sid for sid, _ in results])
    rs = [r for _, r in results]
    out.committed_counts.extend(len(r.committed) for r in rs)
    out.committed.extend(t for r in rs for t in r.committed)
    out.drafted.extend(r.drafted for r in rs)
    out.accepted.extend(r.accepted for r in rs)
    out.sources.extend(r.source for r in rs)
    out.rejected.extend(r.rejected for r in rs)
    out.draft_s.extend(r.draft_s for r in rs)
    out.verify_s.extend(r.verify_s for r in rs)
    out.gate_s.extend(r.gate_s for r in rs)
    out.server_s.extend(r.server_s for r in rs)
    out.batch_size.extend(r.batch_size for r in rs)
    out.cached_tokens.extend(r.cached_tokens for r in rs)
    return out


def results_from_pb(s: pb.StepResults) -> list[tuple[str, CycleResult]]:
    """``results_to_pb``'s results. Raises ``ValueError`` when the columns disagree in length."""
    n = len(s.session_ids)
    counts, committed = list(s.committed_counts), list(s.committed)
    columns = (counts, s.drafted, s.accepted, s.sources, s.rejected, s.draft_s, s.verify_s, s.gate_s, s.server_s)
    if any(len(c) != n for c in (*columns, s.batch_size, s.cached_tokens)) or sum(counts) != len(committed):
        raise ValueError("step results: every column must have one entry per result")
    out, at = [], 0
    rows = zip(s.session_ids, counts, *columns[1:], s.batch_size, s.cached_tokens)
    for sid, k, drafted, accepted, source, rejected, draft_s, verify_s, gate_s, server_s, batch, cached in rows:
        res = CycleResult(
            committed=committed[at : at + k],
            drafted=drafted,
            accepted=accepted,
            source=source,
            rejected=rejected,
            draft_s=draft_s,
            verify_s=verify_s,
            gate_s=gate_s,
            server_s=server_s,
            batch_size=max(1, batch),
            cached_tokens=cached,
        )
        out.append((sid, res))
        at += k
    return out
