"""Redis over TLS with a private CA (rediss:// + SPECMESH_REDIS_CA), against a real redis-server."""

import socket
import subprocess
import time

import pytest

from services.memory.redis_link import RedisLink, RedisUnavailable


@pytest.fixture
def tls_redis(pki):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cert, key = pki["server"]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(pki["ca"]),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    yield f"rediss://localhost:{port}/0"
    proc.terminate()
    proc.wait(10)


def test_rediss_with_private_ca(tls_redis, pki, monkeypatch):
    monkeypatch.setenv("SPECMESH_REDIS_CA", str(pki["ca"]))
    link = RedisLink(tls_redis, "test", timeout_s=2)
    for _ in range(20):
        try:
            assert link.call(lambda r: r.ping())
            break
        except RedisUnavailable:
            time.sleep(link.seconds_to_retry() + 0.05)
    else:
        pytest.fail("TLS Redis never answered")
    monkeypatch.delenv("SPECMESH_REDIS_CA")
    untrusted = RedisLink(tls_redis, "test", timeout_s=2)
    with pytest.raises(RedisUnavailable):  # the private CA is not trusted without SPECMESH_REDIS_CA
        untrusted.call(lambda r: r.ping())
