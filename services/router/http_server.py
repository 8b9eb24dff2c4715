"""OpenAI-compatible HTTP front end (FastAPI on uvicorn) beside the gRPC one, over the same
engine and the same admission limits: ``POST /v1/completions``, ``POST /v1/chat/completions``
(streamed as server-sent events when ``stream`` is true), ``GET /v1/models``, vLLM's
``POST /tokenize``, ``POST /detokenize`` and ``POST /reset_prefix_cache``, SGLang's native
``POST /generate``, ``POST /flush_cache``, ``POST /abort_request``, ``GET /get_model_info``,
``GET /get_server_info`` and ``GET /health_generate``, ``GET /health`` (and vLLM's ``/ping``),
``GET /metrics``.

A request is validated (a grammar may take seconds to compile) and admitted (it may wait in
the admission queue) on a thread of its own; then it decodes on the event loop, where the
engine's scheduler delivers its outputs: no thread waits through its cycles. A client that
disconnects cancels its cycles and frees its sessions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import refusals
from services.common.config import ServerConfig
from services.common.metrics import REQUESTS_REJECTED, decoding_totals, rejected_code
from services.common.refusals import Refusal
from services.common.types import SessionCancelled
from services.router import openai_api as oa
from services.router import sglang_api as sgl
from services.router.engine import Completions, Engine, GenerationRequest, InvalidRequest
from services.router.tools import ToolStream

log = logging.getLogger("specmesh.http")
# what ends other clients' requests or resets shared state: the admin token's (security.admin_refusal)
ADMIN_PATHS = ("/abort_request", "/reset_prefix_cache", "/flush_cache")

# Each refusal's HTTP status (the gRPC edge has its own table).
_HTTP_OF: dict[type[refusals.Refusal], int] = {
    refusals.Invalid: 400,
    refusals.Overloaded: 429,
    refusals.DeadlineExceeded: 504,
    refusals.Unavailable: 503,
    refusals.Cancelled: 499,
}


def http_status(refusal: refusals.Refusal) -> int:
    return next((_HTTP_OF[k] for k in type(refusal).__mro__ if k in _HTTP_OF), 500)


_KIND_OF = {
    405: "invalid_request_error",
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def _version() -> str:
    """The installed specmesh's version (as vLLM's ``/version`` gives its own)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specmesh")
    except PackageNotFoundError:
        return "unknown"


def error(status: int, message: str) -> JSONResponse:
    name = message.partition(":")[0]
    param = name if name.replace("_", "").replace(".", "").isalnum() and " " not in name else None
    return JSONResponse(oa.error_body(message, _KIND_OF.get(status, "server_error"), status, param), status_code=status)


class Parsed(Protocol):
    """What every API's parser gives a ``_Run``: the requests to complete, and whether to stream."""

    @property
    def gens(self) -> Sequence[GenerationRequest]: ...

    @property
    def stream(self) -> bool: ...


R = TypeVar("R", bound=Parsed)


