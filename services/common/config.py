"""Frozen configuration dataclasses. Nothing here reads the environment at import: the
models directory and the options a deployment sets through environment variables are read when
a configuration is built (``models_dir``, ``Option.fallback``), at start."""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.common.security import TokenFile
from services.common.speculative_config import apply_speculative_config

CHECKOUT_MODELS = Path(__file__).resolve().parents[2] / "models"
INSTALLED_MODELS = ("share", "specmesh", "models")  # under the install prefix (pyproject's data-files)


def models_dir() -> Path:
    """The bundled models: ``SPECMESH_MODELS`` when set, else a checkout's ``models/``, else the
    copy a wheel installed under its prefix (``<prefix>/share/specmesh/models``). A directory
    without them is refused where a model is loaded, naming the path."""
    if env := os.environ.get("SPECMESH_MODELS"):
        return Path(env)
    if (CHECKOUT_MODELS / "target" / "config.json").exists():
        return CHECKOUT_MODELS
    installed = Path(sysconfig.get_path("data")).joinpath(*INSTALLED_MODELS)
    return installed if installed.exists() else CHECKOUT_MODELS


def _bundled(name: str):
    return field(default_factory=lambda: models_dir() / name)


@dataclass(frozen=True)
class SpecParams:
    """SuffixDecoding speculation limits (ArcticInference's defaults)."""

    max_spec_tokens: int = 16  # cap on draft length
    max_spec_factor: float = 1.0  # draft length ≤ match_len · factor + offset
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop when the running probability falls below this


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 64
    max_cached_requests: int = 1000  # global tree keeps the outputs of the last N requests (FIFO)
    spec: SpecParams = SpecParams()
    tree: bool = False  # draft speculation trees (lossless verification walks them), not paths
    compiled: bool = True  # the compiled tree (_suffix_tree.cpp) when built; else the Python reference
    live_outputs: bool = True  # outputs enter the global tree as they grow, not only when finished
    # a step's new tokens enter the global tree after the step is sent (off the device's path),
    # so its drafts miss only the same step's tokens there (the compiled batched step)
    lag_live: bool = True


@dataclass(frozen=True)
class NgramConfig:
    """The `ngram` baseline (vLLM's prompt_lookup_min / prompt_lookup_max /
    num_speculative_tokens): drafts the k tokens after the earliest earlier occurrence of the
    longest suffix of n tokens, min_n ≤ n ≤ max_n."""

    min_n: int = 2
    max_n: int = 4
    k: int = 5


@dataclass(frozen=True)
class GateConfig:
    """Semantic Consistency Gating: a rejected draft token d (target prefers t) is rescued when
    count(d, t) ≥ min_count in the correction memory (skipped when use_memory is False: the
    `scg` ablation), d is in the target's top_k, logit(d) − logit(t) ≥ log(tau), and the
    target, given d, takes the next ``confirm`` draft tokens as they are (0: no such check; a
    draft token with fewer than ``confirm`` after it is then never rescued).
    Defaults: bench/results/csd_sweep.* (τ, top-k, min_count) and csd_quality_* (100 prompts
    each): confirm = 1 kept τ (1.011× against 1.016× sd's on humaneval, 1.034× against 1.050×
    on stdlib-heldout) and cut the NLL rise from +6.3 % to +2.3 % on humaneval (+0.5 % both on
    stdlib-heldout, with a narrower interval)."""

    min_count: float = 3.0
    top_k: int = 2
    tau: float = 0.5
    use_memory: bool = True
    confirm: int = 1


@dataclass(frozen=True)
class HybridConfig:
    tau: float = 2.0  # verify the cache draft when the predicted yield exceeds tau (bench.hybrid_sweep)
    score_threshold: float = 2.0  # hybrid-rule baseline: verify when the suffix score reaches this (its best too)
    cost_aware: bool = True  # hybrid: weigh ŷ against measured cycle costs instead of tau (drafter/hybrid.py)


