"""Shared fixtures: tiny Llama checkpoints (HF format, real tokenizer) and engines over them.

Tiny models keep the suite fast; their weights are scaled up so next-token distributions
are peaked (no argmax near-ties), and the draft is a perturbed copy of the target so that
drafts are mostly but not always accepted (rollback gets exercised).
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.common.config import EngineConfig, models_dir

TOKENIZER = models_dir() / "tokenizer"
BUNDLED_TARGET = models_dir() / "target"
BUNDLED_DRAFT = models_dir() / "draft"

torch.set_num_threads(1)


def tiny_config(layers: int = 2, hidden: int = 64, max_pos: int = 256, vocab: int = 8192, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kw.pop("kv_heads", 2),
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **kw,
    )


def make_tiny(path: Path, seed: int, layers: int = 2, base: dict | None = None, noise: float = 0.0, **kw) -> Path:
    """Save a tiny Llama to ``path``; with ``base`` (a state dict), copy it plus Gaussian ``noise``."""
    from transformers import AutoTokenizer

    from services.common.llama import Llama

    torch.manual_seed(seed)
    model = Llama(tiny_config(layers=layers, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base is not None:
                p.copy_(base[name] + noise * torch.randn_like(p))
            elif p.dim() > 1:
                p.normal_(0.0, 0.35 if "embed" in name else 0.2)
    model.save_pretrained(path, dtype=torch.float32)
    AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    from services.common.llama import Llama

    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny(root / "target", seed=0)
    base = dict(Llama.from_pretrained(target).named_parameters())
    draft = make_tiny(root / "draft", seed=1, base={k: v.detach() for k, v in base.items()}, noise=0.006)
    return target, draft


@pytest.fixture(scope="session")
def tiny_engine(tiny_dirs):
    from services.router.engine import Engine

    target, draft = tiny_dirs
    # Hermetic: none of the bundled zoo's extras (EAGLE-3 head, predictor, OCM prior) for the tiny pair.
    return Engine(
        EngineConfig(
            target=target,
            draft=draft,
            num_speculative_tokens=4,
            draft_confidence=0.0,
            max_new_tokens_limit=200,
            eagle3=None,
            predictor=None,
            ocm_snapshot=None,
        )
    )


def bundled_available() -> bool:
    """Both bundled models present (single-file or sharded safetensors)."""
    return all((d / "config.json").exists() and any(d.glob("*.safetensors")) for d in (BUNDLED_TARGET, BUNDLED_DRAFT))


@pytest.fixture(scope="session")
def bundled_engine():
    from services.router.engine import Engine

    if not bundled_available():
        pytest.fail("bundled models missing: run `make models`")
    return Engine(EngineConfig())


def finish_order_by_priority(adm, send) -> list[str]:
    """Every slot of ``adm`` (an ``Admission``) taken, queue "first" (priority 0), then "urgent"
    (priority -1), each a ``send(priority)`` call on a thread of its own; free the slots. The
    names in the order they were admitted, as ``adm.acquire`` granted them (with one slot, the
    second is granted only once the first has released it); each call must succeed."""
    import threading

    admitted: list[int] = []
    grant = adm.acquire

    def acquire(context, n=1, priority=0):
        refused = grant(context, n, priority)
        if refused is None:
            admitted.append(priority)  # before its request runs, so before the next grant
        return refused

    adm.acquire = acquire
    with adm._cond:
        adm.running = adm.max_sessions
    threads = []
    try:
        for priority in (0, -1):
            threads.append(threading.Thread(target=send, args=(priority,)))
            threads[-1].start()
            assert wait_for(lambda k=len(threads): adm.waiting == k)
    finally:
        with adm._cond:
            adm.running = 0
            adm._cond.notify_all()
    for t in threads:
        t.join(30)
    del adm.acquire
    return [{0: "first", -1: "urgent"}[p] for p in admitted]


def wait_for(cond, timeout: float = 5.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; return its last value."""
    import time

    end = time.time() + timeout
    while not cond() and time.time() < end:
        time.sleep(0.02)
    return cond()


def corrupt_bytes(n: int, seed: int = 0) -> bytes:
    """``n`` random bytes (seeded) that are not valid protobuf wire format for any message: the
    first draw that even ``Empty``, which takes any well-formed fields, fails to parse. (Plain
    random bytes sometimes are well formed, and an RPC may then rightly succeed.)"""
    import random

    from google.protobuf import empty_pb2
    from google.protobuf.message import DecodeError

    rng = random.Random(seed)
    while True:
        blob = rng.randbytes(n)
        try:
            empty_pb2.Empty.FromString(blob)
        except DecodeError:
            return blob


# -- Redis -----------------------------------------------------------------------------------
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_url():
    """The machine's Redis (CI starts one). Absent Redis is a failure, never a skip."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=1).ping()
    except redis.RedisError as e:
        pytest.fail(f"Redis is required at {REDIS_URL}: {e}")
    return REDIS_URL


class RedisProcess:
    """A private redis-server on a spare port, for tests that stop and restart Redis."""

    def __init__(self):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self):
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(100):
            try:
                redis.Redis(port=self.port).ping()
                return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self, kill: bool = False):
        """Stop it (SIGTERM), or kill it (SIGKILL); it keeps nothing either way."""
        if self.proc:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def private_redis():
    r = RedisProcess().start()
    yield r
    r.stop()


@pytest.fixture(scope="session")
def tiny_eagle3(tiny_dirs, tmp_path_factory) -> Path:
    """An (untrained, scaled-up) EAGLE-3 head for the tiny target, aux layers (0, 1, 1)."""
    from transformers import AutoConfig

    from services.drafter.eagle3 import Eagle3Head, eagle3_config

    torch.manual_seed(7)
    head = Eagle3Head(eagle3_config(AutoConfig.from_pretrained(str(tiny_dirs[0])), (0, 1, 1)))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("eagle3")
    head.save_pretrained(path, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def tiny_eagle_engine(tiny_dirs, tiny_eagle3):
    from services.router.engine import Engine

    return Engine(
        EngineConfig(target=tiny_dirs[0], draft=None, eagle3=tiny_eagle3, eagle3_k=4, max_new_tokens_limit=200)
    )


# -- a throw-away PKI (CA, server and client certificates for localhost) ----------------------
def _cert(subject: str, issuer_cert, issuer_key, key, ca: bool = False):
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(
            issuer_cert.subject if issuer_cert else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        )
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            False,
        )
    return b.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("specmesh-test-ca", None, None, ca_key, ca=True)
    out = {}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"specmesh-{name}", ca, ca_key, key)
        (d / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        (d / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[name] = (d / f"{name}.crt", d / f"{name}.key")
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out["ca"] = d / "ca.crt"
    return out


# -- markers by folder: `make test-fast` runs -m "unit or sim" ---------------------------------
_MARK_OF = {
    "unit": "unit",
    "sim": "sim",
    "integration": "integration",
    "contract": "integration",
    "chaos": "chaos",
    "image": "image",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _MARK_OF:
            item.add_marker(getattr(pytest.mark, _MARK_OF[folder]))
