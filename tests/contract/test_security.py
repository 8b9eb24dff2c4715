"""TLS, mutual TLS and bearer-token auth on the public API, with a throw-away CA."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ServerConfig
from services.common.grpc_server import channel_credentials
from services.common.security import TLSConfig
from services.router.grpc_server import build_server
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


def serve(engine, pki, mtls: bool):
    cert, key = pki["server"]
    cfg = ServerConfig(
        port=0, metrics_port=0, tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"] if mtls else None, auth_token=TOKEN
    )
    server, _, port = build_server(engine, cfg)
    server.start()
    return server, f"localhost:{port}"


def generate(ch, token=None):
    md = [("authorization", f"Bearer {token}")] if token else None
    return list(
        pb_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt="def f():", max_new_tokens=4), timeout=10, metadata=md
        )
    )


def test_tls_and_token(tiny_engine, pki):
    server, addr = serve(tiny_engine, pki, mtls=False)
    try:
        with grpc.secure_channel(addr, channel_credentials(TLSConfig(ca=pki["ca"]))) as ch:
            assert generate(ch, TOKEN)[-1].finish_reason == pb.FINISH_REASON_LENGTH
            for bad in (None, "wrong"):
                with pytest.raises(grpc.RpcError) as e:
                    generate(ch, bad)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in e.value.details()
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
        with grpc.insecure_channel(addr) as plain:
            with pytest.raises(grpc.RpcError) as e:
                generate(plain, TOKEN)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # plaintext is refused
    finally:
        server.stop(0)


def test_mutual_tls_requires_client_certificate(tiny_engine, pki):
    server, addr = serve(tiny_engine, pki, mtls=True)
    try:
        with grpc.secure_channel(addr, channel_credentials(TLSConfig(ca=pki["ca"]))) as no_cert:
            with pytest.raises(grpc.RpcError) as e:
                generate(no_cert, TOKEN)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        cert, key = pki["client"]
        with grpc.secure_channel(addr, channel_credentials(TLSConfig(cert, key, pki["ca"]))) as ch:
            assert generate(ch, TOKEN)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        server.stop(0)


def test_ray_ingress_checks_the_token_itself(monkeypatch):
    """Serve's gRPC proxy runs no interceptors: the ingress deployment refuses a bad token
    before touching the engine, with UNAUTHENTICATED kept by setting the code then raising."""
    from services.ray_app import GenerationIngress

    class Ctx:
        def __init__(self, md):
            self.md, self.code = md, None

        def invocation_metadata(self):
            return self.md

        def set_code(self, c):
            self.code = c

        def set_details(self, d):
            self.details = d

    monkeypatch.setenv("SPECMESH_AUTH_TOKEN", TOKEN)
    ingress = GenerationIngress.func_or_class.__new__(GenerationIngress.func_or_class)
    for md in ([], [("authorization", "Bearer nope")]):
        ctx = Ctx(md)
        with pytest.raises(PermissionError):
            asyncio.run(anext(ingress.Generate(pb.GenerateRequest(prompt="x"), ctx)))
        assert ctx.code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in ctx.details
        ctx = Ctx(md)
        with pytest.raises(PermissionError):
            ingress.Abort(pb.AbortRequest(abort_all=True), ctx)
        assert ctx.code == grpc.StatusCode.PERMISSION_DENIED and "no admin token" in ctx.details
    ctx = Ctx([("authorization", f"Bearer {TOKEN}")])  # the API's token does not open an admin method
    with pytest.raises(PermissionError):
        ingress.Abort(pb.AbortRequest(abort_all=True), ctx)
    assert ctx.code == grpc.StatusCode.PERMISSION_DENIED


def test_chart_passes_the_token_to_the_ray_head():
    from pathlib import Path

    import helm_python as helm
    import yaml

    chart = Path(__file__).resolve().parents[2] / "deploy/helm/specmesh"
    auth = {"enabled": True, "secretName": "tok", "adminSecretName": "admin"}
    out = helm.Chart.load(str(chart)).render({"auth": auth}, name="d", namespace="n")
    rs = next(d for d in yaml.safe_load_all(out["specmesh/templates/rayservice.yaml"]) if d)
    env = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "SPECMESH_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "token"}}} in env
    assert {"name": "SPECMESH_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "token"}}} in env
    services = helm.Chart.load(str(chart)).render({"mode": "services", "auth": auth}, name="d", namespace="n")
    router = next(
        d
        for d in yaml.safe_load_all(services["specmesh/templates/services.yaml"])
        if d and d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")
    )
    env = router["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "SPECMESH_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "token"}}} in env


def raw_generate(addr: str, blob: bytes, token: str | None = None):
    """Raw bytes as a Generate request (no protobuf on the client side)."""
    md = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(addr) as ch:
        call = ch.unary_stream(
            "/specmesh.v1.Generation/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        return list(call(blob, timeout=20, metadata=md))


def test_bytes_that_do_not_parse_are_invalid_argument_after_auth(tiny_engine, caplog):
    """Auth is checked before any byte is parsed (no token: UNAUTHENTICATED, whatever the bytes);
    with the token, bytes that do not parse are INVALID_ARGUMENT naming the method, logged as
    one line without a traceback (gRPC's own answer is INTERNAL and a traceback)."""
    cfg = ServerConfig(port=0, metrics_port=0, auth_token=TOKEN)
    server, _, port = build_server(tiny_engine, cfg)
    server.start()
    garbage = b"\xff\x00\x13garbage"
    try:
        with pytest.raises(grpc.RpcError) as e:
            raw_generate(f"127.0.0.1:{port}", garbage)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with caplog.at_level("INFO"), pytest.raises(grpc.RpcError) as e:
            raw_generate(f"127.0.0.1:{port}", garbage, TOKEN)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "/specmesh.v1.Generation/Generate" in e.value.details()
        assert "Traceback" not in caplog.text and "deserializ" not in caplog.text.lower()
    finally:
        server.stop(0)