@dataclass(frozen=True)
class EngineConfig:
    target: Path = _bundled("target")
    draft: Path | None = _bundled("draft")
    # EAGLE-3: the TTT head; 4-token chains. For the stage-2 head k = 3 and k = 4 tie by speed on
    # CPU (bench/results/eagle3_sweep*.md, eagle3_k_*.md) and k = 4 has the higher τ (2.62
    # against 2.42 on humaneval); it is also the GPU's choice. The stage-1 head's best was k = 3.
    eagle3: Path | None = _bundled("eagle3")  # loaded when the directory holds a head
    eagle3_k: int = 4  # EAGLE-3 chain length
    # EAGLE-3 chains stop after a token with max q below this. On CPU a cheaper cycle beats a longer
    # chain: 0.35 against 0.1 gave 1.39× against 1.35× on humaneval and 1.24× against 1.18× on
    # stdlib-heldout, at τ 2.35 against 2.62 and 2.15 against 2.35 (bench/results/eagle3_confidence_*.md).
    eagle3_confidence: float = 0.35
    # EAGLE draft trees (method eagle3-tree; SGLang's speculative_eagle_topk and
    # speculative_num_draft_tokens): top-k children per expanded node, nodes kept for verification.
    eagle3_topk: int = 2
    eagle3_tree_tokens: int = 8
    eagle3_tree_min_score: float = 0.0  # nodes whose path probability is below it are not drafted
    predictor: Path | None = _bundled("predictor")  # HVD yield predictor, loaded when present
    hybrid: HybridConfig = HybridConfig()
    device: str = "cpu"
    dtype: str = "float32"
    num_speculative_tokens: int = 4  # k for model drafters; tuned by `python -m bench`
    packed_gemm: bool = True  # CPU: fp16-weight FBGEMM GEMMs (services/common/packed_linear.py)
    # The target's logits for a position do not depend on what shares its step (services/common/
    # invariant.py), so lossless methods equal vanilla bit for bit; None: on in bfloat16 and float16.
    batch_invariant: bool | None = None
    # Draft-LM and EAGLE-3 chains of unconstrained requests (sampled ones draw on the device) and
    # EAGLE draft trees keep their tokens on the device and are read once per draft, not once per position or tree level;
    # a confidence cut then comes after the whole chain is drafted. None: on for CUDA (a read
    # stalls the queue), off on the CPU (the cut saves the steps it skips; a read costs nothing).
    device_drafts: bool | None = None
    # Single-session target steps in static shapes (services/common/graphs.py), replayed from CUDA
    # graphs on a GPU; off: on this CPU the static step is slower (bench/results/compile.md).
    static_steps: bool = False
    kv_pool: bool = False  # pooled K/V slots: one attention call per layer for a step's sessions
    #                                       (services/common/kv_pool.py; no gain on this CPU, meant for GPUs)
    draft_confidence: float = 0.3  # draft-LM chains stop after a token with max q below this
    draft_vocab: int = -1  # draft LM's head over the N most frequent tokens (FR-Spec); 0 = all;
    #                                       -1 = 4,096 where a ranking ships beside the draft, else all
    max_new_tokens_limit: int = 1024
    max_model_len: int = 0  # prompt + max_new_tokens at most this (vLLM's); 0 = the target's positions
    default_max_new_tokens: int = 128
    default_method: str = "hybrid"  # lossless; falls back, see Engine
    threads: int = 0  # torch intra-op threads; 0 = torch default
    max_batch: int = 16  # sessions verified together in one step
    micro_batches: int = (
        0  # the router's sessions in this many alternating steps (2: drafting overlaps a step; 0: auto)
    )
    spec_disable_batch: int = 0  # no drafts while a
    #                                       verifier step batches more sessions than this; 0 = never (bench.serving)
    batch_window_ms: float = 5.0  # a step waits at most this long for the sessions it expects (per-session streams)
    prefill_chunk: int = 128  # beside decoding sessions, a
    #                                       prompt prefills at most this many tokens per step; 0 = whole (bench.prefill)
    prefix_cache_mb: int = 256  # verified state of full
    #                                       blocks (target, draft LM, EAGLE-3 head) kept for later prompts; 0 = off (bench.prefix_cache)
    prefix_block: int = 32  # tokens per prefix-cache block: a prompt reuses whole blocks only
    suffix: SuffixConfig = SuffixConfig()
    ngram: NgramConfig = NgramConfig()
    redis_url: str | None = None  # shared state across replicas; None = process-local only
    gate: GateConfig = GateConfig()
    predictor_addr: str | None = None  # use a remote Predictor service instead of the in-process MLP
    drafter_addr: str | None = None  # use a remote suffix-cache Drafter service
    memory_addr: str | None = None  # share the correction memory through the Memory service
    state_dir: Path | None = None  # correction-memory counts a shutdown could not write, for the next start
    ocm_snapshot: Path | None = _bundled("ocm_snapshot.json")  # calibration prior, loaded when present
    memory_pooled: bool = False  # salted requests share the correction memory too (default: one per salt)
    tensor_parallel: int = 1  # a verifier replica's target split over this many processes (gloo; NCCL on GPUs)

    @property
    def invariant_verification(self) -> bool:
        """``batch_invariant`` as set, else on in reduced precision (bfloat16, float16)."""
        return self.dtype != "float32" if self.batch_invariant is None else self.batch_invariant

    @property
    def drafts_on_device(self) -> bool:
        """``device_drafts`` as set, else on for CUDA devices."""
        return self.device.startswith("cuda") if self.device_drafts is None else self.device_drafts

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], methods: Mapping[str, Any] | None = None) -> EngineConfig:
        """The configuration that option values (``OPTIONS``' names: the CLI's flags, the Ray
        app's args, the chart's values through either) describe; an option left out takes its
        environment variable, else its default. Paths default under ``models_dir`` (a draft or
        head directory without ``config.json`` is left out); ``speculative_config`` (vLLM's) is
        applied last, against the engine's ``methods``. Raises ValueError naming the option."""
        unknown = sorted(set(values) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(OPTIONS))}")
        v: dict[str, Any] = {name: opt.value(values) for name, opt in OPTIONS.items()}
        models = v.pop("models_dir") or models_dir()
        paths: dict[str, Any] = {
            name: v.pop(name) or models / name for name in ("target", "draft", "eagle3", "predictor")
        }
        for name in ("draft", "eagle3"):
            if not (paths[name] / "config.json").exists():
                paths[name] = None
        device = v.pop("device") or _auto_device()
        dtype = v.pop("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        spec = v.pop("speculative_config")
        for name, opt in OPTIONS.items():  # options that set a field of a nested config
            if len(opt.path) > 1:
                part = opt.path[0]
                v[part] = _replaced(v.get(part, getattr(cls, part)), opt.path[1:], v.pop(name))
        cfg = cls(**paths, **v, device=device, dtype=dtype, ocm_snapshot=models / "ocm_snapshot.json")
        if spec is None:
            return cfg
        if methods is None:
            raise ValueError("speculative_config: needs the engine's methods to resolve")
        return apply_speculative_config(cfg, spec, methods)


def _auto_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# -- the option table: every engine option once, for the CLI, the Ray app and the chart ---------------
def _int(text: Any, low: int | None = None, what: str = "a whole number") -> int:
    if isinstance(text, bool) or isinstance(text, float) and not text.is_integer():
        raise ValueError(f"expected {what}, got {text!r}")
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"expected {what}, got {text!r}") from None
    if low is not None and n < low:
        raise ValueError(f"expected {what}, got {text!r}")
    return n


