"""SGLang's native ``POST /generate`` bodies, as SGLang's runtime API takes them: JSON in,
``NativeRequest`` out (through the completions request ``openai_api`` validates), and the
engine's completions back as SGLang's objects. No HTTP here; ``http_server`` is the edge.

Request: ``text`` (a string or a list of them) or ``input_ids`` (token ids, or a list of id
lists); ``sampling_params`` with SGLang's names and defaults (``max_new_tokens`` 128,
``temperature`` 1.0, ``top_k`` -1 = off, ``min_new_tokens``, ``no_stop_trim``, ``sampling_seed``,
``json_schema``, ``regex``, and the names vLLM shares); ``stream``; ``rid``; and specmesh's
``method``. Unknown fields are refused, and an error names the field as SGLang does
(``sampling_params.max_new_tokens: ...``).

Answer, per completion: ``{"text", "output_ids", "meta_info"}``, with ``meta_info`` holding
``id``, ``finish_reason`` (``{"type": "length", "length": n}``, ``{"type": "stop", "matched":
token id or stop string}``, ``{"type": "abort"}``), ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``e2e_latency``, ``spec_verify_ct`` (verification cycles) and specmesh's
``speculation``. One prompt with n = 1 answers one object, anything else a list, prompt-major.
A stream sends each completion's object so far (text and output_ids cumulative, as SGLang
streams by default) with its ``index`` and a null finish_reason until its last.

Also SGLang's ``GET /get_model_info`` (``model_info``), ``GET /get_server_info`` (``server_info``,
with ``avg_spec_accept_length``), the request ``GET /health_generate`` sends (``health_request``)
and ``POST /abort_request``'s body (``abort_target``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.metrics import decoding_totals
from services.router import openai_api as oa
from services.router.engine import GenerationRequest, InvalidRequest

FIELDS = {"text", "input_ids", "sampling_params", "stream", "rid", "method"}
DEFAULT_MAX_NEW_TOKENS = 128
# SGLang's sampling parameter → the completions field carrying it (the same name where omitted)
RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}
SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "min_new_tokens",
    "sampling_seed",
    "n",
    "logit_bias",
    "json_schema",
    "regex",
}
# a field named in an error (the completions' or the engine's name) → SGLang's, where they differ
_NAMES = {v: k for k, v in RENAMED.items()}


class NativeInvalid(InvalidRequest):
    """A refusal already worded with SGLang's names."""


@dataclass(frozen=True)
class NativeRequest:
    gens: tuple  # GenerationRequest per prompt (each completed n times)
    stream: bool
    many: bool  # the answer is a list (several prompts, or n > 1)
    structured_field: str = "json_schema"  # the sampling parameter that set the grammar, for errors


def message(e: InvalidRequest, api: NativeRequest | None = None, structured: str = "json_schema") -> str:
    """The engine's or the completions' message with its field named as SGLang names it."""
    name, sep, rest = str(e).partition(":")
    if not sep or isinstance(e, NativeInvalid):
        return str(e)
    if name in ("prompt", "prompt_token_ids"):
        return f"text{sep}{rest}"
    structured = api.structured_field if api else structured
    name = _NAMES.get(name, structured if name.startswith("structured_output") else name)
    return f"sampling_params.{name}{sep}{rest}" if name in SAMPLING else f"{name}{sep}{rest}"


