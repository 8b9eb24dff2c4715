"""One assembly: builds the serving process from its configuration: the public gRPC server,
the OpenAI-compatible HTTP API beside it, and their shutdown."""
from __future__ import annotations

import logging

from services.common.config import ServerConfig
from services.common.grpc_server import run_until_signal
from services.router import openai_api as oa
from services.router.engine import Engine
from services.router.grpc_server import SERVICE_NAME, GenerationServicer, build_server

log = logging.getLogger("specmesh")


def serve(engine: Engine, cfg: ServerConfig) -> None:
    server, servicer, port = build_server(engine, cfg)
    log.info("specmesh serving %s on %s:%d (default method %s; available: %s; metrics :%d)", SERVICE_NAME,
             cfg.host, port, engine.default_method, ", ".join(engine.methods()), cfg.metrics_port)
    print(f"specmesh: serving on {cfg.host}:{port} — try: specmesh client --addr {cfg.host}:{port} --prompt 'def add(a, b):'",
          flush=True)
    http = start_http(engine, cfg, servicer) if cfg.http_port else None
    try:
        run_until_signal(server, cfg.metrics_port, cfg.host, on_drain=http.drain if http else None)
    finally:
        if http:
            http.stop()   # streams in flight finish (up to 10 s)
    engine.close()  # flush suffix-feed outputs and correction-memory writes


def start_http(engine: Engine, cfg: ServerConfig, servicer: GenerationServicer):
    """The OpenAI-compatible HTTP API on cfg.http_port, sharing the gRPC server's admission limits."""
    from services.router.http_server import HttpServer, build_app

    names = oa.served_model(engine, cfg)
    template = cfg.chat_template.read_text() if cfg.chat_template else None
    app = build_app(lambda: engine, servicer.admission, cfg, names, template, active=servicer.active)
    http = HttpServer(app, cfg, cfg.http_port)
    port = http.start()
    scheme = "https" if cfg.tls_cert else "http"
    print(f"specmesh: OpenAI-compatible API on {scheme}://{cfg.host}:{port}/v1 (model `{'`, `'.join(names)}`) — try: curl "
          f"{scheme}://{cfg.host}:{port}/v1/completions -H 'content-type: application/json' "
          f"-d '{{\"prompt\": \"def add(a, b):\", \"max_tokens\": 32, \"temperature\": 0}}'", flush=True)
    return http