def _bool(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    if str(text).lower() in ("1", "true", "yes", "on"):
        return True
    if str(text).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _ngram(text: Any) -> NgramConfig:
    if isinstance(text, NgramConfig):
        return text
    try:
        lo, hi, k = (int(x) for x in str(text).split(":"))
        if not 1 <= lo <= hi or k < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"{text!r}: give MIN:MAX:K with 1 <= MIN <= MAX and K >= 1, e.g. 2:4:5") from None
    return NgramConfig(lo, hi, k)


def _json_object(text: Any) -> dict:
    if isinstance(text, dict):
        return text
    try:
        v = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(v, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    return v


def _float(text: Any) -> float:
    if isinstance(text, bool):
        raise ValueError(f"expected a number, got {text!r}")
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {text!r}") from None


def _seconds(text: Any) -> float:
    x = _float(text)
    if not x > 0:
        raise ValueError(f"expected a number of seconds > 0, got {text!r}")
    return x


def _names(text: Any) -> tuple[str, ...]:
    """One name or several: a list, or comma-separated (an environment variable's, or a flag's
    `--verifiers a:1,b:2`); no name holds a comma."""
    items = [text] if isinstance(text, str) else list(text)
    return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())


PARSE: dict[str, Callable[[Any], Any]] = {
    "int": _int,
    "count": lambda t: _int(t, 0, "a whole number >= 0 (0 = off)"),
    "positive": lambda t: _int(t, 1, "a whole number >= 1"),
    "float": _float,
    "bool": _bool,
    "path": lambda t: None if t is None else Path(t),
    "str": lambda t: None if t is None else str(t),
    "ngram": _ngram,
    "json": _json_object,
    "seconds": _seconds,
    "names": _names,
}


