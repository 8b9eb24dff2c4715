"""One way to build a specmesh gRPC server: explicit message limits, health, reflection."""
from __future__ import annotations

from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def build_grpc_server(register: Callable[[grpc.Server], None], service_names: list[str], host: str, port: int,
                      workers: int = 16, max_message_bytes: int = 4 * 1024 * 1024) -> tuple[grpc.Server, int]:
    """A server with the services ``register`` adds, all reported SERVING; ``server.health``
    is kept for graceful shutdown. Port 0 binds any free port; the bound port is returned."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.max_receive_message_length", max_message_bytes),
                                  ("grpc.max_send_message_length", max_message_bytes)])
    register(server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for name in ("", *service_names):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    server.health = hs
    return server, bound


def channel(addr: str, max_message_bytes: int = 4 * 1024 * 1024) -> grpc.Channel:
    return grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", max_message_bytes),
                                                ("grpc.max_send_message_length", max_message_bytes)])
