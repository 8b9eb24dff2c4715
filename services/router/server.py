"""Public gRPC front end: `specmesh.v1.Generation/Generate` over the embedded engine.

Protobuf appears only here (`request_from_pb`, `*_to_pb`); the engine sees dataclasses.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import replace
from typing import Callable

import grpc

from services.common.config import ServerConfig
from services.common.grpc_server import build_grpc_server, run_until_signal
from services.common.security import TLSConfig
from services.common.metrics import ACTIVE_SESSIONS, QUEUE_DEPTH, REQUESTS_REJECTED
from services.common.structured import StructuredOutput
from services.common.types import SamplingParams
from services.router import openai_api as oa
from services.router.engine import Engine, Generation, GenerationRequest, InvalidRequest
from services.verifier.core import SessionCancelled
from services.verifier.server import NoReplica
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger("specmesh.router")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {"length": pb.FINISH_REASON_LENGTH, "eos": pb.FINISH_REASON_EOS, "stop": pb.FINISH_REASON_STOP,
          "abort": pb.FINISH_REASON_ABORT}


NO_DEADLINE_S = 1e8   # gRPC reports "no deadline" as the time left to the end of its clock (~3e11 years)


def client_deadline(context) -> float | None:
    """Seconds the client allows the call, or None when it set no deadline. (Passed on as is,
    gRPC's no-deadline figure overflows every timeout downstream: a Link's queue wait, a
    verifier stream's deadline.)"""
    left = context.time_remaining()
    return None if left is None or left > NO_DEADLINE_S else left


def request_from_pb(r: pb.GenerateRequest, engine: Engine) -> GenerationRequest:
    if r.prompt and r.prompt_token_ids:
        raise InvalidRequest("prompt: set either `prompt` or `prompt_token_ids`, not both")
    special = r.add_special_tokens if r.HasField("add_special_tokens") else True
    ids = list(r.prompt_token_ids) if r.prompt_token_ids else engine.encode(r.prompt, special) if r.prompt else []
    max_new = r.max_new_tokens if r.HasField("max_new_tokens") else engine.cfg.default_max_new_tokens
    return GenerationRequest(
        prompt_ids=engine.truncate(ids, r.truncate_prompt_tokens if r.HasField("truncate_prompt_tokens") else None, max_new),
        max_new_tokens=max_new,
        sampling=SamplingParams(
            temperature=r.temperature, top_p=r.top_p if r.HasField("top_p") else 1.0,
            top_k=r.top_k, seed=r.seed if r.HasField("seed") else None,
            repetition_penalty=r.repetition_penalty if r.HasField("repetition_penalty") else 1.0,
            presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
            logit_bias=tuple(sorted(r.logit_bias.items())), allowed_token_ids=tuple(r.allowed_token_ids),
            bad_words=engine.bad_word_ids(r.bad_words), min_p=r.min_p),
        stop=tuple(s for s in r.stop if s),
        stop_token_ids=tuple(r.stop_token_ids),
        include_stop_str_in_output=r.include_stop_str_in_output,
        prompt_logprobs=r.prompt_logprobs if r.HasField("prompt_logprobs") else None,
        method=r.method or engine.default_method,
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
    return pb.GenerateResponse(token_ids=step.token_ids, text=step.text, logprobs=logprobs_to_pb(step.logprobs),
                               index=index)


def logprobs_to_pb(lps) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=x.token_id, logprob=x.logprob, top_ids=[i for i, _ in x.top],
                            top_logprobs=[v for _, v in x.top]) for x in lps]