def _replaced(config: Any, path: list[str], value: Any) -> Any:
    """``config`` (a frozen dataclass) with the field at dotted ``path`` set to ``value``."""
    head = path[0]
    if len(path) > 1:
        value = _replaced(getattr(config, head), path[1:], value)
    return replace(config, **{head: value})


@dataclass(frozen=True)
class Option:
    """One engine option: ``name`` is the mapping key and Ray arg, ``--name-with-dashes`` the
    flag; it sets EngineConfig's field ``sets`` (dotted into a nested config, e.g.
    ``hybrid.tau``; by default the field named ``name``), whose default it has unless
    ``default`` says otherwise."""

    name: str
    kind: str  # a key of PARSE
    help: str
    env: str | None = None  # the environment variable that sets it when it is left out
    default: Any = "field"  # "field": EngineConfig's default; else this value
    short: str | None = None  # a one-letter flag
    serve_only: bool = False  # a flag of `specmesh serve` only (remote components)
    secret: bool = False  # may carry a password: never on a spawned process's command line
    sets: str = ""  # the EngineConfig field it sets, dotted; "" = name
    owner: Any = None  # the config whose field it sets: None = EngineConfig (ServerConfig's: SERVER_OPTIONS)
    choices: tuple[str, ...] = ()  # the values it takes, when they are a fixed few

    @property
    def path(self) -> list[str]:
        return (self.sets or self.name).split(".")

    def parse(self, value: Any) -> Any:
        try:
            parsed = PARSE[self.kind](value)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        if self.choices and parsed not in self.choices:
            raise ValueError(f"{self.name}: {parsed!r} is not one of {', '.join(self.choices)}")
        return parsed

    def fallback(self) -> Any:
        """What the option is when it is left out: its environment variable, else its default."""
        if self.env and (text := os.environ.get(self.env)) is not None and text != "":
            return self.parse(text)
        if self.default != "field":
            return self.default
        value: Any = self.owner or EngineConfig
        for part in self.path:
            value = getattr(value, part)
        return value

    def value(self, values: Mapping[str, Any]) -> Any:
        return self.parse(values[self.name]) if values.get(self.name) is not None else self.fallback()


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        Option(
            "models_dir",
            "path",
            "where target, draft, eagle3 and predictor default to: env SPECMESH_MODELS, else a "
            "checkout's models/, else the bundled models a wheel installed under <prefix>/share/specmesh",
            env="SPECMESH_MODELS",
            default=None,
        ),
        Option("target", "path", "HF model directory of the target (default: MODELS/target)", default=None),
        Option("draft", "path", "HF model directory of the draft LM (default: MODELS/draft)", default=None),
        Option(
            "eagle3",
            "path",
            "EAGLE-3 head directory, ours or a published one for the same target (default: MODELS/eagle3)",
            default=None,
        ),
        Option("predictor", "path", "HVD yield predictor directory (default: MODELS/predictor)", default=None),
        Option("device", "str", "cpu or cuda (default: cuda when available)", default=None),
        Option("dtype", "str", "float32 (CPU default), float16, bfloat16 (CUDA default)", default=None),
        Option(
            "num_speculative_tokens",
            "positive",
            "the longest draft-LM chain (vLLM's num_speculative_tokens)",
            short="-k",
        ),
        Option("eagle3_k", "positive", "the longest EAGLE-3 chain"),
        Option("eagle3_confidence", "float", "EAGLE-3: end a chain after a token whose head probability is below this"),
        Option(
            "ngram",
            "ngram",
            "the ngram method: match the last MIN..MAX tokens, draft K (vLLM's prompt_lookup_min, "
            "prompt_lookup_max, num_speculative_tokens)",
        ),
        Option(
            "eagle3_topk",
            "positive",
            "eagle3-tree / hybrid-tree: children per expanded node of an EAGLE draft tree (1: no tree methods)",
        ),
        Option("eagle3_tree_tokens", "positive", "eagle3-tree: draft-tree nodes verified per cycle"),
        Option(
            "eagle3_tree_min_score",
            "float",
            "eagle3-tree: leave out nodes whose path probability under the head is below this",
        ),
        Option(
            "hybrid_tau",
            "float",
            "HVD: verify the suffix-cache draft when its predicted yield exceeds this "
            "(bench.hybrid_sweep); used with --no-hybrid-cost-aware",
            sets="hybrid.tau",
        ),
        Option(
            "hybrid_cost_aware",
            "bool",
            "HVD: weigh the predicted yield against measured cycle costs (model drafter or plain step)",
            sets="hybrid.cost_aware",
        ),
        Option(
            "suffix_max_depth",
            "positive",
            "suffix cache: the longest context match and tree depth (ArcticInference's suffix_decoding_max_tree_depth)",
            sets="suffix.max_depth",
        ),
        Option(
            "suffix_max_draft",
            "positive",
            "suffix cache: the longest draft (ArcticInference's suffix_decoding_max_spec_tokens)",
            sets="suffix.spec.max_spec_tokens",
        ),
        Option(
            "suffix_live_outputs",
            "bool",
            "suffix cache: outputs enter the shared tree as they are generated, not only when they "
            "finish (as ArcticInference does; bench/results/suffix_micro.md)",
            sets="suffix.live_outputs",
        ),
        Option(
            "suffix_lag_live",
            "bool",
            "suffix cache: a step's live-output tokens enter the shared tree once the step is sent, "
            "while the verifier works, not before its drafts (which then miss only that step's own "
            "tokens there; docs/decisions.md)",
            sets="suffix.lag_live",
        ),
        Option(
            "batch_invariant",
            "bool",
            "verify so that a position's target logits do not depend on the draft length or the "
            "sessions beside it, so lossless methods give vanilla's tokens bit for bit in reduced "
            "precision (bench/results/bf16_lossless.md); default: on in bfloat16 and float16",
            default=None,
        ),
        Option(
            "device_drafts",
            "bool",
            "draft-LM and EAGLE-3 chains of requests without penalties, bias, bad words or grammars "
            "(sampled ones draw on the device) and EAGLE draft trees keep their tokens on the device and are read by the host once per draft, not once per token "
            "or tree level (a confidence cut then comes after the whole chain); default: on for CUDA, "
            "off on the CPU",
            default=None,
        ),
        Option(
            "static_steps",
            "bool",
            "single-session decode and verification steps run in static shapes, replayed from CUDA "
            "graphs on a GPU (one graph per session and step length); on the CPU they run eagerly and "
            "are slower (bench/results/compile.md)",
        ),
        Option("packed_gemm", "bool", "CPU: run fp16-exact layers on FBGEMM's fp16-weight GEMM (same results, faster)"),
        Option(
            "kv_pool",
            "bool",
            "keep sessions' K/V in pooled slots, so a batched step attends for all of them in one "
            "call per layer instead of one per session (for accelerators; no gain on a CPU: bench/results/kv_pool*.md)",
        ),
        Option(
            "draft_confidence", "float", "draft LM: end a chain after a token whose draft probability is below this"
        ),
        Option(
            "draft_vocab",
            "int",
            "draft LM: LM head over the N most frequent tokens (FR-Spec; needs the ranking shipped "
            "beside the draft, python -m training.vocab); 0 = the whole vocabulary; -1 = 4096 where a ranking ships, "
            "else the whole vocabulary",
        ),
        Option("threads", "count", "torch intra-op threads (0 = torch's default)"),
        Option(
            "max_batch",
            "positive",
            "verifier: sessions whose cycles one step verifies together (vLLM's --max-num-seqs); more wait for the next step",
        ),
        Option(
            "micro_batches",
            "count",
            "router: run each replica's sessions in this many alternating steps, so the router drafts for one "
            "while the verifier runs another (2 pays each step's fixed cost twice); 0 = auto: 2 for a remote "
            "verifier replica from 128 sessions (64 under Ray), and in process whichever of 1 and 2 a short "
            "trial on the live load measures faster from 32 sessions (services/router/overlap.py), else 1 "
            "(bench/results/control_plane_overlap_tuner/)",
        ),
        Option(
            "batch_window_ms",
            "float",
            "verifier: how long a step waits for the other open sessions' cycles (per-session streams; a "
            "router's step over the Link or Serve waits for no one)",
        ),
        Option(
            "prefill_chunk",
            "count",
            "verifier: while other sessions are decoding, a new prompt is prefilled at most "
            "this many tokens per step; 0 = whole prompts in one step",
            env="SPECMESH_PREFILL_CHUNK",
        ),
        Option(
            "prefix_cache_mb",
            "count",
            "verifier: keep the verified state of full prompt blocks, up to this many MB on "
            "the model's device, for later prompts that start the same way; 0 = off",
            env="SPECMESH_PREFIX_CACHE_MB",
        ),
        Option(
            "spec_disable_batch",
            "count",
            "router: draft nothing while the verifier batches more sessions than this per step; 0 = always speculate",
            env="SPECMESH_SPEC_DISABLE_BATCH",
        ),
        Option(
            "max_model_len",
            "count",
            "verifier: a request's prompt + max_new_tokens may fill at most this many tokens "
            "(vLLM's --max-model-len); 0 = the target's max_position_embeddings",
        ),
        Option("max_new_tokens_limit", "positive", "the most new tokens a request may ask for"),
        Option(
            "default_method",
            "str",
            "the method of requests that name none (lossless; falls back to eagle3, sd, "
            "vanilla where models are missing, with a warning at start)",
            env="SPECMESH_DEFAULT_METHOD",
        ),
        Option(
            "redis_url",
            "str",
            "share state across replicas through Redis; default: none (a password in it is never logged; prefer "
            "the env var to the flag, which `ps` shows, and the password in SPECMESH_REDIS_PASSWORD to the URL)",
            env="SPECMESH_REDIS_URL",
            secret=True,
        ),
        Option(
            "state_dir",
            "path",
            "where a verifier keeps the shared correction-memory counts it could not write at shutdown (Redis "
            "or the memory service down), sent on its next start; default: none (they are dropped, with a warning)",
            env="SPECMESH_STATE_DIR",
        ),
        Option(
            "tensor_parallel",
            "positive",
            "verifier: split the target over this many processes per replica (tensor parallelism, "
            "Megatron style: heads, MLP width and vocabulary divided; gloo on the CPU, NCCL and a GPU per rank "
            "on cuda), for a target larger than one device; the sizes must divide the target's heads, MLP "
            "width and vocabulary",
            env="SPECMESH_TENSOR_PARALLEL",
        ),
        Option(
            "memory_pooled",
            "bool",
            "verifier: requests with a cache_salt read and grow the shared correction memory as the others "
            "do; default: each salt has one of its own on each verifier replica, started from the "
            "calibration prior and never shared, so one tenant's divergence pairs never change another's "
            "csd outputs",
            env="SPECMESH_MEMORY_POOLED",
        ),
        Option(
            "speculative_config",
            "json",
            'vLLM\'s speculative config, e.g. \'{"method": "eagle3", "model": DIR, '
            '"num_speculative_tokens": 4}\': its method becomes the default, its keys set the drafter '
            "(services/common/speculative_config.py); applied over the options above",
            default=None,
        ),
        Option(
            "predictor_addr",
            "str",
            "router: use this Predictor service",
            env="SPECMESH_PREDICTOR_ADDR",
            serve_only=True,
        ),
        Option(
            "drafter_addr",
            "str",
            "router: use this suffix-cache Drafter service",
            env="SPECMESH_DRAFTER_ADDR",
            serve_only=True,
        ),
        Option(
            "memory_addr",
            "str",
            "verifier: share the correction memory through this Memory service",
            env="SPECMESH_MEMORY_ADDR",
            serve_only=True,
        ),
    ]
}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_sessions: int = 8  # concurrent Generate streams
    max_queue: int = 32  # requests waiting for a stream slot; beyond → RESOURCE_EXHAUSTED
    workers: int = 16
    max_message_bytes: int = 4 * 1024 * 1024
    metrics_port: int = 9400  # Prometheus /metrics; 0 = off
    tls_cert: Path | None = None  # serve TLS with this certificate + key
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # and require client certificates signed by this CA (mTLS)
    # require `authorization: Bearer <token>` on the public API (a TokenFile: re-read when rotated)
    auth_token: str | TokenFile | None = None
    # the admin endpoints (aborts, prefix-cache resets) take this token instead of auth_token
    admin_token: str | TokenFile | None = None
    http_port: int = 8000  # OpenAI-compatible HTTP API (/v1/completions, ...); 0 = off
    served_model_name: tuple[str, ...] | str = ()  # the model's names in the HTTP API (answers carry the
    #                                       first); empty = the target's directory name
    chat_template: Path | None = None  # Jinja chat template for /v1/chat/completions; None = the tokenizer's
    vllm_metric_names: bool = True  # /metrics also under vLLM's names (services/common/vllm_metrics.py)
    health_check_timeout_s: float = 20.0  # GET /health_generate's wait for progress (SGLang's default)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins the HTTP API answers (none: no CORS headers)
    response_stats: bool = False  # each response says how it was decoded and its prompt's cached tokens

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServerConfig:
        """The server settings that option values (``SERVER_OPTIONS``' names: `specmesh serve`'s
        flags, the Ray app's args for its ingress) describe; one left out takes its default.
        TLS and the bearer token come from files and the environment, not from here."""
        return cls(**{opt.path[0]: opt.value(values) for opt in SERVER_OPTIONS.values()})


