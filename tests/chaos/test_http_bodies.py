"""Hostile HTTP bodies against the OpenAI-compatible API: hypothesis-built JSON (any shape, any
values, near-valid requests with one field changed), raw bytes, deep nesting, and a chunked body
far past the limit. Property: every answer is 2xx or a 4xx in OpenAI's error shape (never a 5xx),
the process does not buffer what it refuses, and the server serves afterwards."""

import json
import socket
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.contract.test_openai_api import http_api

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/tokenize", "/generate", "/nowhere"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
VALID = {
    "/v1/completions": {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}
NEAR_VALID = st.sampled_from(sorted(VALID)).flatmap(
    lambda path: st.tuples(
        st.just(path),
        st.dictionaries(
            st.sampled_from(sorted({*VALID[path], "n", "stream", "stop", "logprobs", "seed"})), JSON, max_size=2
        ),
    )
)


def request(port: int, path: str, body: bytes, head: str = "") -> tuple[int, bytes]:
    head = head or f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}Connection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    return int(top.split()[1]), rest


def clear(status: int, body: bytes) -> bool:
    """2xx, or a 4xx whose body is OpenAI's error object (a stream's body is its events)."""
    if 200 <= status < 300:
        return True
    if not 400 <= status < 500:
        return False
    try:
        return isinstance(json.loads(body)["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        return False


def rss_mb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_any_json_any_bytes_get_a_clear_answer(tiny_engine):
    with http_api(tiny_engine, served_model_name="tiny") as (port, servicer):

        @FUZZ
        @given(st.sampled_from(PATHS), JSON)
        def any_json(path, value):
            status, body = request(port, path, json.dumps(value).encode())
            assert clear(status, body), (path, value, status, body[:200])

        @FUZZ
        @given(NEAR_VALID)
        def near_valid(case):
            path, changes = case
            status, body = request(port, path, json.dumps({**VALID[path], **changes}).encode())
            assert clear(status, body), (path, changes, status, body[:200])

        @FUZZ
        @given(st.sampled_from(PATHS), st.binary(max_size=80))
        def any_bytes(path, blob):
            status, body = request(port, path, blob)
            assert clear(status, body), (path, blob, status, body[:200])

        any_json()
        near_valid()
        any_bytes()
        status, body = request(port, "/v1/completions", json.dumps(VALID["/v1/completions"]).encode())
        assert status == 200 and json.loads(body)["choices"][0]["text"]
        assert not servicer.active and servicer.admission.running == 0


def test_a_huge_chunked_body_and_deep_nesting_are_refused_without_buffering(tiny_engine):
    """64 MiB sent chunked against the 4 MiB limit: 413 once the limit passes, and the process
    grows by far less than the body; 100,000 levels of nesting: 400."""
    with http_api(tiny_engine) as (port, _):
        pieces = [b'{"prompt": "', *[b"x" * (1 << 20)] * 64]
        chunks = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
        before = rss_mb()  # the client's own 64 MiB is already counted
        head = "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        try:
            status, body = request(port, "/v1/completions", chunks, head)
        except (BrokenPipeError, ConnectionResetError):  # refused mid-send: the server stopped reading
            status, body = 413, b'{"error": {"message": "closed"}}'
        assert status == 413 and clear(status, body)
        assert rss_mb() - before < 32, "the refused body was buffered"
        status, body = request(port, "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert status == 400 and clear(status, body)
