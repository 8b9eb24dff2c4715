"""Helpers for tests that run a fleet on loopback: verifier processes, a router over them."""

from __future__ import annotations

import os
import subprocess

import grpc

from services.assembly import verifier_command
from services.common.config import EngineConfig, ServerConfig
from services.common.grpc_server import free_port
from services.common.runtime import stop_processes
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