def generate_request(body, engine) -> NativeRequest:
    if not isinstance(body, dict):
        raise NativeInvalid("body: must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise NativeInvalid(f"{unknown[0]}: unknown field; /generate accepts {', '.join(sorted(FIELDS))}")
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise NativeInvalid("text: set either text or input_ids")
    sp = {} if body.get("sampling_params") is None else body["sampling_params"]
    if not isinstance(sp, dict):
        raise NativeInvalid("sampling_params: must be an object")
    unknown = sorted(set(sp) - SAMPLING)
    if unknown:
        raise NativeInvalid(f"sampling_params.{unknown[0]}: unknown field; it accepts {', '.join(sorted(SAMPLING))}")
    prompt = body["text"] if body.get("text") is not None else body["input_ids"]
    many_prompts = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    completions = {
        "prompt": prompt,
        "stream": body.get("stream", False),
        "request_id": body.get("rid"),
        "method": body.get("method"),
        "max_tokens": sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
        "structured_outputs": _structured(sp),
    }
    completions |= {RENAMED.get(k, k): v for k, v in sp.items() if k not in ("max_new_tokens", "json_schema", "regex")}
    structured = "regex" if sp.get("regex") is not None else "json_schema"
    try:
        api = oa.completion_request({k: v for k, v in completions.items() if v is not None}, engine, "")
    except InvalidRequest as e:
        raise NativeInvalid(message(e, structured=structured)) from None
    return NativeRequest(api.gens, api.stream, many_prompts or api.gens[0].n > 1, structured)


def _structured(sp: dict) -> dict | None:
    kinds = [k for k in ("json_schema", "regex") if sp.get(k) is not None]
    if len(kinds) > 1:
        raise NativeInvalid("sampling_params.json_schema: set either json_schema or regex, not both")
    return {"json" if kinds[0] == "json_schema" else "regex": sp[kinds[0]]} if kinds else None


def finish_reason(g) -> dict | None:
    if g.finish_reason is None:
        return None
    if g.finish_reason == "length":
        return {"type": "length", "length": len(g.output_ids)}
    if g.finish_reason in ("eos", "stop"):
        return {"type": "stop", "matched": g.matched}
    return {"type": "abort"}


def completion(g, index: int, text: str, output_ids: list[int], final: bool, streamed: bool = False) -> dict:
    """A completion's object: whole (``final``), or as streamed so far (``text`` and
    ``output_ids`` are what the stream's steps carried; no finish reason before its last)."""
    meta = {
        "id": g.req_id,
        "finish_reason": finish_reason(g) if final else None,
        "prompt_tokens": len(g.req.prompt_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": g.cached_tokens,
        "e2e_latency": round(g.timings.wall_s, 6),
        "spec_verify_ct": g.stats.cycles,
        "speculation": oa.speculation(g),
    }
    out: dict[str, object] = {"text": text, "output_ids": list(output_ids), "meta_info": meta}
    if streamed:
        out["index"] = index
    return out


def health_request(_body, engine) -> NativeRequest:
    """SGLang's health probe: one greedy token after token id 0, kept out of the request metrics."""
    return NativeRequest(
        (GenerationRequest([0], 1, method=engine.default_method, log_metrics=False),), stream=False, many=False
    )


def model_info(engine) -> dict:
    """``GET /get_model_info``: where the target was loaded from and what it is."""
    try:
        config = json.loads((Path(engine.cfg.target) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return {
        "model_path": str(engine.cfg.target),
        "tokenizer_path": str(engine.cfg.target),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


def server_info(engine, admission, served_model: str, version: str) -> dict:
    """``GET /get_server_info``: the limits, methods and EAGLE-3 shape this server runs with,
    and SGLang's ``avg_spec_accept_length``: tokens emitted per target verification pass (τ) over every
    request this process has decoded, null before the first."""
    cycles, tokens = decoding_totals()
    return {
        "version": version,
        "model_path": str(engine.cfg.target),
        "served_model_name": served_model,
        "context_length": engine.context_len,
        "max_running_requests": admission.max_sessions,
        "max_queued_requests": admission.max_queue,
        "speculative_algorithm": engine.default_method,
        "methods": engine.methods(),
        "max_draft_tokens": dict(engine.max_draft),
        # SGLang's names for the EAGLE-3 shape (chains: depth; eagle3-tree: top-k and nodes verified)
        "speculative_num_steps": engine.cfg.eagle3_k,
        "speculative_eagle_topk": engine.cfg.eagle3_topk,
        "speculative_num_draft_tokens": engine.cfg.eagle3_tree_tokens,
        "internal_states": [
            {
                "avg_spec_accept_length": round(tokens / cycles, 4) if cycles else None,
                "num_running_reqs": admission.running,
                "num_waiting_reqs": admission.waiting,
            }
        ],
    }


def abort_target(body) -> str | None:
    """``POST /abort_request``'s body → the request id to abort, None for every request."""
    if not isinstance(body, dict):
        raise NativeInvalid("body: must be a JSON object")
    unknown = sorted(set(body) - {"rid", "abort_all"})
    if unknown:
        raise NativeInvalid(f"{unknown[0]}: unknown field; /abort_request accepts abort_all, rid")
    if not isinstance(body.get("abort_all", False), bool):
        raise NativeInvalid("abort_all: must be a boolean")
    if body.get("abort_all"):
        return None
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise NativeInvalid("rid: the request id to abort (a non-empty string), or abort_all: true")
    return rid
