"""The public API's protobuf edge: ``specmesh.v1.GenerateRequest`` -> ``GenerationRequest`` and
each step / final answer -> ``GenerateResponse``. The only module besides the router's
``grpc_server`` and ``client`` that sees the generated code."""

from __future__ import annotations

from typing import Any

from services.common.structured import StructuredOutput
from services.common.types import Sampling
from services.router.engine import Engine, Generation, GenerationRequest, InvalidRequest
from specmesh.v1 import generate_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "abort": pb.FINISH_REASON_ABORT,
}


def request_from_pb(r: pb.GenerateRequest, engine: Engine) -> GenerationRequest:
    if r.prompt and r.prompt_token_ids:
        raise InvalidRequest("prompt: set either `prompt` or `prompt_token_ids`, not both")
    special = r.add_special_tokens if r.HasField("add_special_tokens") else True
    ids = list(r.prompt_token_ids) if r.prompt_token_ids else engine.encode(r.prompt, special) if r.prompt else []
    max_new = r.max_new_tokens if r.HasField("max_new_tokens") else engine.cfg.default_max_new_tokens
    return GenerationRequest(
        prompt_ids=engine.truncate(
            ids, r.truncate_prompt_tokens if r.HasField("truncate_prompt_tokens") else None, max_new
        ),
        max_new_tokens=max_new,
        sampling=Sampling(
            temperature=r.temperature,
            top_p=r.top_p if r.HasField("top_p") else 1.0,
            top_k=r.top_k,
            seed=r.seed if r.HasField("seed") else None,
            repetition_penalty=r.repetition_penalty if r.HasField("repetition_penalty") else 1.0,
            presence_penalty=r.presence_penalty,
            frequency_penalty=r.frequency_penalty,
            logit_bias=tuple(sorted(r.logit_bias.items())),
            allowed_token_ids=tuple(r.allowed_token_ids),
            bad_words=engine.bad_word_ids(r.bad_words),
            min_p=r.min_p,
        ),
        stop=tuple(s for s in r.stop if s),
        stop_token_ids=tuple(r.stop_token_ids),
        include_stop_str_in_output=r.include_stop_str_in_output,
        prompt_logprobs=r.prompt_logprobs if r.HasField("prompt_logprobs") else None,
        method=r.method,
        request_id=r.request_id,
        logprobs=r.logprobs if r.HasField("logprobs") else None,
        cache_salt=r.cache_salt,
        ignore_eos=r.ignore_eos,
        min_tokens=r.min_tokens,
        structured=structured_from_pb(r.structured_output) if r.HasField("structured_output") else None,
        n=r.n if r.HasField("n") else 1,
        priority=r.priority,
        skip_special_tokens=r.skip_special_tokens if r.HasField("skip_special_tokens") else True,
    )


def structured_from_pb(s: pb.StructuredOutput) -> StructuredOutput:
    kind = s.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("structured_output: set one of json_schema, regex, choice, json_object")
    if kind == "choice":
        return StructuredOutput(choice=tuple(s.choice.values))
    return StructuredOutput(**{kind: getattr(s, kind)})


def step_to_pb(step, index: int = 0) -> pb.GenerateResponse:
    """One cycle's output of completion ``index``: new tokens, new text and, when asked, the
    tokens' log-probabilities."""
    return pb.GenerateResponse(
        token_ids=step.token_ids, text=step.text, logprobs=logprobs_to_pb(step.logprobs), index=index
    )


def logprobs_to_pb(lps) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=x.token_id, logprob=x.logprob, top_ids=[i for i, _ in x.top], top_logprobs=[v for _, v in x.top]
        )
        for x in lps
    ]


def final_to_pb(gen: Generation, index: int = 0, stats: bool = False) -> pb.GenerateResponse:
    """A completion's last message; ``stats``: with its speculation stats and cached prompt
    tokens (the server's --response-stats)."""
    s = gen.stats
    reason = gen.stop_reason
    stopped: dict[str, Any] = (
        {} if reason is None else {"stop_string" if isinstance(reason, str) else "stop_token_id": reason}
    )
    return pb.GenerateResponse(
        **stopped,
        index=index,
        finish_reason=FINISH.get(gen.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(
            prompt_tokens=len(gen.req.prompt_ids),
            completion_tokens=len(gen.output_ids),
            cached_prompt_tokens=gen.cached_tokens if stats else 0,
        ),
        stats=None
        if not stats
        else pb.SpeculationStats(
            cycles=s.cycles,
            draft_tokens=s.draft_tokens,
            accepted_tokens=s.accepted_tokens,
            rescued_tokens=s.rescued_tokens,
            tau=s.tau,
            acceptance_rate=s.acceptance_rate,
            accepted_per_position=s.accepted_per_position,
            draft_s=gen.timings.draft_s,
            verify_s=gen.timings.verify_s,
        ),
        method=gen.req.method,
        prompt_logprobs=logprobs_to_pb(gen.prompt_logprobs),
    )


def abort_target(request: pb.AbortRequest) -> str | None:
    """The request id an ``Abort`` names, None for every request."""
    if not request.abort_all and not request.request_id:
        raise InvalidRequest("request_id: the request id to abort, or abort_all: true")
    return None if request.abort_all else request.request_id


def abort_response(aborted: int) -> pb.AbortResponse:
    return pb.AbortResponse(aborted=aborted)
