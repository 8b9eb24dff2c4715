"""Helpers for tests that run a fleet on loopback: verifier processes, a router over them."""

from __future__ import annotations

import contextlib
import os
import subprocess

import grpc

from services.assembly import verifier_command
from services.common.config import EngineConfig, ServerConfig
from services.common.runtime import free_port, stop_processes
from services.router.engine import Engine
from services.router.grpc_server import build_server
from services.verifier.client import RemoteVerifier
from specmesh.v1 import generate_pb2 as gpb
from specmesh.v1 import generate_pb2_grpc as ggrpc
from specmesh.v1 import verifier_pb2 as vpb
from specmesh.v1 import verifier_pb2_grpc as vgrpc


def start_verifier(tiny_dirs, delay_ms: int = 0, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A verifier process over the tiny pair on a free port, once it accepts connections."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECMESH_FAULT_CYCLE_DELAY_MS": str(delay_ms), **(env or {})}
    proc = subprocess.Popen(
        verifier_command(port, {"target": tiny_dirs[0], "draft": tiny_dirs[1]}, max_sessions=16),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    addr = f"127.0.0.1:{port}"
    with grpc.insecure_channel(addr) as ch:
        grpc.channel_ready_future(ch).result(timeout=90)
    return proc, addr


def stop(procs):
    """Graceful exit is asserted in test_cli; here a slow exit on a loaded machine is not an error."""
    stop_processes(procs)


def router(tiny_dirs, addrs, link=True, **pool):
    """A router (gRPC server on a free port) over verifier ``addrs``: (engine, server, servicer, stub)."""
    cfg = EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, max_new_tokens_limit=200)
    engine = Engine(cfg, verifier=RemoteVerifier(addrs, link=link, **pool))
    server, servicer, port = build_server(engine, ServerConfig(port=0, max_sessions=32, metrics_port=0))
    server.start()
    return engine, server, servicer, ggrpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def stream_ids(stub, prompt, n, method, timeout=60):
    msgs = list(stub.Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=n, method=method), timeout=timeout))
    assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
    return [t for m in msgs for t in m.token_ids]


def active(addr) -> int:
    """Sessions open on the verifier at ``addr``."""
    with grpc.insecure_channel(addr) as ch:
        return vgrpc.VerifierStub(ch).Info(vpb.InfoRequest(), timeout=10).active_sessions


@contextlib.contextmanager
def ray_serve(app_args: dict, env: dict[str, str] | None = None):
    """The Ray Serve app (``services.ray_app:app``) on a fresh local Ray of 2 CPUs, with gRPC (the
    Generation and Health services) and HTTP proxies on free ports; yields (gRPC channel, gRPC
    port, HTTP port). ``env``: more environment variables for every Ray worker (its replicas)."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from services.ray_app import app

    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "180")  # a loaded 2-core machine starts GCS slowly
    port, http_port = free_port(), free_port()
    # Ray gives its raylet a fixed 30 s to register, and a loaded 2-core box can miss it; its GCS
    # server once wrote no port file at all (no log either) and started at the next try.
    for attempt in range(2):
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **(env or {})}},
            )
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for the raylet's
            ray.shutdown()
            if attempt or not any(m in str(e) for m in ("timed out during startup", "Timed out waiting for file")):
                raise
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options=gRPCOptions(
                port=port,
                grpc_servicer_functions=[
                    "specmesh.v1.generate_pb2_grpc.add_GenerationServicer_to_server",
                    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
                ],
            ),
        )
        serve.run(app(app_args), name="specmesh", route_prefix="/")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield channel, port, http_port
        finally:
            channel.close()
    finally:
        serve.shutdown()
        ray.shutdown()
