"""Frozen configuration dataclasses (no module-level mutable config)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = Path(os.environ.get("SPECMESH_MODELS", REPO_ROOT / "models"))


@dataclass(frozen=True)
class SpecParams:
    """SuffixDecoding speculation limits (ArcticInference's defaults)."""

    max_spec_tokens: int = 16      # cap on draft length
    max_spec_factor: float = 1.0   # draft length ≤ match_len · factor + offset
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1    # stop when the running probability falls below this


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 64
    max_cached_requests: int = 1000   # global tree keeps the outputs of the last N requests (FIFO)
    spec: SpecParams = SpecParams()
    tree: bool = False                # draft speculation trees (lossless verification walks them), not paths


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
    tau: float = 2.0                 # verify the cache draft when the predicted yield exceeds tau (bench.hybrid_sweep)
    score_threshold: float = 2.0     # hybrid-rule baseline: verify when the suffix score reaches this (its best too)
    cost_aware: bool = True          # hybrid: weigh ŷ against measured cycle costs instead of tau (drafter/hybrid.py)


@dataclass(frozen=True)
class EngineConfig:
    target: Path = MODELS_DIR / "target"
    draft: Path | None = MODELS_DIR / "draft"
    # EAGLE-3: the TTT head; 4-token chains. For the stage-2 head k = 3 and k = 4 tie by speed on
    # CPU (bench/results/eagle3_sweep*.md, eagle3_k_*.md) and k = 4 has the higher τ (2.62
    # against 2.42 on humaneval); it is also the GPU's choice. The stage-1 head's best was k = 3.
    eagle3: Path | None = MODELS_DIR / "eagle3"          # loaded when the directory holds a head
    eagle3_k: int = 4                                   # EAGLE-3 chain length
    # EAGLE-3 chains stop after a token with max q below this. On CPU a cheaper cycle beats a longer
    # chain: 0.35 against 0.1 gave 1.39× against 1.35× on humaneval and 1.24× against 1.18× on
    # stdlib-heldout, at τ 2.35 against 2.62 and 2.15 against 2.35 (bench/results/eagle3_confidence_*.md).
    eagle3_confidence: float = 0.35
    # EAGLE draft trees (method eagle3-tree; SGLang's speculative_eagle_topk and
    # speculative_num_draft_tokens): top-k children per expanded node, nodes kept for verification.
    eagle3_topk: int = 2
    eagle3_tree_tokens: int = 8
    eagle3_tree_min_score: float = 0.0   # nodes whose path probability is below it are not drafted
    predictor: Path | None = MODELS_DIR / "predictor"  # HVD yield predictor, loaded when present
    hybrid: HybridConfig = HybridConfig()
    device: str = "cpu"
    dtype: str = "float32"
    num_speculative_tokens: int = 4       # k for model drafters; tuned by `python -m bench`
    packed_gemm: bool = True              # CPU: fp16-weight FBGEMM GEMMs (services/common/packed_linear.py)
    kv_pool: bool = False                 # pooled K/V slots: one attention call per layer for a step's sessions
    #                                       (services/common/kv_pool.py; no gain on this CPU, meant for GPUs)
    draft_confidence: float = 0.3         # draft-LM chains stop after a token with max q below this
    draft_vocab: int = -1                 # draft LM's head over the N most frequent tokens (FR-Spec); 0 = all;
    #                                       -1 = 4,096 where a ranking ships beside the draft, else all
    max_new_tokens_limit: int = 1024
    max_model_len: int = 0                # prompt + max_new_tokens at most this (vLLM's); 0 = the target's positions
    default_max_new_tokens: int = 128
    default_method: str = os.environ.get("SPECMESH_DEFAULT_METHOD", "hybrid")   # lossless; falls back, see Engine
    threads: int = 0                      # torch intra-op threads; 0 = torch default
    max_batch: int = 16                   # sessions verified together in one step
    spec_disable_batch: int = int(os.environ.get("SPECMESH_SPEC_DISABLE_BATCH", "0"))  # no drafts while a
    #                                       verifier step batches more sessions than this; 0 = never (bench.serving)
    batch_window_ms: float = 5.0          # a step waits at most this long for the sessions it expects
    prefill_chunk: int = int(os.environ.get("SPECMESH_PREFILL_CHUNK", "128"))   # beside decoding sessions, a
    #                                       prompt prefills at most this many tokens per step; 0 = whole (bench.prefill)
    prefix_cache_mb: int = int(os.environ.get("SPECMESH_PREFIX_CACHE_MB", "256"))   # verified state of full
    #                                       blocks (target, draft LM, EAGLE-3 head) kept for later prompts; 0 = off (bench.prefix_cache)
    prefix_block: int = 32                # tokens per prefix-cache block: a prompt reuses whole blocks only
    suffix: SuffixConfig = SuffixConfig()
    ngram: NgramConfig = NgramConfig()
    redis_url: str | None = None          # shared state across replicas; None = process-local only
    gate: GateConfig = GateConfig()
    predictor_addr: str | None = None     # use a remote Predictor service instead of the in-process MLP
    drafter_addr: str | None = None       # use a remote suffix-cache Drafter service
    memory_addr: str | None = None        # share the correction memory through the Memory service
    ocm_snapshot: Path | None = MODELS_DIR / "ocm_snapshot.json"   # calibration prior, loaded when present


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_sessions: int = 8                 # concurrent Generate streams
    max_queue: int = 32                   # requests waiting for a stream slot; beyond → RESOURCE_EXHAUSTED
    workers: int = 16
    max_message_bytes: int = 4 * 1024 * 1024
    metrics_port: int = 9400              # Prometheus /metrics; 0 = off
    tls_cert: Path | None = None          # serve TLS with this certificate + key
    tls_key: Path | None = None
    tls_client_ca: Path | None = None     # and require client certificates signed by this CA (mTLS)
    auth_token: str | None = None         # require `authorization: Bearer <token>` on the public API
    http_port: int = 8000                 # OpenAI-compatible HTTP API (/v1/completions, ...); 0 = off
    served_model_name: tuple[str, ...] | str = ()   # the model's names in the HTTP API (answers carry the
    #                                       first); empty = the target's directory name
    chat_template: Path | None = None     # Jinja chat template for /v1/chat/completions; None = the tokenizer's
    vllm_metric_names: bool = False       # /metrics also under vLLM's names (services/common/vllm_metrics.py)
    health_check_timeout_s: float = 20.0  # GET /health_generate's wait for progress (SGLang's default)
    allowed_origins: tuple[str, ...] = ("*",)   # CORS: browser origins the HTTP API answers (vLLM's default)