class _Run(Generic[R]):
    """One request: parsed and admitted on a thread of its own (tokenizing, a chat template, a
    grammar and a wait in the admission queue take time), then decoded on the event loop, where
    its outputs arrive (``Completions.stream``: no thread per decoding request). Events reach
    the loop's consumer as ("start",), ("step", index, step | None), ("done",) or ("error",
    status, message)."""

    def __init__(
        self,
        get_engine: Callable[[], Engine],
        parse: Callable[[Any, Engine], R],
        body,
        admission,
        loop: asyncio.AbstractEventLoop,
        active,
        describe=oa.openai_message,
    ):
        self.get_engine, self.parse, self.body, self.describe = get_engine, parse, body, describe
        self.admission, self.loop, self.active = admission, loop, active
        self._engine: Engine | None = None
        self._api: R | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self._completions: Completions | None = None
        self.gone = False
        self.stats = False  # its answers say how they were decoded (the server's --response-stats)
        self._decoding: concurrent.futures.Future | None = None  # its decoding on the loop, once admitted
        # a thread only for a request that admission could still take (Admission.enter); the
        # others are refused here, before a thread, a parse or a grammar
        if (refused := admission.enter()) is not None:
            REQUESTS_REJECTED.labels("RESOURCE_EXHAUSTED").inc()
            self._put("error", 429, str(refused))
            return
        threading.Thread(target=self._run, daemon=True, name="http-request").start()

    # Rule: the event loop reads these only after the "start" event, which follows their setting.
    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "read after the start event"
        return self._engine

    @property
    def api(self) -> R:
        assert self._api is not None, "read after the start event"
        return self._api

    @property
    def completions(self) -> Completions:
        assert self._completions is not None, "read after the start event"
        return self._completions

    # the admission queue's view of the client
    def is_active(self) -> bool:
        return not self.gone

    def time_remaining(self) -> None:
        return None

    def leave(self) -> None:
        """The client is gone (any thread): stop the cycles in flight."""
        self.gone = True
        if self._completions is not None:
            self._completions.cancel()

    def _put(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def _run(self) -> None:
        try:
            self._admit()
        except Exception as e:  # never leave the event loop waiting
            log.exception("request failed before decoding")
            self._put("error", 500, f"internal error: {type(e).__name__}")
        finally:
            if self._decoding is None:  # else it leaves when its decoding ends
                self.admission.leave()

    def _admit(self) -> None:
        engine = self._engine = self.get_engine()
        try:  # tokenizing, rendering a chat template and compiling a grammar take time: here, not in the loop
            api = self._api = self.parse(self.body, engine)
            parts = [engine.generate_all(r) for r in api.gens]
        except InvalidRequest as e:
            REQUESTS_REJECTED.labels("INVALID_ARGUMENT").inc()
            return self._put("error", 404 if isinstance(e, oa.ModelNotFound) else 400, self.describe(e, self._api))
        completions = Completions([g for c in parts for g in c.gens])
        n = len(completions.gens)
        if n > self.admission.max_sessions:
            return self._put(
                "error",
                400,
                f"n: at most {self.admission.max_sessions} completions in all "
                "(prompts × n, or × best_of when larger; this server's sessions)",
            )
        refused = self.admission.acquire(self, n, api.gens[0].priority)
        if refused is None:
            try:
                completions.prepare()  # its grammars, once it holds its slots
            except Refusal as e:
                self.admission.release(n)
                refused = e
        if refused is not None:
            REQUESTS_REJECTED.labels(rejected_code(refused)).inc()
            if isinstance(refused, InvalidRequest):
                return self._put("error", 400, self.describe(refused, self._api))
            return self._put("error", http_status(refused), str(refused))
        self._completions = completions
        self.active.add(completions.gens)  # before "start": an abort from now on reaches it
        self._decoding = asyncio.run_coroutine_threadsafe(self._decode(completions, n), self.loop)

    async def _decode(self, completions: Completions, n: int) -> None:
        """On the event loop: every output as an event; then the request's admission slots and
        place are given back once its sessions have closed, and only then its end is told (a
        client that sends its next request on the answer finds its slots free)."""
        self._put("start")
        end: tuple = ("done",)
        try:
            async with contextlib.aclosing(completions.stream()) as steps:
                async for i, step in steps:
                    if self.gone:
                        end = ()
                        return
                    self._put("step", i, step)
        except SessionCancelled:
            end = ()
        except Refusal as e:  # no live verifier, or a verifier's own status
            end = ("error", http_status(e), str(e))
        except Exception as e:  # the client gets a status, the log the trace
            log.exception("request failed")
            end = ("error", 500, f"internal error: {type(e).__name__}")
        finally:
            await asyncio.to_thread(completions.close)  # frees the sessions even when the client went away
            self.active.remove(completions.gens)
            self.admission.release(n)
            self.admission.leave()
            if end:
                self._put(*end)


async def _read_at_most(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(
    get_engine,
    admission,
    cfg: ServerConfig,
    served_model: str | tuple[str, ...],
    chat_template: str | None = None,
    active=None,
    live=None,
) -> FastAPI:
    """``get_engine()``: the engine, called on request threads only (Ray Serve builds it on first use);
    ``active``: the ``ActiveSessions`` registry shared with the gRPC front end; ``live()``: how many
    verifier replicas answer (remote ones), for ``/health``."""
    app = FastAPI(title="specmesh", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    if active is None:
        from services.router.admission import ActiveSessions

        active = ActiveSessions()

    @app.middleware("http")
    async def guard(request: Request, call_next):
        from services.common.security import admin_refusal, bearer_ok

        sent = [("authorization", request.headers.get("authorization", ""))]
        if request.url.path in ADMIN_PATHS:  # the admin token instead of the API's (security.admin_refusal)
            if refused := admin_refusal(sent, cfg.auth_token, cfg.admin_token):
                forbidden, why = refused
                return error(403 if forbidden else 401, why)
        elif cfg.auth_token and request.url.path not in ("/health", "/ping", "/metrics", "/version"):
            if not bearer_ok(sent, cfg.auth_token):
                return error(401, "authorization: send `Authorization: Bearer <token>`")
        return await call_next(request)

    # Outermost (added last): a browser's preflight is answered before the bearer check, which
    # it cannot pass (it carries no Authorization header). No credentials: the token is a header.
    # Off unless origins are configured: a page on any site could otherwise drive the API.
    if cfg.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cfg.allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """Unknown paths (404) and wrong methods (405) in OpenAI's error shape, as every other error."""
        what = {
            404: f"path: no such endpoint {request.url.path}",
            405: f"method: {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return error(exc.status_code, what)

    @app.api_route("/health", methods=["GET"])
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name
    async def health():
        """200 while serving; 503 while draining, or while no verifier replica answers."""
        if app.state.draining or (live is not None and not await asyncio.to_thread(live)):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        """SGLang's deep check: healthy once a one-token generation (admitted like any request)
        finishes, or once other requests' decoding emits tokens meanwhile, so a busy server is
        not made to queue its probe; 503 when neither happens within the timeout, or while
        draining. The probe stays out of the request metrics."""
        if app.state.draining:
            return error(503, "server: shutting down")
        loop = asyncio.get_running_loop()
        before, deadline = decoding_totals()[1], loop.time() + cfg.health_check_timeout_s
        run = _Run(get_engine, sgl.health_request, None, admission, loop, active, sgl.message)
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    event = await asyncio.wait_for(run.queue.get(), min(left, 0.5))
                except TimeoutError:
                    event = ("waiting",)
                if event[0] == "done" or decoding_totals()[1] > before:
                    return Response(status_code=200)
                if event[0] == "error" and event[1] != 429:  # refused as full: others may still progress
                    return error(503, f"health check: {event[2]}")
            return error(503, f"health check: no token generated within {cfg.health_check_timeout_s:g} s")
        finally:
            run.leave()

    @app.post("/abort_request")
    async def abort_request(request: Request):
        """SGLang's: the completions of request id ``rid`` (any API's; every request with
        ``abort_all``) end before their next cycle, each answered with what it has and
        finish_reason "abort"; a request still queued ends so as it starts."""
        return await _plain(request, lambda body, _engine: {"aborted": active.abort(sgl.abort_target(body))})

    @app.get("/get_model_info")
    async def get_model_info():
        return sgl.model_info(await asyncio.to_thread(get_engine))

    @app.api_route("/get_server_info", methods=["GET"])
    @app.api_route("/server_info", methods=["GET"])  # SGLang's newer name
    async def get_server_info():
        engine = await asyncio.to_thread(get_engine)
        return sgl.server_info(engine, admission, oa.served_names(served_model)[0], _version())

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/v1/models")
    async def models():
        engine = await asyncio.to_thread(get_engine)
        return oa.models_body(served_model, engine.context_len)

    @app.get("/metrics")
    async def metrics():
        """This process's metrics; under Ray Serve (a multiprocess directory), the node's sum, as
        its node exporter serves it."""
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        from services.common.exposition import node_registry

        registry = node_registry() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else REGISTRY
        return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, lambda body, engine: oa.completion_request(body, engine, served_model))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _serve(request, lambda body, engine: oa.chat_request(body, engine, served_model, chat_template))

    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's native API (``services/router/sglang_api.py``)."""
        return await _serve(request, sgl.generate_request, sgl.message, _native_events, _native_collect)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: every verifier replica forgets its cached prompt blocks (empty 200)."""
        return await _reset_prefix_cache(Response(status_code=200))

    @app.post("/flush_cache")  # SGLang's also answers GET; a GET must not change state (a crawler, a prefetch)
    async def flush_cache():
        """SGLang's name for the same reset."""
        return await _reset_prefix_cache(Response("Cache flushed.\n", media_type="text/plain"))

    async def _reset_prefix_cache(done: Response):
        try:
            await asyncio.to_thread(lambda: get_engine().verifier.clear_prefix_cache())
        except Refusal as e:
            return error(http_status(e), str(e))
        return done

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _plain(request, lambda body, engine: oa.tokenize_body(body, engine, served_model, chat_template))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _plain(request, lambda body, engine: oa.detokenize_body(body, engine, served_model))

    async def _body(request: Request):
        """The request's JSON, or the error response to send instead. The size limit holds
        while reading (a declared Content-Length or the bytes of a chunked body), so an
        oversized body is refused without being buffered."""
        raw = await _read_at_most(request, cfg.max_message_bytes)
        if raw is None:
            return None, error(413, f"body: at most {cfg.max_message_bytes} bytes")
        try:
            return json.loads(raw), None
        except ValueError as e:  # not JSON, or not UTF-8
            return None, error(400, f"body: not valid JSON ({e})")
        except RecursionError:
            return None, error(400, "body: JSON nested too deeply")

    async def _plain(request: Request, answer):
        """A request answered at once, off the event loop (the engine may still be loading)."""
        body, refused = await _body(request)
        if refused is not None:
            return refused
        try:
            return await asyncio.to_thread(lambda: answer(body, get_engine()))
        except InvalidRequest as e:
            return error(404 if isinstance(e, oa.ModelNotFound) else 400, str(e))

    async def _serve(request: Request, parse, describe=oa.openai_message, events=None, collect=None):
        """A generation request: parsed and decoded on a thread of its own (``_Run``); answered
        as OpenAI's (``_events`` / ``_collect``) or another API's (``events`` / ``collect``)."""
        if app.state.draining:
            return error(503, "server: shutting down; retry on another replica")
        body, refused = await _body(request)
        if refused is not None:
            return refused
        run: _Run[Any] = _Run(get_engine, parse, body, admission, asyncio.get_running_loop(), active, describe)
        run.stats = cfg.response_stats
        first = await run.queue.get()
        if first[0] == "error":
            return error(first[1], first[2])
        if run.api.stream:
            return StreamingResponse((events or _events)(run), media_type="text/event-stream")
        answer = await (collect or _collect)(request, run)
        return answer if cfg.response_stats or not isinstance(answer, dict | list) else oa.without_stats(answer)

    return app


async def _sse(run: _Run[Any], step_chunks, done_chunks):
    """Server-sent events: ``step_chunks(index, step)`` per step event, ``done_chunks()`` at the
    end, an error after the stream began told in-band (as vLLM does), then ``[DONE]``."""
    try:
        while True:
            event = await run.queue.get()
            if event[0] == "step":
                for chunk in step_chunks(event[1], event[2]):
                    yield f"data: {json.dumps(chunk if run.stats else oa.without_stats(chunk))}\n\n"
            elif event[0] == "done":
                for chunk in done_chunks():
                    yield f"data: {json.dumps(chunk if run.stats else oa.without_stats(chunk))}\n\n"
                break
            else:
                yield f"data: {json.dumps(oa.error_body(event[2], _KIND_OF.get(event[1], 'server_error'), event[1]))}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        run.leave()  # no-op after the end; else the client left and its cycles stop


def _events(run: _Run[oa.ApiRequest]):
    """OpenAI's stream: a chunk per cycle and choice, a last chunk per choice with its
    finish_reason, usage when asked."""
    chunks = _Chunks(run)
    return _sse(run, chunks.step, lambda: [chunks.usage()] if run.api.include_usage else [])


async def _gathered(request: Request, run: _Run[Any]):
    """The events of a request that does not stream, up to its last; None once the client
    has left (its cycles are stopped)."""
    while True:
        try:
            event = await asyncio.wait_for(run.queue.get(), 1.0)
        except TimeoutError:
            if await request.is_disconnected():
                run.leave()
                yield None
                return
            continue
        yield event
        if event[0] != "step":
            return


class _Chunks:
    """A stream's chunks, per choice: its echo first (in a chunk of its own), then one per
    step (None: the choice's last, with its finish_reason and speculation stats). Tool-call
    streams send what ``ToolStream`` releases, so a step may send nothing."""

    def __init__(self, run: _Run[oa.ApiRequest]):
        self.api, self.tokenizer, self.gens = run.api, run.engine.tokenizer, run.completions.gens
        self.rid, self.created = oa.new_id(self.api.chat), int(time.time())
        n = len(self.gens)
        self.offsets, self.started, self.streamed = [0] * n, [False] * n, 0
        tools = self.api.tools
        self.calls = [ToolStream(tools) for _ in range(n)] if tools is not None and self.api.calls_tools else None

    def step(self, i: int, step) -> list[dict]:
        out = []
        if (self.api.echo or self.api.chat_echo) and not self.started[i]:
            out.append(self._echo(i))
        chunk = self._text(i, step) if self.calls is None else self._tools(i, step)
        if chunk is not None:
            if self.api.continuous_usage:
                chunk["usage"] = oa.usage(self.gens, self.streamed)
            out.append(chunk)
        return out

    def usage(self) -> dict:
        return oa.usage_chunk(self.api, self.rid, self.created, self.gens)

    def _echo(self, i: int) -> dict:
        """The prompt (in chat, the last message), with its logprobs when asked."""
        api, gen = self.api, self.gens[i]
        text = api.chat_echo if api.chat else str(self.tokenizer.decode(gen.req.prompt_ids))
        chunk = oa.stream_chunk(
            api, self.rid, self.created, i, text, (), self.tokenizer, prompt_ids=gen.req.prompt_ids, first=api.chat
        )
        if api.logprobs and not api.chat:
            chunk["choices"][0]["logprobs"] = oa.echo_logprobs(oa.logprob_tokens(api, self.tokenizer), gen)
        self.offsets[i], self.started[i] = len(text), True
        return chunk

    def _text(self, i: int, step) -> dict:
        gen = self.gens[i]
        if step is None:
            chunk = oa.stream_chunk(
                self.api, self.rid, self.created, i, None, (), self.tokenizer, finish=gen.finish_reason
            )
            chunk["choices"][0] |= {"stop_reason": gen.stop_reason, "speculation": oa.speculation(gen)}
            return chunk
        chunk = oa.stream_chunk(
            self.api,
            self.rid,
            self.created,
            i,
            step.text,
            step.logprobs,
            self.tokenizer,
            offset=self.offsets[i],
            first=not self.started[i],
            token_ids=step.token_ids,
            prompt_ids=None if self.started[i] else gen.req.prompt_ids,
        )
        self.offsets[i] += len(step.text)
        self.started[i] = True
        self.streamed += len(step.token_ids)
        return chunk

    def _tools(self, i: int, step) -> dict | None:
        api, gen, first, calls = self.api, self.gens[i], not self.started[i], self.calls
        assert calls is not None, "a tool-call stream"
        if step is None:
            content, deltas, called = calls[i].finish()
            chunk = oa.tool_chunk(
                api, self.rid, self.created, i, content, deltas, (), self.tokenizer, first, gen.finish_reason, called
            )
            chunk["choices"][0] |= {"stop_reason": gen.stop_reason, "speculation": oa.speculation(gen)}
        else:
            content, deltas = calls[i].feed(step.text)
            self.streamed += len(step.token_ids)
            if not (content or deltas or (api.logprobs and step.logprobs) or api.token_ids):
                return None
            chunk = oa.tool_chunk(
                api,
                self.rid,
                self.created,
                i,
                content,
                deltas,
                step.logprobs,
                self.tokenizer,
                first,
                token_ids=step.token_ids,
            )
        self.started[i] = True
        return chunk


async def _collect(request: Request, run: _Run[oa.ApiRequest]):
    """A request that did not stream: gather its choices (watching for the client leaving)."""
    api, tokenizer = run.api, run.engine.tokenizer
    gens = run.completions.gens
    choices = [oa.Choice(i) for i in range(len(gens))]
    async for event in _gathered(request, run):
        if event is None:
            return Response(status_code=499)
        if event[0] == "step":
            oa.take_step(choices, gens, event[1], event[2])
        elif event[0] == "done":
            return oa.response_body(api, oa.new_id(api.chat), int(time.time()), choices, gens, tokenizer)
        else:
            return error(event[1], event[2])


class _Native:
    """A native request's completions as its steps carried them (``oa.Choice`` per index)."""

    def __init__(self, run: _Run[Any]):
        self.gens = run.completions.gens
        self.choices = [oa.Choice(i) for i in range(len(self.gens))]

    def add(self, i: int, step) -> None:
        if step is not None:
            self.choices[i].add(step)

    def completion(self, i: int, final: bool, streamed: bool = False) -> dict:
        c = self.choices[i]
        return sgl.completion(self.gens[i], i, "".join(c.text), c.token_ids, final, streamed)


def _native_events(run: _Run[sgl.NativeRequest]):
    """SGLang's stream: per step, the completion so far (cumulative)."""
    seen = _Native(run)

    def step(i: int, s) -> list[dict]:
        seen.add(i, s)
        return [seen.completion(i, s is None, streamed=True)]

    return _sse(run, step, lambda: [])


async def _native_collect(request: Request, run: _Run[sgl.NativeRequest]):
    """SGLang's answer: one object for one prompt and n = 1, else a list."""
    seen = _Native(run)
    async for event in _gathered(request, run):
        if event is None:
            return Response(status_code=499)
        if event[0] == "step":
            seen.add(event[1], event[2])
        elif event[0] == "done":
            out = [seen.completion(i, True) for i in range(len(seen.gens))]
            return out if run.api.many else out[0]
        else:
            return error(event[1], event[2])


class HttpServer:
    """uvicorn on a thread of its own (the main thread keeps the signal handlers)."""

    def __init__(self, app: FastAPI, cfg: ServerConfig, port: int):
        ssl: dict[str, Any] = {}
        if cfg.tls_cert:
            ssl = {"ssl_certfile": str(cfg.tls_cert), "ssl_keyfile": str(cfg.tls_key)}
            if cfg.tls_client_ca:  # mutual TLS, as the gRPC port
                import ssl as _ssl

                ssl |= {"ssl_ca_certs": str(cfg.tls_client_ca), "ssl_cert_reqs": _ssl.CERT_REQUIRED}
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=cfg.host,
                port=port,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=10,
                **ssl,
            )
        )
        self._thread = threading.Thread(target=self.server.run, daemon=True, name="http-server")

    def start(self, timeout_s: float = 30.0) -> int:
        """Serve; returns the bound port."""
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError("http: the server did not start (is the port taken?)")
            time.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def drain(self) -> None:
        """/health answers 503 and new requests are refused; streams in flight go on."""
        self.app.state.draining = True

    def stop(self) -> None:
        self.drain()
        self.server.should_exit = True
        self._thread.join(30)
