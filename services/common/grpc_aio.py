"""A gRPC server on grpc.aio, for a front end whose streams wait long on their outputs: every
call is a coroutine on one event loop (a thread of its own), so a stream that waits for its next
output holds no thread. The same message limits, keepalive, TLS, bearer-token and parse checks,
health and reflection as ``grpc_server.build_grpc_server``; ``AioServer`` gives it that server's
synchronous surface (start, stop(grace).wait(), wait_for_termination, health.set and
enter_graceful_shutdown), so whoever runs a server runs this one the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from services.common.grpc_server import (
    SERVER_KEEPALIVE,
    UNPARSED,
    BearerAuth,
    PortBusy,
    handler_kind,
    server_credentials,
    tolerant,
    unparsed,
)
from services.common.security import TLSConfig, Token

log = logging.getLogger("specmesh.grpc")


class AioServer:
    """A grpc.aio server and the loop it runs on, driven from other threads as a ``grpc.Server``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, server: grpc.aio.Server, health: health_aio.HealthServicer):
        self.loop, self._server = loop, server
        self.health = _Health(self, health)
        self._stopped = threading.Event()

    def call(self, coro):
        """Run ``coro`` on the server's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def start(self) -> None:
        self.call(self._server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stop taking calls; those in flight get ``grace`` seconds (None: none). The event is set
        once the server has stopped (``stop(grace).wait()``, as a ``grpc.Server``'s)."""
        future = asyncio.run_coroutine_threadsafe(self._server.stop(grace), self.loop)
        future.add_done_callback(lambda _: self._stopped.set())
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True when ``timeout`` passed with the server still running (``grpc.Server``'s sense)."""
        return not self._stopped.wait(timeout)


class _Health:
    """The health servicer's setters, from other threads."""

    def __init__(self, server: AioServer, servicer: health_aio.HealthServicer):
        self._server, self._servicer = server, servicer

    def set(self, name: str, status) -> None:
        self._server.call(self._servicer.set(name, status))

    def enter_graceful_shutdown(self) -> None:
        self._server.call(self._servicer.enter_graceful_shutdown())


def build_aio_grpc_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    max_message_bytes: int,
    tls: TLSConfig | None = None,
    auth_token: Token | None = None,
    admin: tuple[Token | None, tuple[str, ...]] = (None, ()),
    blocking_workers: int = 16,
) -> tuple[AioServer, int]:
    """``build_grpc_server``'s server on grpc.aio. ``blocking_workers``: the loop's default
    executor, where handlers run what blocks (validation, a wait in the admission queue)."""
    tls = tls if tls is not None else TLSConfig.server_from_env()
    loop = asyncio.new_event_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(blocking_workers, "grpc-blocking"))
    threading.Thread(target=loop.run_forever, daemon=True, name="grpc-aio").start()
    auth = [AioBearerAuth(auth_token, *admin)] if auth_token or admin[0] else []

    async def build() -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
        server = grpc.aio.server(
            interceptors=[*auth, AioParseGuard()],  # auth first: a refused call's bytes are never parsed
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
                *SERVER_KEEPALIVE,
            ],
        )
        register(server)
        hs = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        for name in ("", *service_names):
            await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((*service_names, health_name, reflection.SERVICE_NAME), server)
        addr = f"{host}:{port}"
        try:
            bound = (
                server.add_secure_port(addr, server_credentials(tls)) if tls.enabled else server.add_insecure_port(addr)
            )
        except RuntimeError:  # gRPC's own message says only "failed to bind"
            bound = 0
        return server, hs, bound

    server, hs, bound = asyncio.run_coroutine_threadsafe(build(), loop).result()
    if bound == 0:
        loop.call_soon_threadsafe(loop.stop)
        raise PortBusy(f"cannot listen on {host}:{port}: the port is in use (or the address is not this machine's)")
    return AioServer(loop, server, hs), bound


class AioBearerAuth(grpc.aio.ServerInterceptor):
    """``BearerAuth``'s rule on grpc.aio."""

    def __init__(self, token: Token | None, admin_token: Token | None = None, admin_methods: tuple[str, ...] = ()):
        self._rule = BearerAuth(token, admin_token, admin_methods)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        refused = None if handler is None else self._rule.refusal(details)
        if refused is None:
            return handler
        why, code = refused

        async def abort(request, context):  # the request's bytes are never parsed
            await context.abort(code, why)

        make = getattr(grpc, f"{handler_kind(handler)}_rpc_method_handler")
        return make(abort, request_deserializer=lambda raw: raw, response_serializer=handler.response_serializer)


class AioParseGuard(grpc.aio.ServerInterceptor):
    """``ParseGuard``'s rule on grpc.aio: bytes that do not parse as the method's request are
    INVALID_ARGUMENT naming the method (gRPC's own answer: INTERNAL with a traceback)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        kind = handler_kind(handler)
        behavior = getattr(handler, kind)

        async def refuse(context):
            await context.abort(*unparsed(details.method, context))

        async def checked(requests, context):
            async for r in requests:
                if r is UNPARSED:
                    await refuse(context)
                yield r

        guarded: Callable
        if kind == "unary_unary":

            async def guarded(request, context):
                if request is UNPARSED:
                    await refuse(context)
                return await _result(behavior(request, context))

        elif kind == "unary_stream":

            async def guarded(request, context):
                if request is UNPARSED:
                    await refuse(context)
                async for r in _stream(behavior(request, context)):
                    yield r

        elif kind == "stream_unary":

            async def guarded(requests, context):
                return await _result(behavior(checked(requests, context), context))

        else:

            async def guarded(requests, context):
                async for r in _stream(behavior(checked(requests, context), context)):
                    yield r

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        deserializer = tolerant(handler.request_deserializer)
        return make(guarded, request_deserializer=deserializer, response_serializer=handler.response_serializer)


async def _result(out):
    """A unary handler's answer, whether it was written as a coroutine or a plain function."""
    return await out if inspect.isawaitable(out) else out


async def _stream(out):
    """A streaming handler's messages: an async generator's, or none from a coroutine that
    writes them itself (``context.write``, as health's Watch)."""
    if inspect.isasyncgen(out):
        async for r in out:
            yield r
    elif inspect.isawaitable(out):
        await out
    else:
        for r in out:
            yield r
