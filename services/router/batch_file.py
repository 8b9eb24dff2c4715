"""OpenAI batch files, as vLLM's ``run-batch``: one request per line in, one answer per line
out, in the same order (``specmesh run-batch -i IN -o OUT``).

A line in: ``{"custom_id": ..., "method": "POST", "url": "/v1/completions" |
"/v1/chat/completions", "body": {...}}``, the body as the HTTP API takes it. A line out:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``: the HTTP
API's answer (200) or its error body (400 with the message naming the field), and the
error's message beside it. A line that is not such a request is answered with a 400 of its
own; nothing stops the file. Bodies are parsed and answered by the same functions as the HTTP
API (``openai_api``); up to ``concurrency`` requests decode at once, their cycles in shared
verifier steps.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable

from services.common.progress import run_concurrently
from services.router import openai_api as oa
from services.router.admission import Admission
from services.router.engine import Completions, Engine, InvalidRequest

URLS = ("/v1/completions", "/v1/chat/completions")
log = logging.getLogger("specmesh.batch")


class BatchLineError(ValueError):
    """A line that is not a batch request; the message names what to fix."""

    def __init__(self, message: str, custom_id=None):
        super().__init__(message)
        self.custom_id = custom_id


class _Offline:
    """Admission's view of a batch line: always there, no deadline."""

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> None:
        return None


def _take_sessions(admission: Admission, k: int) -> None:
    """A line's k completions wait for their slots (the server's admission, queue unbounded)."""
    if k > admission.max_sessions:
        raise BatchLineError(
            f"n: at most {admission.max_sessions} completions in all (prompts × n, or × best_of "
            "when larger; --max-sessions)"
        )
    admission.acquire(_Offline(), k)


def answer_line(
    engine: Engine,
    line: str,
    served: str | tuple[str, ...],
    chat_template: str | None,
    admission: Admission | None = None,
) -> dict:
    """One input line's output line."""
    rid = f"batch-{uuid.uuid4().hex}"
    custom_id = None
    try:
        req = _request_line(line)
        custom_id = req["custom_id"]
        body = _answer(engine, req["url"], req["body"], served, chat_template, admission or Admission(1 << 30, 1 << 30))
        return {
            "id": rid,
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body},
            "error": None,
        }
    except (BatchLineError, InvalidRequest) as e:
        custom_id = custom_id if custom_id is not None else getattr(e, "custom_id", None)
        message = oa.openai_message(e) if isinstance(e, InvalidRequest) else str(e)
        code = 404 if isinstance(e, oa.ModelNotFound) else 400
        kind = "not_found_error" if code == 404 else "invalid_request_error"
        return _error_line(rid, custom_id, code, kind, message)
    except Exception as e:  # a failure while decoding: this line's answer, and the file goes on
        log.exception("batch line %s failed", custom_id)
        return _error_line(rid, custom_id, 500, "server_error", f"internal error: {type(e).__name__}: {e}")


def _error_line(rid: str, custom_id, code: int, kind: str, message: str) -> dict:
    return {
        "id": rid,
        "custom_id": custom_id,
        "response": {"status_code": code, "request_id": rid, "body": oa.error_body(message, kind, code)},
        "error": message,
    }


def _request_line(line: str) -> dict:
    try:
        req = json.loads(line)
    except ValueError as e:
        raise BatchLineError(f"line: not valid JSON ({e})") from None
    if not isinstance(req, dict) or not isinstance(req.get("custom_id"), str):
        raise BatchLineError("custom_id: every line needs a string custom_id")
    cid = req["custom_id"]
    if req.get("method", "POST") != "POST":
        raise BatchLineError(f"method: only POST, got {req.get('method')!r}", cid)
    if req.get("url") not in URLS:
        raise BatchLineError(f"url: one of {', '.join(URLS)}, got {req.get('url')!r}", cid)
    if not isinstance(req.get("body"), dict):
        raise BatchLineError("body: must be a JSON object (the request as the HTTP API takes it)", cid)
    return req


def _answer(engine: Engine, url: str, body: dict, served, chat_template: str | None, admission: Admission) -> dict:
    """The HTTP API's answer to ``body`` at ``url`` (a request that does not stream)."""
    if body.get("stream"):
        raise BatchLineError("stream: a batch file's answers are whole; leave stream out")
    api = (
        oa.completion_request(body, engine, served)
        if url == URLS[0]
        else oa.chat_request(body, engine, served, chat_template)
    )
    completions = Completions([g for r in api.gens for g in engine.generate_all(r).gens])
    k = len(completions.gens)
    _take_sessions(admission, k)
    try:
        choices = oa.gather(completions)
    finally:
        admission.release(k)
    return oa.response_body(api, oa.new_id(api.chat), int(time.time()), choices, completions.gens, engine.tokenizer)


def run_batch(
    engine: Engine,
    lines: Iterable[str],
    served,
    chat_template: str | None = None,
    concurrency: int = 8,
    max_sessions: int = 64,
    progress: bool = True,
) -> list[dict]:
    """Output lines in input order (blank input lines skipped). ``concurrency`` lines decode
    at once, with at most ``max_sessions`` completions among them."""
    admission = Admission(max_sessions, max_queue=1 << 30)
    return run_concurrently(
        lambda line: answer_line(engine, line, served, chat_template, admission),
        [line for line in lines if line.strip()],
        concurrency,
        "run-batch",
        "requests",
        progress,
        every_s=5.0,
        failed=lambda out: out["error"] is not None,
    )
