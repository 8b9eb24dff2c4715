"""vLLM's ``--speculative-config`` (a JSON object) read into the engine's configuration, so the
speculative settings of a vLLM launch command carry over to ``specmesh serve``.

Keys, as vLLM names them:
- ``method`` (required): vLLM's ``eagle3`` (our EAGLE-3 head), ``draft_model`` (our ``sd``),
  ``ngram``, ``suffix``, or any specmesh method (``hybrid``, ``hybrid-csd``, ...). It becomes
  the server's default method; ``serve`` stops if its drafter did not load.
- ``model``: the drafter's directory: the EAGLE-3 head for methods that draft with it (the
  hybrids included), the draft LM for ``draft_model`` / ``sd`` / ``csd`` / ``scg``.
- ``num_speculative_tokens``: the longest draft of the method's drafter: the EAGLE-3 chain
  (``--eagle3-k``), the draft LM's chain (``-k``), ngram's k, or the suffix cache's
  ``max_spec_tokens`` for ``suffix``.
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (``ngram``), ``suffix_decoding_max_tree_depth``,
  ``suffix_decoding_max_spec_factor``, ``suffix_decoding_min_token_prob``,
  ``suffix_decoding_max_cached_requests`` (methods that draft from the suffix cache), and
  ``disable_by_batch_size`` (``--spec-disable-batch``).
Any other key, or one the method does not use, is refused with a message naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: config.py applies this module
    from services.common.config import EngineConfig

VLLM_METHODS = {"eagle3": "eagle3", "draft_model": "sd", "ngram": "ngram", "suffix": "suffix"}  # vLLM's "eagle"
# (EAGLE-1/2 heads) is not among them: the engine loads EAGLE-3 heads only
SUFFIX_DRAFTERS = {"suffix", "suffix-tree", "hybrid", "hybrid-rule", "hybrid-tree", "hybrid-lm"}
SUFFIX_KEYS = {
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "suffix_decoding_max_cached_requests",
}
KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
} | SUFFIX_KEYS


def apply_speculative_config(cfg: EngineConfig, spec, methods: Mapping[str, Any]) -> EngineConfig:
    """``cfg`` with vLLM's speculative config applied. ``methods``: specmesh's methods by name,
    each with its ``router_drafter`` and ``model_drafter``. Raises ValueError naming the key
    to fix."""
    if not isinstance(spec, dict):
        raise ValueError('speculative_config: must be a JSON object, e.g. {"method": "eagle3", "model": DIR}')
    unknown = sorted(set(spec) - KEYS)
    if unknown:
        raise ValueError(
            f"speculative_config: unsupported key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(KEYS))}"
        )
    name = spec.get("method")
    method = VLLM_METHODS.get(name, name) if isinstance(name, str) else None
    if method is None or method not in methods:
        raise ValueError(
            f"speculative_config.method: {name!r} is not supported; choose vLLM's "
            f"{', '.join(VLLM_METHODS)} or one of specmesh's {', '.join(methods)}"
        )
    router, model = methods[method].router_drafter, methods[method].model_drafter
    eagle = model in ("eagle3", "eagle3-tree", "model")
    cfg = replace(cfg, default_method=method)
    if "model" in spec:
        path = Path(_typed(spec, "model", str, "a directory"))
        if not (eagle or model == "draft-lm"):
            raise ValueError(f"speculative_config.model: method {name!r} drafts with no model")
        if not (path / "config.json").is_file():
            raise ValueError(f"speculative_config.model: {path} holds no config.json (a Hugging Face model directory)")
        cfg = replace(cfg, eagle3=path) if eagle else replace(cfg, draft=path)
    if "num_speculative_tokens" in spec:
        cfg = _num_tokens(cfg, _count(spec, "num_speculative_tokens", 1), name, router, model, eagle)
    if "prompt_lookup_min" in spec or "prompt_lookup_max" in spec:
        if router != "ngram":
            raise ValueError(f"speculative_config.prompt_lookup_min/max: only with method ngram, not {name!r}")
        lo = _count(spec, "prompt_lookup_min", 1, cfg.ngram.min_n)
        hi = _count(spec, "prompt_lookup_max", lo, max(lo, cfg.ngram.max_n))
        cfg = replace(cfg, ngram=replace(cfg.ngram, min_n=lo, max_n=hi))
    if SUFFIX_KEYS & set(spec):
        if router not in SUFFIX_DRAFTERS:
            raise ValueError(
                f"speculative_config.suffix_decoding_*: only with methods that draft from the suffix "
                f"cache, not {name!r}"
            )
        cfg = replace(cfg, suffix=_suffix(cfg, spec))
    if "disable_by_batch_size" in spec:
        cfg = replace(cfg, spec_disable_batch=_count(spec, "disable_by_batch_size", 1))
    return cfg


def _num_tokens(cfg: EngineConfig, k: int, name, router, model, eagle: bool) -> EngineConfig:
    if eagle:
        return replace(cfg, eagle3_k=k)
    if model == "draft-lm":
        return replace(cfg, num_speculative_tokens=k)
    if router == "ngram":
        return replace(cfg, ngram=replace(cfg.ngram, k=k))
    if router in SUFFIX_DRAFTERS:
        return replace(cfg, suffix=replace(cfg.suffix, spec=replace(cfg.suffix.spec, max_spec_tokens=k)))
    raise ValueError(f"speculative_config.num_speculative_tokens: method {name!r} drafts nothing")


def _suffix(cfg: EngineConfig, spec: dict):
    s = cfg.suffix
    depth = _count(spec, "suffix_decoding_max_tree_depth", 1, s.max_depth)
    cached = _count(spec, "suffix_decoding_max_cached_requests", 0, s.max_cached_requests)
    factor = float(
        _typed(spec, "suffix_decoding_max_spec_factor", (int, float), "a number > 0", s.spec.max_spec_factor)
    )
    prob = float(
        _typed(spec, "suffix_decoding_min_token_prob", (int, float), "a number in [0, 1]", s.spec.min_token_prob)
    )
    if factor <= 0:
        raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor: must be > 0, got {factor}")
    if not 0 <= prob <= 1:
        raise ValueError(f"speculative_config.suffix_decoding_min_token_prob: must be in [0, 1], got {prob}")
    return replace(
        s,
        max_depth=depth,
        max_cached_requests=cached,
        spec=replace(s.spec, max_spec_factor=factor, min_token_prob=prob),
    )


def _typed(spec: dict, key: str, kinds, what: str, default=None):
    v = spec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise ValueError(f"speculative_config.{key}: must be {what}, got {v!r}")
    return v


def _count(spec: dict, key: str, low: int, default: int | None = None) -> int:
    v = _typed(spec, key, int, f"an integer >= {low}", default)
    if v < low:
        raise ValueError(f"speculative_config.{key}: must be an integer >= {low}, got {v}")
    return v