def _server(name: str, kind: str, help: str, **kw) -> Option:
    return Option(name, kind, help, owner=ServerConfig, **kw)


# The public server's options (`specmesh serve`, `specmesh batch` takes some): each sets the
# ServerConfig field of its name (or ``sets``). The Ray app's ingress takes the same names.
SERVER_OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        _server("host", "str", "address to listen on"),
        _server("port", "int", "gRPC port (Generate, health, reflection)"),
        _server(
            "max_sessions",
            "positive",
            "concurrent sessions this server runs: Generate streams and HTTP completions on a router "
            "or an embedded server (a request for n completions takes n); sessions a verifier holds",
        ),
        _server("max_queue", "count", "requests waiting for a session slot before RESOURCE_EXHAUSTED (HTTP 429)"),
        _server("metrics_port", "count", "Prometheus /metrics port (0 = off)"),
        _server(
            "http_port",
            "count",
            "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on this "
            "port, router and embedded only (0 = off)",
        ),
        _server(
            "served_model_name",
            "names",
            "the model's names in the HTTP API: requests may use any, answers carry the first "
            "(vLLM's; default: the target's directory name)",
        ),
        _server(
            "vllm_metric_names",
            "bool",
            "/metrics also carries vLLM's names (vllm:spec_decode_*, vllm:num_requests_running, ...) with "
            "its model_name label, for dashboards written for vLLM (router, verifier and embedded; the Ray "
            "app's node exporter always does)",
        ),
        _server(
            "allowed_origins",
            "names",
            "CORS: browser origins the HTTP API answers (default: none, no CORS headers; * for any, vLLM's default)",
        ),
        _server(
            "response_stats",
            "bool",
            "each response also says how it was decoded (its speculation stats: cycles, drafted, accepted "
            "and rescued tokens, τ) and how many prompt tokens the prefix cache gave (off by default, as "
            "vLLM's --enable-prompt-tokens-details: across tenants they hint at what others sent)",
        ),
        _server(
            "health_check_timeout",
            "seconds",
            "GET /health_generate answers 503 when no token is generated within this many seconds "
            "(SGLang's SGLANG_HEALTH_CHECK_TIMEOUT)",
            sets="health_check_timeout_s",
        ),
        _server(
            "chat_template",
            "path",
            "Jinja chat template for /v1/chat/completions (default: the tokenizer's, if it has one)",
        ),
    ]
}


