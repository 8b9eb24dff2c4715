"""The public gRPC front end: `specmesh.v1.Generation` (Generate, Abort) over an ``Engine``:
admission to session slots, the client's deadline and cancellation, refusals as status codes.
Conversions are in ``wire``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2

from services.common.config import ServerConfig
from services.common.grpc_aio import AioServer, build_aio_grpc_server
from services.common.grpc_server import status_of
from services.common.metrics import REQUESTS_REJECTED
from services.common.refusals import Refusal
from services.common.security import DENIED, TLSConfig, admin_refusal, bearer_ok
from services.common.types import SessionCancelled
from services.router import openai_api as oa
from services.router.admission import ActiveSessions, Admission, check_completions
from services.router.engine import Completions, Engine, InvalidRequest
from services.router.wire import SERVICE_NAME, abort_target, final_to_pb, request_from_pb, step_to_pb
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger("specmesh.router")

NO_DEADLINE_S = 1e8  # gRPC reports "no deadline" as the time left to the end of its clock (~3e11 years)


def client_deadline(context) -> float | None:
    """Seconds the client allows the call, or None when it set no deadline. (Passed on as is,
    gRPC's no-deadline figure overflows every timeout downstream: a Link's queue wait, a
    verifier stream's deadline.)"""
    left = context.time_remaining()
    return None if left is None or left > NO_DEADLINE_S else left


class GenerationServicer(pb_grpc.GenerationServicer):
    """On grpc.aio (``build_server``): a stream's validation and its wait for admission run on
    the loop's workers, its decoding on the loop itself (``Completions.stream``), so a stream
    that waits for its next output holds no thread."""

    def __init__(self, engine: Engine, cfg: ServerConfig):
        self.engine = engine
        self.stats = cfg.response_stats  # speculation stats and cached tokens in final messages
        self.admission = Admission(cfg.max_sessions, cfg.max_queue)  # shared with the HTTP API
        self.active = ActiveSessions()  # shared with the HTTP API

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            target = abort_target(request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.AbortResponse(aborted=self.active.abort(target))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:  # tokenizing and checking take time: on a worker, not on the loop
            req = replace(
                await asyncio.to_thread(request_from_pb, request, self.engine), deadline_s=client_deadline(context)
            )
            check_completions(req.n, self.admission.max_sessions)
            completions = await asyncio.to_thread(self.engine.generate_all, req)
        except InvalidRequest as e:
            REQUESTS_REJECTED.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refused = await self._admitted(context, completions, req)
        if refused is not None:
            REQUESTS_REJECTED.labels(status_of(refused).name).inc()
            await context.abort(status_of(refused), str(refused))
        self.active.add(completions.gens)
        try:
            async with contextlib.aclosing(completions.stream()) as steps:
                async for i, step in steps:
                    yield step_to_pb(step, i) if step is not None else final_to_pb(completions.gens[i], i, self.stats)
        except SessionCancelled:
            log.info("request %r cancelled by the client during a cycle", completions.gens[0].req_id)
        except asyncio.CancelledError:  # the client went away, or its deadline passed
            log.info("request %r ended by the client", completions.gens[0].req_id)
            raise
        except Refusal as e:  # no live verifier, or a verifier's own status (e.g. the propagated deadline)
            await context.abort(status_of(e), str(e))
        finally:  # its sessions closed, then its slots given back, even when the client went away mid-stream
            await asyncio.shield(asyncio.to_thread(self._release, completions, req.n))

    async def _admitted(self, context, completions: Completions, req) -> Refusal | None:
        """``_admit`` on a worker. A client that leaves while it waits there has its call
        cancelled here: the wait ends (``_Client``), and slots it may still be granted go back."""
        admit = asyncio.ensure_future(asyncio.to_thread(self._admit, _Client(context), completions, req))
        try:
            return await asyncio.shield(admit)
        except asyncio.CancelledError:
            admit.add_done_callback(lambda f: self._give_back(f, req.n))
            raise

    def _give_back(self, admit: asyncio.Future, n: int) -> None:
        if not admit.cancelled() and admit.exception() is None and admit.result() is None:
            self.admission.release(n)

    def _admit(self, client: "_Client", completions: Completions, req) -> Refusal | None:
        """A worker's part of a stream's start: its slots (maybe after a wait in the queue), then
        its grammar, once it holds them."""
        refused = self.admission.acquire(client, req.n, req.priority)
        if refused is None:
            try:
                completions.prepare()
            except Refusal as e:
                self.admission.release(req.n)
                refused = e
        return refused

    def _release(self, completions: Completions, n: int) -> None:
        completions.close()  # stop every completion still running; wait for its session to close
        self.active.remove(completions.gens)
        self.admission.release(n)


class _Client:
    """A stream's client as the admission queue asks about it (``admission.Waiter``), from a
    worker thread: gone once its call is done, with its deadline's time left."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self._gone = threading.Event()
        left = client_deadline(context)
        self._until = None if left is None else time.monotonic() + left
        context.add_done_callback(lambda _: self._gone.set())

    def is_active(self) -> bool:
        return not self._gone.is_set()

    def time_remaining(self) -> float | None:
        return None if self._until is None else self._until - time.monotonic()


def count_engine(engine: Engine, max_sessions: int) -> None:
    """The metrics that describe this engine from the start: its methods' series at 0, and for a
    verifier in this process, one live replica and its K/V capacity."""
    from services.common import metrics

    metrics.known_methods(engine.methods())
    if hasattr(engine.verifier, "declare_capacity"):  # in process (VerifierCore)
        engine.verifier.declare_capacity(max_sessions)
        metrics.VERIFIERS_LIVE.labels("router").set(1)


def build_server(engine: Engine, cfg: ServerConfig = ServerConfig()) -> tuple[AioServer, GenerationServicer, int]:
    """A ready-to-start server bound to cfg.host:cfg.port (port 0 = any free port), on grpc.aio."""
    count_engine(engine, cfg.max_sessions)
    if cfg.vllm_metric_names:
        from services.common import vllm_metrics

        vllm_metrics.register(oa.served_model(engine, cfg)[0])
    servicer = GenerationServicer(engine, cfg)
    tls = TLSConfig(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
    # the streams decode on the loop; a thread only for what blocks: validation and the admission queue
    server, port = build_aio_grpc_server(
        lambda s: pb_grpc.add_GenerationServicer_to_server(servicer, s),
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        cfg.max_message_bytes,
        tls,
        cfg.auth_token,
        (cfg.admin_token, (f"/{SERVICE_NAME}/Abort",)),
        blocking_workers=max(cfg.workers, cfg.max_queue + 4),
    )
    if hasattr(engine.verifier, "live"):  # remote replicas: health says whether any answers
        threading.Thread(
            target=_follow_replicas, args=(server, engine.verifier), daemon=True, name="health-replicas"
        ).start()
    return server, servicer, port


HEALTH_PERIOD_S = 2.0


def _follow_replicas(server: AioServer, verifier) -> None:
    """gRPC health: SERVING while a verifier replica answers, NOT_SERVING while none does (a
    load balancer then sends requests elsewhere); checked every HEALTH_PERIOD_S until the server
    stops. (During a graceful shutdown the health servicer keeps NOT_SERVING whatever is set.)"""
    serving = True
    while server.wait_for_termination(HEALTH_PERIOD_S):  # True: still running after the period
        live = verifier.live() > 0
        if live != serving:
            status = health_status(live).status
            for name in ("", SERVICE_NAME):
                server.health.set(name, status)
            log.warning("verifier replicas: %s", "one answers again" if live else "none answers; health NOT_SERVING")
            serving = live


# -- the same API under Ray Serve's gRPC proxy (services/ray_app.py): no interceptors, and a
# status set on the context survives only if the handler then raises.
def refuse_under_serve(context, e: Refusal) -> NoReturn:
    context.set_code(status_of(e))
    context.set_details(str(e))
    raise e


def check_token_under_serve(context, token: str | None) -> None:
    """Serve's proxy runs no interceptors: the bearer token is checked by the handler."""
    if token and not bearer_ok(context.invocation_metadata(), token):
        context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        context.set_details(DENIED)
        raise PermissionError(DENIED)


def check_admin_under_serve(context, api_token: str | None, admin_token: str | None) -> None:
    """An admin method under Serve (no interceptors): ``security.admin_refusal``'s rule."""
    if refused := admin_refusal(context.invocation_metadata(), api_token, admin_token):
        forbidden, why = refused
        context.set_code(grpc.StatusCode.PERMISSION_DENIED if forbidden else grpc.StatusCode.UNAUTHENTICATED)
        context.set_details(why)
        raise PermissionError(why)


def health_status(serving: bool):
    """``grpc.health.v1.Health/Check``'s answer: SERVING or NOT_SERVING."""
    S = health_pb2.HealthCheckResponse
    return S(status=S.SERVING if serving else S.NOT_SERVING)
