"""Transport security and authentication for every specmesh gRPC endpoint.

- TLS: a server certificate + key; with ``client_ca`` set the server requires client
  certificates signed by it (mutual TLS between internal services).
- Bearer token: ``authorization: Bearer <token>`` metadata checked in constant time on every
  method except health checks (Kubernetes probes carry no token); a missing or wrong token
  is UNAUTHENTICATED. Plaintext without a token stays the default only for loopback use.
"""
from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

EXEMPT = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class TLSConfig:
    cert: Path | None = None           # PEM certificate (server side, or client side for mTLS)
    key: Path | None = None
    ca: Path | None = None             # server: CA of required client certs; client: CA to trust

    @classmethod
    def from_env(cls, prefix: str = "SPECMESH_TLS_") -> "TLSConfig":
        """Client side: trust SPECMESH_TLS_CA; present ``{prefix}CERT`` / ``KEY`` when set."""
        get = lambda k: Path(os.environ[k]) if os.environ.get(k) else None  # noqa: E731
        return cls(get(prefix + "CERT"), get(prefix + "KEY"), get("SPECMESH_TLS_CA"))

    @classmethod
    def server_from_env(cls) -> "TLSConfig":
        """Server side: SPECMESH_TLS_CERT / _KEY; SPECMESH_TLS_CLIENT_CA requires client certificates."""
        get = lambda k: Path(os.environ[k]) if os.environ.get(k) else None  # noqa: E731
        return cls(get("SPECMESH_TLS_CERT"), get("SPECMESH_TLS_KEY"), get("SPECMESH_TLS_CLIENT_CA"))

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    if tls.cert is None or tls.key is None:
        raise ValueError("TLS: a server needs both a certificate and a key")
    ca = tls.ca.read_bytes() if tls.ca else None
    return grpc.ssl_server_credentials([(tls.key.read_bytes(), tls.cert.read_bytes())], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes() if tls.ca else None,
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None)


DENIED = "authorization: missing or invalid bearer token"


def bearer_ok(metadata, token: str) -> bool:
    """``authorization: Bearer <token>`` present in ``metadata`` (constant-time comparison)."""
    got = dict(metadata or ()).get("authorization", "")
    got = got.encode() if isinstance(got, str) else got
    return hmac.compare_digest(got, f"Bearer {token}".encode())


class BearerAuth(grpc.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("auth: the bearer token must not be empty")
        self._token = token

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(EXEMPT) or bearer_ok(details.invocation_metadata, self._token):
            return handler
        return _deny(handler)


def _deny(handler):
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
            else "stream_unary" if handler.stream_unary else "stream_stream")
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(abort, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class TokenCredentials(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self.token = token

    def __call__(self, context, callback):
        callback((("authorization", f"Bearer {self.token}"),), None)