def option_flags(values: Mapping[str, Any]) -> list[str]:
    """The `specmesh` flags that give these option values (a spawned process's command line),
    in the table's order; options left out or None give none, and secrets none (``secret_env``)."""
    flags: list[str] = []
    for name, opt in OPTIONS.items():
        v = values.get(name)
        if v is None or opt.secret:
            continue
        flag = f"--{name.replace('_', '-')}"
        if opt.kind == "bool":
            flags.append(flag if opt.parse(v) else f"--no-{name.replace('_', '-')}")
        elif opt.kind == "ngram":
            n = opt.parse(v)
            flags += [flag, f"{n.min_n}:{n.max_n}:{n.k}"]
        elif opt.kind == "json":
            flags += [flag, json.dumps(opt.parse(v))]
        else:
            flags += [flag, str(v)]
    return flags


def secret_env(values: Mapping[str, Any]) -> dict[str, str]:
    """The secret options' values as their environment variables, for a spawned process (its
    environment is private to its user; its command line is not)."""
    return {o.env: str(values[n]) for n, o in OPTIONS.items() if o.secret and o.env and values.get(n) is not None}


@dataclass(frozen=True)
class Topology:
    """How `specmesh serve` lays the system out (``TOPOLOGY_OPTIONS``)."""

    kind: str = "embedded"  # embedded | distributed
    role: str = "all"  # all | router | verifier | predictor | drafter | memory
    verifiers: tuple[str, ...] = ()  # a router's verifier replicas (distributed: spawned when none)
    replicas: int = 2  # verifier processes a distributed topology spawns
    verifier_link: str = "multiplex"  # one Link per replica for all sessions, or a stream per session
    affinity_slack: int | None = 2  # prefix-affinity placement's allowance (common/affinity.py)
    verifier_timeout_s: float = 10.0  # a replica's least budget per cycle before it counts as hung

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Topology:
        """The topology that `specmesh serve`'s topology options describe (``TOPOLOGY_OPTIONS``'
        names); one left out takes its environment variable, else its default."""
        return cls(**{opt.path[0]: opt.value(values) for opt in TOPOLOGY_OPTIONS.values()})


