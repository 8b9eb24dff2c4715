"""One assembly: builds every topology from one ``EngineConfig``: embedded (all in this process),
distributed (this router plus verifier processes it spawns or is given), and each role alone
(verifier, predictor, drafter, memory); then serves the public gRPC API and the OpenAI-compatible
HTTP API beside it until a signal, and shuts down losing nothing. Under Ray Serve the app in
``services/ray_app.py`` places the components as deployments and builds its router's engine here
(``build_engine``, over Ray-backed verifier, drafter and predictor)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from services.common.config import EngineConfig, ServerConfig, Topology, option_flags, secret_env
from services.common.grpc_server import run_until_signal
from services.common.metrics import redis_off
from services.common.security import TLSConfig, exposure_warning, internal_token
from services.drafter.hybrid import HybridDrafter
from services.router import openai_api as oa
from services.router.engine import Engine
from services.router.grpc_server import SERVICE_NAME, GenerationServicer, build_server

log = logging.getLogger("specmesh")


def run(cfg: EngineConfig, topo: Topology, scfg: ServerConfig, options: Mapping[str, Any]) -> None:
    """Build ``topo`` and serve until SIGTERM/SIGINT. ``options``: the engine options as given
    (spawned verifiers get the same ones)."""
    if topo.role in ("verifier", "predictor", "drafter", "memory"):
        if warning := exposure_warning(topo.role, scfg.host, TLSConfig.server_from_env(), internal_token()):
            log.warning(warning)
    if topo.role == "verifier":
        return _serve_verifier(cfg, scfg)
    if topo.role in ("predictor", "drafter", "memory"):
        server, port = component_server(topo.role, cfg, scfg.host, scfg.port)
        _announce(f"{topo.role} on {scfg.host}:{port}")
        run_until_signal(server, scfg.metrics_port, scfg.host)
        return None
    if topo.role == "all" and topo.kind == "embedded":
        return serve(checked(build_engine(cfg), options), scfg)
    from services.verifier.client import RemoteVerifier
    from services.verifier.watch import ReplicaWatch

    supervisor, addrs = None, list(topo.verifiers)
    if topo.kind == "distributed" and not addrs:
        supervisor, addrs = spawn_verifiers(options, topo, scfg)
    try:
        watch = ReplicaWatch(floor_s=topo.verifier_timeout_s)
        pool = RemoteVerifier(
            addrs, link=topo.verifier_link == "multiplex", affinity_slack=topo.affinity_slack, watch=watch
        )
        serve(checked(build_engine(cfg, pool), options), scfg)
    finally:
        if supervisor is not None:
            supervisor.stop()
    return None


def build_engine(cfg: EngineConfig, verifier=None, suffix=None, predictor=None) -> Engine:
    """The router's engine over a verifier (None: in this process; else a remote or Ray one).
    ``suffix(name, tree)``: a remote suffix-cache drafter for ``suffix`` / ``suffix-tree`` (the
    hybrids draft from it too); ``predictor``: a remote yield predictor for ``hybrid``."""
    engine = Engine(cfg, verifier=verifier)
    if suffix is not None:
        engine.drafters["suffix"] = suffix("suffix", False)
        engine.drafters["suffix-tree"] = suffix("suffix-tree", True)
        for hybrid in [d for d in engine.drafters.values() if isinstance(d, HybridDrafter)]:
            hybrid.cache = engine.drafters["suffix-tree" if hybrid.name == "hybrid-tree" else "suffix"]
    if predictor is not None and engine.model_fallback:
        from services.drafter.hybrid import PredictorRule
        from services.predictor.features import TokenFlags

        rule = PredictorRule(predictor, TokenFlags(engine.tokenizer), cfg.hybrid.tau)
        engine.add_hybrid("hybrid", rule, cost_aware=cfg.hybrid.cost_aware)
    return engine


def checked(engine: Engine, options: Mapping[str, Any]) -> Engine:
    """The engine, once the method a speculative config asked for is available (its drafter
    loaded); else a ValueError saying so."""
    want = (options.get("speculative_config") or {}).get("method")
    if want is not None and engine.default_method != engine.cfg.default_method:
        engine.close()
        raise ValueError(
            f"speculative_config.method: {want!r} ({engine.cfg.default_method}) is not available on "
            f"these models (see the warnings above); available: {', '.join(engine.methods())}"
        )
    return engine


def _serve_verifier(cfg: EngineConfig, scfg: ServerConfig) -> None:
    from services.common.supervisor import exit_with_parent
    from services.verifier.core import VerifierCore
    from services.verifier.grpc_server import build_verifier_server

    exit_with_parent()  # spawned by a router: do not outlive it
    core = VerifierCore.from_config(cfg, eos_id(cfg))
    if hasattr(core.runner, "on_broken"):  # a tensor-parallel replica that loses a rank stops, as a dead one
        core.runner.on_broken = lambda: os.kill(os.getpid(), signal.SIGTERM)
    if scfg.vllm_metric_names:  # vllm:kv_cache_usage_perc comes from where the K/V is
        from services.common import vllm_metrics

        vllm_metrics.register(oa.served_names(scfg.served_model_name or cfg.target.name)[0])
    server, servicer, port = build_verifier_server(core, scfg.host, scfg.port, scfg.max_sessions)
    _announce(f"verifier on {scfg.host}:{port}")
    run_until_signal(server, scfg.metrics_port, scfg.host, on_drain=servicer.drain)
    core.close()  # flush pending correction-memory writes


def component_server(role: str, cfg: EngineConfig, host: str, port: int):
    """predictor / drafter / memory: one service alone. Returns (server, bound port)."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(cfg.target)))
    if role == "predictor":
        from services.predictor.grpc_server import build_predictor_server
        from services.predictor.mlp import YieldMLP

        if cfg.predictor is None:
            raise ValueError("predictor: the predictor role needs --predictor DIR")
        return build_predictor_server(YieldMLP.load(cfg.predictor), host, port)
    feed = None
    if cfg.redis_url:
        from services.drafter.suffix import GlobalSuffixCache
        from services.memory.redis_link import RedisLink
        from services.memory.suffix_feed import SuffixFeed

        cache = GlobalSuffixCache.of(cfg.suffix, background=True)
        feed = SuffixFeed(RedisLink(cfg.redis_url, "suffix_feed"), cache, vocab=vocab).start()
    elif role == "drafter":
        redis_off("suffix_feed")
    if role == "drafter":
        from services.drafter.grpc_server import build_drafter_server
        from services.drafter.suffix import GlobalSuffixCache, SuffixDrafter

        cache = feed.cache if feed else GlobalSuffixCache.of(cfg.suffix, background=True)
        drafter = SuffixDrafter(cfg.suffix, cache, feed.publish if feed else None)
        server, _, bound = build_drafter_server(drafter, vocab, host, port)
        return server, bound
    from services.memory.grpc_server import build_memory_server
    from services.verifier.core import open_memory

    server, _, bound = build_memory_server(
        open_memory(replace(cfg, memory_addr=None)), vocab, host, port, publish=feed.publish if feed else None
    )
    return server, bound