def final_to_pb(gen: Generation, index: int = 0) -> pb.GenerateResponse:
    s = gen.stats
    reason = gen.stop_reason
    stopped = {} if reason is None else {"stop_string" if isinstance(reason, str) else "stop_token_id": reason}
    return pb.GenerateResponse(
        **stopped,
        index=index,
        finish_reason=FINISH.get(gen.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(prompt_tokens=len(gen.req.prompt_ids), completion_tokens=len(gen.output_ids),
                       cached_prompt_tokens=gen.cached_tokens),
        stats=pb.SpeculationStats(
            cycles=s.cycles, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
            rescued_tokens=s.rescued_tokens, tau=s.tau, acceptance_rate=s.acceptance_rate,
            accepted_per_position=s.accepted_per_position,
            draft_s=gen.timings.draft_s, verify_s=gen.timings.verify_s),
        method=gen.req.method,
        prompt_logprobs=logprobs_to_pb(gen.prompt_logprobs),
    )


class Admission:
    """At most ``max_sessions`` streams decode at once; up to ``max_queue`` more wait for slots,
    served in order of (priority, arrival): lower priority values first, as vLLM's, and
    first come, first served among equals. Only the head of the queue takes slots, so a request
    that needs several (its n completions) is not passed over forever by later single ones.
    Beyond the queue, refuse at once."""

    def __init__(self, max_sessions: int, max_queue: int):
        self.max_sessions, self.max_queue = max_sessions, max_queue
        self._cond = threading.Condition()
        self.running = 0
        self._queue: list[tuple[int, int]] = []   # heap of (priority, ticket)
        self._tickets = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def acquire(self, context: grpc.ServicerContext, n: int = 1, priority: int = 0) -> grpc.StatusCode | None:
        """``context``: a gRPC call's, or anything with its ``is_active()`` and ``time_remaining()``
        (an HTTP request's ``_Run``).
        None when ``n`` slots (a request's completions) are taken; else why not:
        RESOURCE_EXHAUSTED (queue full), DEADLINE_EXCEEDED (the deadline passed in the queue)
        or CANCELLED."""
        with self._cond:
            if not self._queue and self.running + n <= self.max_sessions:
                self.running += n
                return None
            if len(self._queue) >= self.max_queue:
                return grpc.StatusCode.RESOURCE_EXHAUSTED
            me = (priority, next(self._tickets))
            heapq.heappush(self._queue, me)
            QUEUE_DEPTH.set(len(self._queue))
            try:
                while self._queue[0] != me or self.running + n > self.max_sessions:
                    left = context.time_remaining()
                    if left is not None and left <= 0.005:
                        return grpc.StatusCode.DEADLINE_EXCEEDED
                    if not context.is_active():
                        return grpc.StatusCode.CANCELLED
                    self._cond.wait(timeout=min(0.5, left) if left is not None else 0.5)
                self.running += n
                return None
            finally:
                self._queue.remove(me)
                heapq.heapify(self._queue)
                QUEUE_DEPTH.set(len(self._queue))
                self._cond.notify_all()   # a new head, which free slots may fit

    def release(self, n: int = 1) -> None:
        with self._cond:
            self.running -= n
            self._cond.notify_all()


def abort_target(request: pb.AbortRequest) -> str | None:
    """The request id an ``Abort`` names, None for every request."""
    if not request.abort_all and not request.request_id:
        raise InvalidRequest("request_id: the request id to abort, or abort_all: true")
    return None if request.abort_all else request.request_id


ABORT_WINDOW_S = 60.0   # an abort also ends the requests made before it that start within this time


class ActiveSessions:
    """The completions decoding now, over both front ends; ``specmesh_active_sessions`` follows.
    ``abort`` ends them by request id, or all of them; a request still queued for admission
    then is aborted as it starts (an abort holds for requests made before it, ABORT_WINDOW_S).
    ``publish(request_id, wall_time)``, when given, hears of every abort made here, for the
    other front-end replicas (``AbortLog``), whose aborts come back through ``abort(..., at=)``."""

    def __init__(self, publish: Callable[[str | None, float], None] | None = None):
        self._lock = threading.Lock()
        self._gens: dict[str, Generation] = {}
        self._aborts: dict[str | None, float] = {}   # request id (None: all) → when aborted
        self.publish = publish

    def add(self, gens) -> None:
        with self._lock:
            self._gens.update((g.req_id, g) for g in gens)
            ACTIVE_SESSIONS.set(len(self._gens))
            now = time.perf_counter()
            for g in gens:
                if any(g.timings.start < t and now - t < ABORT_WINDOW_S for t in self._aborts_of(g)):
                    g.abort()

    def _aborts_of(self, g: Generation) -> list[float]:
        """When the aborts that name ``g`` (by its request id, or all) came."""
        names = (*oa.request_ids(g.req.request_id), None)
        return [self._aborts[n] for n in names if n in self._aborts]

    def abort(self, request_id: str | None, at: float | None = None) -> int:
        """SGLang's /abort_request: end the completions of ``request_id`` (every request when
        None) before their next cycle, each answered with what it has and finish_reason
        "abort". Returns how many were decoding. ``at``: another replica's abort, made at
        this perf_counter time; it ends only the requests made before it, and is not
        published again."""
        now = time.perf_counter()
        when = now if at is None else min(at, now)
        with self._lock:
            self._aborts = {r: t for r, t in self._aborts.items() if now - t < ABORT_WINDOW_S}
            self._aborts[request_id] = max(when, self._aborts.get(request_id, when))
            hit = [g for g in self._gens.values() if g.timings.start < when or at is None
                   if request_id is None or request_id in oa.request_ids(g.req.request_id)]
        for g in hit:
            g.abort()
        if at is None and self.publish is not None:
            self.publish(request_id, time.time())
        return len(hit)

    def remove(self, gens) -> None:
        with self._lock:
            for g in gens:
                self._gens.pop(g.req_id, None)
            ACTIVE_SESSIONS.set(len(self._gens))

    def __len__(self) -> int:
        return len(self._gens)


class AbortLog:
    """Aborts made at any front-end replica, kept ABORT_WINDOW_S, for each replica to apply
    the others' (``relay``): entries (origin, request id or None for all, wall time), numbered
    from 1 in arrival order."""

    def __init__(self):
        self._entries: list[tuple[int, str, str | None, float]] = []
        self._seq = 0

    def post(self, origin: str, request_id: str | None, wall: float) -> int:
        self._seq += 1
        self._entries = [e for e in self._entries if time.time() - e[3] < ABORT_WINDOW_S]
        self._entries.append((self._seq, origin, request_id, wall))
        return self._seq

    def since(self, seq: int) -> tuple[int, list[tuple[str, str | None, float]]]:
        """The entries after ``seq``, and the newest number."""
        return self._seq, [e[1:] for e in self._entries if e[0] > seq]


def relay(entries: list[tuple[str, str | None, float]], origin: str, active: ActiveSessions) -> int:
    """Apply the aborts other replicas made (not ``origin``'s own) to ``active``, each at the
    local time it was made (wall clocks agree across nodes to well under an abort's window).
    Returns the completions ended."""
    skew = time.perf_counter() - time.time()
    return sum(active.abort(rid, at=wall + skew) for o, rid, wall in entries if o != origin)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: Engine, cfg: ServerConfig):
        self.engine = engine
        self.admission = Admission(cfg.max_sessions, cfg.max_queue)   # shared with the HTTP API
        self.active = ActiveSessions()   # shared with the HTTP API

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        try:
            target = abort_target(request)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.AbortResponse(aborted=self.active.abort(target))

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        try:
            req = replace(request_from_pb(request, self.engine), deadline_s=client_deadline(context))
            if req.n > self.admission.max_sessions:
                raise InvalidRequest(f"n: at most {self.admission.max_sessions} completions (this server's sessions)")
            completions = self.engine.generate_all(req)
        except InvalidRequest as e:
            REQUESTS_REJECTED.labels("INVALID_ARGUMENT").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refused = self.admission.acquire(context, req.n, req.priority)
        if refused is not None:
            REQUESTS_REJECTED.labels(refused.name).inc()
            context.abort(refused, "deadline passed while queued for a session slot"
                          if refused == grpc.StatusCode.DEADLINE_EXCEEDED else
                          f"server is at its limit of {self.admission.max_sessions} concurrent sessions and "
                          f"{self.admission.max_queue} queued requests; retry later")
        self.active.add(completions.gens)
        context.add_callback(completions.cancel)   # a cancelled stream stops its cycles in flight (after an end: no-op)
        steps = iter(completions)
        try:
            for i, step in steps:
                if not context.is_active():  # cancelled or past its deadline
                    log.info("request %s ended by the client", completions.gens[0].req_id)
                    return
                yield step_to_pb(step, i) if step is not None else final_to_pb(completions.gens[i], i)
        except SessionCancelled:
            log.info("request %s cancelled by the client during a cycle", completions.gens[0].req_id)
            return
        except NoReplica as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except grpc.RpcError as e:  # the verifier's status (e.g. the propagated deadline) reaches the client
            context.abort(e.code(), f"verifier: {e.details()}")
        finally:
            steps.close()  # frees the sessions and drafter state even when the client went away mid-stream
            self.active.remove(completions.gens)
            self.admission.release(req.n)