def _topology(name: str, kind: str, help: str, **kw) -> Option:
    return Option(name, kind, help, owner=Topology, **kw)


# `specmesh serve`'s layout: where each service runs and how the router reaches the verifiers.
TOPOLOGY_OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        _topology(
            "topology",
            "str",
            "embedded: every service in this process; distributed: verifier replicas as processes of "
            "their own (spawned on loopback unless --verifiers names them) and the router here",
            sets="kind",
            choices=("embedded", "distributed"),
            env="SPECMESH_TOPOLOGY",
        ),
        _topology(
            "role",
            "str",
            "all: the topology's services; or one service alone (a router, a verifier replica, the "
            "predictor, the suffix-cache drafter, the memory service), as the Helm chart runs them",
            choices=("all", "router", "verifier", "predictor", "drafter", "memory"),
            env="SPECMESH_ROLE",
        ),
        _topology(
            "verifiers",
            "names",
            "router: the verifier replicas' addresses (host:port)",
            env="SPECMESH_VERIFIERS",
        ),
        _topology("replicas", "positive", "distributed topology: verifier processes to start"),
        _topology(
            "verifier_link",
            "str",
            "router: one multiplexed Link per verifier replica carrying every session (one message "
            "per step each way), or one Session stream per request",
            choices=("multiplex", "stream"),
            env="SPECMESH_VERIFIER_LINK",
        ),
        _topology(
            "affinity_slack",
            "count",
            "router: a new session may go to a verifier replica with up to this many more sessions than "
            "the least loaded when it holds the longest start of the prompt in its prefix cache; 0 = only "
            "among the least loaded",
            env="SPECMESH_AFFINITY_SLACK",
        ),
        _topology(
            "verifier_timeout",
            "seconds",
            "router: seconds a verifier replica may take to answer a cycle before it counts as hung, at "
            "least (the budget is the larger of this and 10x its slowest recent cycle, plus 1 ms per prompt "
            "token for a session's first cycle); a hung replica's sessions move to another replica with "
            "every token so far, and it is left out until it answers again",
            sets="verifier_timeout_s",
            env="SPECMESH_VERIFIER_TIMEOUT",
        ),
    ]
}
