"""Transport security and authentication settings for every specmesh endpoint (the gRPC
mechanics, credentials and the interceptor, are in ``grpc_server``).

- TLS: a server certificate + key; with ``client_ca`` set the server requires client
  certificates signed by it (mutual TLS between internal services).
- Bearer token: ``authorization: Bearer <token>`` metadata checked in constant time on every
  method except health checks (Kubernetes probes carry no token); a missing or wrong token
  is UNAUTHENTICATED. Plaintext without a token stays the default only for loopback use.
- Internal token: a secret shared by the router and the internal services (verifier, drafter,
  predictor, memory), read from the file SPECMESH_INTERNAL_TOKEN_FILE names: those services
  require it as their bearer token and every internal channel sends it.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("specmesh.security")


@dataclass(frozen=True)
class TLSConfig:
    cert: Path | None = None  # PEM certificate (server side, or client side for mTLS)
    key: Path | None = None
    ca: Path | None = None  # server: CA of required client certs; client: CA to trust

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


DENIED = "authorization: missing or invalid bearer token"
ADMIN_DENIED = "authorization: an admin endpoint: send the admin token (`Authorization: Bearer <admin token>`)"
ADMIN_OFF = (
    "authorization: an admin endpoint, off while the API takes a token and no admin token is set "
    "(start the server with --admin-token-file, or SPECMESH_ADMIN_TOKEN under Ray)"
)


class TokenFile:
    """Bearer tokens read from a file, and read again once the file changes (a Kubernetes Secret
    mounted as a volume is replaced in place when rotated), checked at most every ``recheck_s``:
    a rotation takes effect without a restart. One token per line: the first is the one a client
    sends (``get``), and a server accepts any (``accepted``), so two ends rotate without a window
    in which they disagree: add the new token as a second line everywhere, then make it the first,
    then drop the old one. A file that cannot be read or holds no token at start is a ValueError;
    one that becomes so later keeps the last tokens (said once in the log), so the server never
    serves open by mistake."""

    def __init__(self, path: str | Path, recheck_s: float = 1.0):
        self.path, self.recheck_s = Path(path), recheck_s
        self._lock = threading.Lock()
        self._seen = self._signature()
        tokens = self._read()
        if tokens is None:
            raise ValueError(f"{self.path}: cannot be read, or holds no token")
        self._tokens, self._checked = tokens, time.monotonic()

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()  # (through the symlinks a mounted Secret swaps)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _read(self) -> tuple[str, ...] | None:
        try:
            lines = self.path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            return None
        return tuple(t for t in (line.strip() for line in lines) if t) or None

    def get(self) -> str:
        """The token to send (the file's first)."""
        return self.accepted()[0]

    def accepted(self) -> tuple[str, ...]:
        """Every token the file lists: a server takes any of them."""
        now = time.monotonic()
        if now - self._checked < self.recheck_s:
            return self._tokens
        with self._lock:
            self._checked = now
            seen = self._signature()
            if seen is not None and seen != self._seen:
                self._seen = seen
                tokens = self._read()
                if tokens is None:
                    log.warning("%s changed but holds no readable token: the last one stays", self.path)
                elif tokens != self._tokens:
                    self._tokens = tokens
                    log.info("%s: new tokens, in use from now", self.path)
            return self._tokens


Token = str | TokenFile  # a bearer token, fixed or read from a file that may be rotated


def token_value(token: Token | None) -> str | None:
    return token.get() if isinstance(token, TokenFile) else token


def admin_refusal(metadata, api_token: Token | None, admin_token: Token | None) -> tuple[bool, str] | None:
    """Why an admin call (ending other clients' requests, resetting shared caches) is refused:
    (forbidden, why), forbidden meaning no token could pass; None: allowed. It takes the admin
    token when one is set. With only an API token the admin endpoints are off, since every API
    client holds that token; an open server (no token at all) leaves them open with the rest."""
    if admin_token:
        return None if bearer_ok(metadata, admin_token) else (False, ADMIN_DENIED)
    return (True, ADMIN_OFF) if api_token else None


def bearer_ok(metadata, token: Token) -> bool:
    """``authorization: Bearer <token>`` present in ``metadata``: the scheme in any case (RFC 7235),
    the token compared in constant time with each accepted one (a token file's every line)."""
    tokens = token.accepted() if isinstance(token, TokenFile) else (token,)
    got = dict(metadata or ()).get("authorization", "")
    got = got.decode(errors="replace") if isinstance(got, bytes) else got
    scheme, _, given = got.partition(" ")
    matches = [hmac.compare_digest(given.strip().encode(), t.encode()) for t in tokens]  # each compared
    return scheme.lower() == "bearer" and any(matches)


def redacted(url: str) -> str:
    """``url`` with its password (``scheme://user:password@host``) replaced by ``***``: what logs and
    messages may show of a connection URL."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure_warning(role: str, host: str, tls: TLSConfig, token: Token | None = None) -> str | None:
    """What to say at start when an internal service (verifier, drafter, predictor, memory) listens
    beyond loopback authenticating no peer (neither mutual TLS nor the internal token); None when
    it does not."""
    if host in LOOPBACK or host.startswith("127.") or tls.ca is not None or token:
        return None
    return (
        f"{role}: listening on {host} without client authentication: any peer that reaches this port can "
        "drive it; bind to loopback, share an internal token (--internal-token-file) or require client "
        "certificates (SPECMESH_TLS_CLIENT_CA, --tls-client-ca)"
    )


INTERNAL_TOKEN_ENV = "SPECMESH_INTERNAL_TOKEN_FILE"


def internal_token() -> TokenFile | None:
    """The internal token file SPECMESH_INTERNAL_TOKEN_FILE names (re-read when rotated: servers
    accept each of its lines, clients send the first); None when unset. An empty or unreadable
    file is a ValueError: internal services never fall back to no authentication silently."""
    path = os.environ.get(INTERNAL_TOKEN_ENV)
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"internal token: cannot read {path} ({e.strerror})") from None
    if not text.strip():
        raise ValueError(f"internal token: {path} is empty")
    return TokenFile(path)