def build_server(engine: Engine, cfg: ServerConfig = ServerConfig()) -> tuple[grpc.Server, GenerationServicer, int]:
    """A ready-to-start server bound to cfg.host:cfg.port (port 0 = any free port)."""
    if cfg.vllm_metric_names:
        from services.common import vllm_metrics

        vllm_metrics.register(served_model(engine, cfg)[0])
    servicer = GenerationServicer(engine, cfg)
    tls = TLSConfig(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
    # every admitted stream and every queued request holds a handler thread; health checks need one more
    workers = max(cfg.workers, cfg.max_sessions + cfg.max_queue + 2)
    server, port = build_grpc_server(lambda s: pb_grpc.add_GenerationServicer_to_server(servicer, s), [SERVICE_NAME],
                                     cfg.host, cfg.port, workers, cfg.max_message_bytes, tls, cfg.auth_token)
    return server, servicer, port


def serve(engine: Engine, cfg: ServerConfig) -> None:
    server, servicer, port = build_server(engine, cfg)
    log.info("specmesh serving %s on %s:%d (default method %s; available: %s; metrics :%d)", SERVICE_NAME,
             cfg.host, port, engine.default_method, ", ".join(engine.methods()), cfg.metrics_port)
    print(f"specmesh: serving on {cfg.host}:{port} — try: specmesh client --addr {cfg.host}:{port} --prompt 'def add(a, b):'",
          flush=True)
    http = start_http(engine, cfg, servicer) if cfg.http_port else None
    try:
        run_until_signal(server, cfg.metrics_port, cfg.host, on_drain=http.drain if http else None)
    finally:
        if http:
            http.stop()   # streams in flight finish (up to 10 s)
    engine.close()  # flush suffix-feed outputs and correction-memory writes


def served_model(engine: Engine, cfg: ServerConfig) -> tuple[str, ...]:
    """The model's names in the HTTP API, the first also in vLLM-named metrics: the target's
    directory name by default."""
    return oa.served_names(cfg.served_model_name or engine.cfg.target.name)


def start_http(engine: Engine, cfg: ServerConfig, servicer: GenerationServicer):
    """The OpenAI-compatible HTTP API on cfg.http_port, sharing the gRPC server's admission limits."""
    from services.router.http_server import HttpServer, build_app

    names = served_model(engine, cfg)
    template = cfg.chat_template.read_text() if cfg.chat_template else None
    app = build_app(lambda: engine, servicer.admission, cfg, names, template, active=servicer.active)
    http = HttpServer(app, cfg, cfg.http_port)
    port = http.start()
    scheme = "https" if cfg.tls_cert else "http"
    print(f"specmesh: OpenAI-compatible API on {scheme}://{cfg.host}:{port}/v1 (model `{'`, `'.join(names)}`) — try: curl "
          f"{scheme}://{cfg.host}:{port}/v1/completions -H 'content-type: application/json' "
          f"-d '{{\"prompt\": \"def add(a, b):\", \"max_tokens\": 32, \"temperature\": 0}}'", flush=True)
    return http
