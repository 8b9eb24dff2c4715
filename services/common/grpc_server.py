"""One way to build a specmesh gRPC server: explicit message limits, health, reflection."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import refusals
from services.common.security import (
    DENIED,
    TLSConfig,
    Token,
    admin_refusal,
    bearer_ok,
    internal_token,
    token_value,
)

log = logging.getLogger("specmesh.grpc")
EXEMPT = ("/grpc.health.v1.Health/Check",)  # Kubernetes probes carry no token; Watch needs one (it holds a stream)

# Each refusal's gRPC status (the HTTP edge has its own table).
STATUS_OF: dict[type[refusals.Refusal], grpc.StatusCode] = {
    refusals.Invalid: grpc.StatusCode.INVALID_ARGUMENT,
    refusals.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    refusals.Unavailable: grpc.StatusCode.UNAVAILABLE,
    refusals.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    refusals.Cancelled: grpc.StatusCode.CANCELLED,
}


def status_of(refusal: refusals.Refusal) -> grpc.StatusCode:
    """The status code a refusal gets on a gRPC edge."""
    if isinstance(refusal, Failed):
        return refusal.code
    for kind in type(refusal).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.UNKNOWN


class Failed(refusals.Refusal):
    """A peer failed with a status that is no refusal of ours (INTERNAL, UNKNOWN...): ``code`` keeps it."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def refusal_of(e: grpc.RpcError, peer: str) -> refusals.Refusal:
    """A peer's status as a refusal of ours (the inverse of ``status_of``), its message prefixed
    with ``peer``."""
    kind = next((k for k, code in STATUS_OF.items() if code == e.code()), None)
    message = f"{peer}: {e.details()}"
    return kind(message) if kind is not None else Failed(e.code(), message)


def build_grpc_server(
    register: Callable[[grpc.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    workers: int = 16,
    max_message_bytes: int = 4 * 1024 * 1024,
    tls: TLSConfig | None = None,
    auth_token: Token | None = None,
    admin: tuple[Token | None, tuple[str, ...]] = (None, ()),
) -> tuple[grpc.Server, int]:
    """A server with the services ``register`` adds, all reported SERVING; ``server.health``
    is kept for graceful shutdown. Port 0 binds any free port; the bound port is returned.
    ``tls`` (default from the environment: SPECMESH_TLS_CERT / _KEY, and SPECMESH_TLS_CLIENT_CA
    to require client certificates) serves TLS; ``auth_token`` requires a bearer token;
    ``admin`` = (token, methods): those methods take that token instead (when it is set)."""
    tls = tls if tls is not None else TLSConfig.server_from_env()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        # auth first (a refused call's bytes are never parsed), then the parse check
        interceptors=[*([BearerAuth(auth_token, *admin)] if auth_token or admin[0] else []), ParseGuard()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),  # bind exclusively: a second server on a busy port fails, not shares it
            *SERVER_KEEPALIVE,
        ],
    )
    register(server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for name in ("", *service_names):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    addr = f"{host}:{port}"
    try:
        bound = server.add_secure_port(addr, server_credentials(tls)) if tls.enabled else server.add_insecure_port(addr)
    except RuntimeError:  # gRPC's own message says only "failed to bind"
        bound = 0
    if bound == 0:
        raise PortBusy(f"cannot listen on {host}:{port}: the port is in use (or the address is not this machine's)")
    server.health = hs
    return server, bound


# Keepalive: a client pings every 10 s and drops a connection whose peer has not answered within
# 5 s (a stopped or partitioned process): its calls fail UNAVAILABLE and the caller fails over.
# (gRPC 1.85 times a keepalive ping out by ``ping_timeout_ms``, default 60 s, not by its
# ``keepalive_timeout_ms``: both are set.)
# Servers accept those pings (gRPC's default would answer more than one per 5 minutes with GOAWAY).
CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", 5_000),
]
SERVER_KEEPALIVE = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


class PortBusy(ValueError):
    """A server could not bind its address."""


def channel(addr: str, max_message_bytes: int = 4 * 1024 * 1024, tls: TLSConfig | None = None) -> grpc.Channel:
    """Client channel to an internal service; TLS (mutual when a client cert is set) from
    SPECMESH_TLS_CA and SPECMESH_TLS_CLIENT_CERT / _KEY unless ``tls`` is given."""
    opts = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *CLIENT_KEEPALIVE,
    ]
    if tls is None:
        tls = TLSConfig.from_env("SPECMESH_TLS_CLIENT_")
        tls = tls if tls.ca else TLSConfig()
    if tls.enabled:
        ch = grpc.secure_channel(addr, channel_credentials(tls), options=opts)
    else:
        ch = grpc.insecure_channel(addr, options=opts)
    token = internal_token()
    return grpc.intercept_channel(ch, SendToken(token)) if token else ch


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class SendToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Every call on the channel carries ``authorization: Bearer <token>`` (the internal token:
    a token file's first line as it is at the call, so a rotation reaches open channels)."""

    def __init__(self, token: Token):
        self._token = token

    def _with_token(self, d):
        metadata = [*(d.metadata or ()), ("authorization", f"Bearer {token_value(self._token)}")]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)


