"""TLS, mutual TLS and bearer-token auth on the public API, with a throw-away CA."""
import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ServerConfig
from services.common.security import TLSConfig, channel_credentials
from services.router.server import build_server
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


def _cert(subject: str, issuer_cert, issuer_key, key, ca: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(issuer_cert.subject if issuer_cert else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
    return b.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("specmesh-test-ca", None, None, ca_key, ca=True)
    out = {}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"specmesh-{name}", ca, ca_key, key)
        (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
        (d / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[name] = (d / f"{name}.crt", d / f"{name}.key")
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out["ca"] = d / "ca.crt"
    return out


def serve(engine, pki, mtls: bool):
    cert, key = pki["server"]
    cfg = ServerConfig(port=0, metrics_port=0, tls_cert=cert, tls_key=key,
                       tls_client_ca=pki["ca"] if mtls else None, auth_token=TOKEN)
    server, _, port = build_server(engine, cfg)
    server.start()
    return server, f"localhost:{port}"


def generate(ch, token=None):
    md = [("authorization", f"Bearer {token}")] if token else None
    return list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="def f():", max_new_tokens=4),
                                                    timeout=10, metadata=md))


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