def eos_id(cfg: EngineConfig) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cfg.target)).eos_token_id


def verifier_command(
    port: int,
    options: Mapping[str, Any] = {},
    host: str = "127.0.0.1",
    metrics_port: int = 0,
    max_sessions: int | None = None,
    metric_names: tuple[str, ...] | None = None,
) -> list[str]:
    """The command line of a verifier process with these engine options (``option_flags``;
    secrets go through its environment: ``secret_env``). ``metric_names``: the router's served
    model names, for the verifier's vLLM-named metrics (``()``: without vLLM's names)."""
    sessions = ["--max-sessions", str(max_sessions)] if max_sessions else []
    if metric_names is not None:
        sessions += ["--served-model-name", *metric_names] if metric_names else ["--no-vllm-metric-names"]
    return [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--role",
        "verifier",
        "--host",
        host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *sessions,
        *option_flags(options),
    ]


def spawn_verifiers(options: Mapping[str, Any], topo: Topology, scfg: ServerConfig):
    """``topo.replicas`` verifier processes on the ports after ``scfg.port``, with the same engine
    options, each serving before this returns (``StartFailed`` if one cannot), restarted if one
    dies later; returns (their ``Supervisor``, addresses)."""
    from services.common.supervisor import Child, Supervisor
    from services.verifier.client import serving

    children = []
    for i in range(topo.replicas):
        port = scfg.port + 1 + i
        metrics = scfg.metrics_port + 1 + i if scfg.metrics_port else 0
        names = oa.served_names(scfg.served_model_name) if scfg.served_model_name else None  # None: its default
        cmd = verifier_command(
            port, options, scfg.host, metrics, scfg.max_sessions, names if scfg.vllm_metric_names else ()
        )
        children.append(Child(f"{scfg.host}:{port}", cmd))
    supervisor = Supervisor(children, {**os.environ, **secret_env(options)}, ready=serving)
    supervisor.start()
    return supervisor, [c.name for c in children]


def _announce(what: str) -> None:
    print(f"specmesh: {what}", flush=True)


def serve(engine: Engine, cfg: ServerConfig) -> None:
    server, servicer, port = build_server(engine, cfg)
    log.info(
        "specmesh serving %s on %s:%d (default method %s; available: %s; metrics :%d)",
        SERVICE_NAME,
        cfg.host,
        port,
        engine.default_method,
        ", ".join(engine.methods()),
        cfg.metrics_port,
    )
    print(
        f"specmesh: serving on {cfg.host}:{port} — try: specmesh client --addr {cfg.host}:{port} --prompt 'def add(a, b):'",
        flush=True,
    )
    http = start_http(engine, cfg, servicer) if cfg.http_port else None
    try:
        run_until_signal(server, cfg.metrics_port, cfg.host, on_drain=http.drain if http else None)
    finally:
        if http:
            http.stop()  # streams in flight finish (up to 10 s)
    engine.close()  # flush suffix-feed outputs and correction-memory writes


def start_http(engine: Engine, cfg: ServerConfig, servicer: GenerationServicer):
    """The OpenAI-compatible HTTP API on cfg.http_port, sharing the gRPC server's admission limits."""
    from services.router.http_server import HttpServer, build_app

    names = oa.served_model(engine, cfg)
    template = cfg.chat_template.read_text() if cfg.chat_template else None
    live = getattr(engine.verifier, "live", None)  # remote replicas: /health asks whether any answers
    app = build_app(lambda: engine, servicer.admission, cfg, names, template, active=servicer.active, live=live)
    http = HttpServer(app, cfg, cfg.http_port)
    port = http.start()
    scheme = "https" if cfg.tls_cert else "http"
    print(
        f"specmesh: OpenAI-compatible API on {scheme}://{cfg.host}:{port}/v1 (model `{'`, `'.join(names)}`) — try: curl "
        f"{scheme}://{cfg.host}:{port}/v1/completions -H 'content-type: application/json' "
        f'-d \'{{"prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}}\'',
        flush=True,
    )
    return http