def run_until_signal(
    server: grpc.Server, metrics_port: int = 0, host: str = "127.0.0.1", grace_s: float = 10.0, on_drain=None
) -> None:
    """Start ``server`` (and /metrics); on SIGTERM/SIGINT report NOT_SERVING, call ``on_drain``
    (long-lived streams end once their work is done), drain in-flight calls for up to
    ``grace_s``, then return so the caller can flush shared state."""
    import signal
    import threading

    from prometheus_client import start_http_server

    from services.common.runtime import freeze_startup_heap

    freeze_startup_heap()
    server.start()
    if metrics_port:
        start_http_server(metrics_port, addr=host)
    done = threading.Event()

    def stop(signum, frame):
        server.health.enter_graceful_shutdown()
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    done.wait()
    if on_drain is not None:
        on_drain()
    server.stop(grace=grace_s).wait()


# -- transport security ------------------------------------------------------------------------
def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    if tls.cert is None or tls.key is None:
        raise ValueError("TLS: a server needs both a certificate and a key")
    ca = tls.ca.read_bytes() if tls.ca else None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes() if tls.ca else None,
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None,
    )


class BearerAuth(grpc.ServerInterceptor):
    def __init__(self, token: Token | None, admin_token: Token | None = None, admin_methods: tuple[str, ...] = ()):
        """``token`` (None: the API is open) for every method but health Check; ``admin_methods``
        take ``admin_token`` instead (``security.admin_refusal``: off when only ``token`` is set)."""
        if not token and not admin_token:
            raise ValueError("auth: the bearer token must not be empty")
        self._token, self._admin_token, self._admin_methods = token, admin_token, admin_methods

    def refusal(self, details) -> tuple[str, grpc.StatusCode] | None:
        """Why a call is refused (its message and status), or None."""
        if details.method.startswith(EXEMPT):
            return None
        if details.method in self._admin_methods:
            refused = admin_refusal(details.invocation_metadata, self._token, self._admin_token)
            if refused is None:
                return None
            forbidden, why = refused
            return why, grpc.StatusCode.PERMISSION_DENIED if forbidden else grpc.StatusCode.UNAUTHENTICATED
        if self._token is None or bearer_ok(details.invocation_metadata, self._token):
            return None
        return DENIED, grpc.StatusCode.UNAUTHENTICATED

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        refused = None if handler is None else self.refusal(details)
        return handler if refused is None else _deny(handler, *refused)


def handler_kind(handler) -> str:
    """Which of the four RPC shapes a method handler has."""
    return next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))


def _deny(handler, why: str = DENIED, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED):
    """A refusal that never parses the request: auth is checked before any byte is read as protobuf."""

    def abort(request, context):
        context.abort(code, why)

    make = getattr(grpc, f"{handler_kind(handler)}_rpc_method_handler")
    return make(abort, request_deserializer=lambda raw: raw, response_serializer=handler.response_serializer)


UNPARSED = object()  # a request message whose bytes did not parse


class ParseGuard(grpc.ServerInterceptor):
    """Bytes that do not parse as the method's request message are the client's error:
    INVALID_ARGUMENT naming the method, one log line, no traceback (gRPC's own answer would be
    INTERNAL with a traceback). Streaming requests are checked as they are read."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        kind = handler_kind(handler)
        behavior = getattr(handler, kind)

        def refuse(context):
            context.abort(*unparsed(details.method, context))

        if kind.startswith("unary"):

            def guarded(request, context, *callback):
                if request is UNPARSED:
                    refuse(context)
                return behavior(request, context, *callback)

            # a non-blocking method (health Watch) stays so: wrapped plainly, each of its streams
            # would hold a worker thread for as long as it is open, and 16 idle ones stop the server
            for attr in ("experimental_non_blocking", "experimental_thread_pool"):
                if hasattr(behavior, attr):
                    setattr(guarded, attr, getattr(behavior, attr))
        else:

            def guarded(requests, context, *callback):  # (streamed requests: no callback)
                def checked():
                    for r in requests:
                        if r is UNPARSED:
                            refuse(context)
                        yield r

                return behavior(checked(), context)

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            guarded,
            request_deserializer=tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse``, giving UNPARSED for bytes that do not parse (the handler refuses them)."""

    def parsed(raw: bytes):
        try:
            return parse(raw)
        except Exception:  # noqa: BLE001 - any decode failure is the same refusal
            return UNPARSED

    return parsed


def unparsed(method: str, context) -> tuple[grpc.StatusCode, str]:
    """The refusal of a request that does not parse (logged once, without a traceback)."""
    log.info("%s: a request that does not parse (%s)", method, context.peer())
    return grpc.StatusCode.INVALID_ARGUMENT, f"request: bytes that do not parse as {method}'s request message"
