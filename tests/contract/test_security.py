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


def test_ray_mode_is_closed_as_services_mode_is():
    """Ray mode (the chart's default) gets what services mode has: pods on a ServiceAccount that
    mounts no API token (the head too unless KubeRay's in-tree autoscaler, which runs in it and
    calls the Kubernetes API, needs KubeRay's account); the API token (and "required") in every pod that can host an ingress
    replica, workers included; with networkPolicy.enabled, clients reach only the Serve proxies'
    ports and metrics, while the dashboard (whose Jobs API runs code) and Ray's own ports admit
    only the release's pods and, on the head, the KubeRay operator's namespace."""
    from pathlib import Path

    import helm_python as helm
    import yaml

    chart = Path(__file__).resolve().parents[2] / "deploy/helm/specmesh"
    values = {"auth": {"enabled": True, "secretName": "tok"}, "networkPolicy": {"enabled": True}}
    out = helm.Chart.load(str(chart)).render(
        {**values, "ray": {"operatorNamespace": "kuberay"}}, name="d", namespace="n"
    )
    docs = [d for name, text in out.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    rc = next(d for d in docs if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
    head_spec = rc["headGroupSpec"]["template"]["spec"]
    # in-tree autoscaling (the default): KubeRay's autoscaler in the head pod needs KubeRay's account
    assert "serviceAccountName" not in head_spec and "automountServiceAccountToken" not in head_spec
    fixed = helm.Chart.load(str(chart)).render({"ray": {"inTreeAutoscaling": False}}, name="d", namespace="n")
    fixed_rc = next(d for d in yaml.safe_load_all(fixed["specmesh/templates/rayservice.yaml"]) if d)
    assert (
        fixed_rc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"]
        is False
    )
    for spec in (head_spec, *(g["template"]["spec"] for g in rc["workerGroupSpecs"])):
        if spec is not head_spec:
            assert (
                spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == sa["metadata"]["name"]
            )
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["SPECMESH_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tok"
        assert env["SPECMESH_AUTH_REQUIRED"]["value"] == "1"
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    head, worker = policies["d-specmesh-ray-head"], policies["d-specmesh-ray-worker"]
    for policy in (head, worker):
        open_ports = {p["port"] for rule in policy["ingress"] if "from" not in rule for p in rule["ports"]}
        assert open_ports == {50051, 8000, 9400} and 8265 not in open_ports  # no dashboard for clients
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}}} in head["ingress"][1][
        "from"
    ]
    assert all("namespaceSelector" not in peer for peer in worker["ingress"][1]["from"])


def test_a_ray_ingress_without_its_required_token_refuses_to_serve(monkeypatch):
    """Fail closed: where the deployment requires a token (SPECMESH_AUTH_REQUIRED) but an
    ingress replica's node has none, the ingress does not start (its server settings cannot be
    read), rather than serve open."""
    from services.ray_app import api_token, server_config

    monkeypatch.delenv("SPECMESH_AUTH_TOKEN", raising=False)
    assert api_token() is None and server_config({}).auth_token is None  # nothing required: open
    monkeypatch.setenv("SPECMESH_AUTH_REQUIRED", "1")
    with pytest.raises(RuntimeError, match="requires a bearer token"):
        server_config({})  # what the ingress replica reads as it starts, and its HTTP app
    monkeypatch.setenv("SPECMESH_AUTH_TOKEN", TOKEN)
    assert api_token() == server_config({}).auth_token == TOKEN


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
