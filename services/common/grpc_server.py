"""One way to build a specmesh gRPC server: explicit message limits, health, reflection."""
from __future__ import annotations

from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.security import BearerAuth, TLSConfig, channel_credentials, server_credentials


def build_grpc_server(register: Callable[[grpc.Server], None], service_names: list[str], host: str, port: int,
                      workers: int = 16, max_message_bytes: int = 4 * 1024 * 1024, tls: TLSConfig | None = None,
                      auth_token: str | None = None) -> tuple[grpc.Server, int]:
    """A server with the services ``register`` adds, all reported SERVING; ``server.health``
    is kept for graceful shutdown. Port 0 binds any free port; the bound port is returned.
    ``tls`` (default from the environment: SPECMESH_TLS_CERT / _KEY, and SPECMESH_TLS_CLIENT_CA
    to require client certificates) serves TLS; ``auth_token`` requires a bearer token."""
    tls = tls if tls is not None else TLSConfig.server_from_env()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         interceptors=[BearerAuth(auth_token)] if auth_token else [],
                         options=[("grpc.max_receive_message_length", max_message_bytes),
                                  ("grpc.max_send_message_length", max_message_bytes)])
    register(server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for name in ("", *service_names):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    addr = f"{host}:{port}"
    bound = server.add_secure_port(addr, server_credentials(tls)) if tls.enabled else server.add_insecure_port(addr)
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    server.health = hs
    return server, bound


def channel(addr: str, max_message_bytes: int = 4 * 1024 * 1024, tls: TLSConfig | None = None) -> grpc.Channel:
    """Client channel to an internal service; TLS (mutual when a client cert is set) from
    SPECMESH_TLS_CA and SPECMESH_TLS_CLIENT_CERT / _KEY unless ``tls`` is given."""
    opts = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
    if tls is None:
        tls = TLSConfig.from_env("SPECMESH_TLS_CLIENT_")
        tls = tls if tls.ca else TLSConfig()
    if tls.enabled:
        return grpc.secure_channel(addr, channel_credentials(tls), options=opts)
    return grpc.insecure_channel(addr, options=opts)


def run_until_signal(server: grpc.Server, metrics_port: int = 0, host: str = "127.0.0.1", grace_s: float = 10.0,
                     on_drain=None) -> None:
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (tests, benchmarks, local multi-process topologies)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
