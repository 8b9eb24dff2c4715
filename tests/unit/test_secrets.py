"""Secrets stay out of logs and command lines; bearer tokens are checked as RFC 7235 says."""

import logging

import pytest

from services.common.config import option_flags, secret_env
from services.common.security import bearer_ok, redacted


@pytest.mark.parametrize("header", ["Bearer tok-1", "bearer tok-1", "BEARER tok-1", "Bearer  tok-1 "])
def test_the_bearer_scheme_is_matched_in_any_case(header):
    assert bearer_ok([("authorization", header)], "tok-1")


@pytest.mark.parametrize("header", ["Bearer tok-2", "Basic tok-1", "tok-1", "Bearertok-1", ""])
def test_a_wrong_token_or_scheme_is_refused(header):
    assert not bearer_ok([("authorization", header)], "tok-1")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:p@ss:w@h", "rediss://user:***@h"),
        ("redis://h:6379", "redis://h:6379"),
        ("redis://user@h", "redis://user@h"),
    ],
)
def test_urls_are_shown_without_their_password(url, shown):
    assert redacted(url) == shown


def test_a_spawned_process_gets_secrets_in_its_environment_not_its_arguments():
    values = {"redis_url": "redis://:s3cret@h:6379", "prefill_chunk": 64, "kv_pool": True}
    flags = option_flags(values)
    assert "s3cret" not in " ".join(flags) and "--redis-url" not in flags
    assert flags == ["--kv-pool", "--prefill-chunk", "64"]  # the table's order
    assert secret_env(values) == {"SPECMESH_REDIS_URL": "redis://:s3cret@h:6379"}


def test_a_redis_outage_is_logged_without_the_password(caplog):
    from services.memory.redis_link import RedisLink, RedisUnavailable

    link = RedisLink("redis://:s3cret@127.0.0.1:1/0", "ocm", timeout_s=0.2)  # nothing listens on port 1
    with caplog.at_level(logging.WARNING, logger="specmesh.redis"), pytest.raises(RedisUnavailable) as e:
        link.call(lambda r: r.ping())
    with pytest.raises(RedisUnavailable) as again:  # in backoff: refused at once
        link.call(lambda r: r.ping())
    text = caplog.text + str(e.value) + str(again.value)
    assert "unavailable" in caplog.text and "s3cret" not in text and ":***@" in text


def test_an_internal_service_exposed_without_client_authentication_is_said_at_start(tmp_path):
    from services.common.security import TLSConfig, exposure_warning

    assert exposure_warning("verifier", "127.0.0.1", TLSConfig()) is None
    assert exposure_warning("verifier", "::1", TLSConfig()) is None
    said = exposure_warning("verifier", "0.0.0.0", TLSConfig())
    assert said and "without client authentication" in said and "SPECMESH_TLS_CLIENT_CA" in said
    assert exposure_warning("memory", "0.0.0.0", TLSConfig(ca=tmp_path / "ca.pem")) is None  # mTLS
    assert exposure_warning("drafter", "0.0.0.0", TLSConfig(), token="t0k") is None  # the internal token


def test_an_empty_or_unreadable_internal_token_file_is_refused(tmp_path, monkeypatch):
    import pytest

    from services.common.security import INTERNAL_TOKEN_ENV, internal_token

    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    assert internal_token() is None
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is empty"):
        internal_token()
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read"):
        internal_token()
    (tmp_path / "token").write_text("s3cret\n")
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, str(tmp_path / "token"))
    assert internal_token().get() == "s3cret"


def test_token_files_rotate_without_a_window_the_two_ends_disagree(tmp_path, monkeypatch):
    """A token file lists one token per line: servers accept each, clients send the first, both
    read the file again when it changes. So a rotation adds the new token as a second line,
    moves it first, then drops the old; at every step each client's token is one every server
    accepts. An open channel sends the file's current first line."""
    import os

    from services.common.grpc_server import SendToken
    from services.common.security import INTERNAL_TOKEN_ENV, bearer_ok, internal_token

    path = tmp_path / "internal"

    def write(text: str) -> None:  # as the kubelet swaps a Secret: a new file renamed over the old
        (tmp_path / "next").write_text(text)
        os.replace(tmp_path / "next", path)

    write("old\n")
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, str(path))
    server, client = internal_token(), internal_token()
    server.recheck_s = client.recheck_s = 0.0
    send = SendToken(client)

    def header() -> list:
        class Details:
            method, timeout, metadata, credentials, wait_for_ready, compression = "/m", None, None, None, None, None

        return list(send._with_token(Details()).metadata)

    steps = ["old\nnew\n", "new\nold\n", "new\n"]
    for text in steps:
        write(text)
        assert bearer_ok(header(), server)  # the client's token is always one the server takes
    assert header() == [("authorization", "Bearer new")]
    assert not bearer_ok([("authorization", "Bearer old")], server)  # dropped at the last step
    write("\n")
    assert server.accepted() == ("new",)  # an emptied file keeps the last tokens
