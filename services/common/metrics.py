"""Prometheus metric catalog: prefix `specmesh_`, base units, counters end in `_total`.

Defined once here; components increment them. `serve` exposes them over HTTP. Under Ray
Serve each replica is its own process: with ``PROMETHEUS_MULTIPROC_DIR`` set (the Serve app
sets it), every process on a node writes its values there and one of them serves the node's
sum (``services/common/exposition.py``). Gauges say how they combine across processes.
"""

from __future__ import annotations

import itertools
import os

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # value files are created with the metrics below
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Literal  # noqa: E402

from prometheus_client import Counter, Gauge, Histogram  # noqa: E402

from services.common import refusals  # noqa: E402


@dataclass(frozen=True)
class Spec:
    """One metric of the catalogue. ``known``: label values whose series exist from the start
    (a counter reads 0 before its first event, so a rate over it is 0, not empty); ``mode``: how
    a gauge combines across the processes of a Ray node (prometheus_client's multiprocess modes)."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    section: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    known: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mode: Literal["livesum", "livemax", "livemin"] = "livesum"
    buckets: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The name a scrape shows (counters get ``_total``)."""
        return self.name + "_total" if self.kind == "counter" else self.name


CATALOGUE: list[Spec] = []
_BY_NAME: dict = {}  # name: its prometheus_client metric


def define(spec: Spec) -> Any:
    """Register ``spec`` and return its prometheus_client metric, with its known series made."""
    CATALOGUE.append(spec)
    metric: Any
    if spec.kind == "counter":
        metric = Counter(spec.name, spec.help, spec.labels)
    elif spec.kind == "gauge":
        metric = Gauge(spec.name, spec.help, spec.labels, multiprocess_mode=spec.mode)
    else:
        metric = Histogram(spec.name, spec.help, spec.labels, buckets=spec.buckets or Histogram.DEFAULT_BUCKETS)
    if spec.labels and set(spec.known) == set(spec.labels):
        for values in itertools.product(*(spec.known[label] for label in spec.labels)):
            metric.labels(*values)
    _BY_NAME[spec.name] = metric
    return metric


def known_methods(methods) -> None:
    """Make the per-method series of a server's methods (with every known value of their other
    labels), so a panel reads 0 rather than nothing before the first request. Series keyed by
    an open-ended label (draft source, draft position) appear with their first event."""
    for spec in CATALOGUE:
        rest = [label for label in spec.labels if label != "method"]
        if "method" not in spec.labels or not set(rest) <= set(spec.known):
            continue
        for method in methods:
            for values in itertools.product(*(spec.known[label] for label in rest)):
                _BY_NAME[spec.name].labels(method=method, **dict(zip(rest, values)))


LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
COMPONENTS = ("ocm", "suffix_feed")  # the Redis links: the correction memory, the shared suffix feed

# -- requests and latency --------------------------------------------------------------------------
S = "Requests and latency"
REQUESTS = define(
    Spec(
        "specmesh_requests",
        "counter",
        "Finished requests",
        S,
        ("method", "finish_reason"),
        known={"finish_reason": ("eos", "stop", "length", "abort", "cancelled")},
    )
)
REQUESTS_REJECTED = define(
    Spec(
        "specmesh_requests_rejected",
        "counter",
        "Requests refused before decoding, by gRPC status name",
        S,
        ("code",),
        known={"code": ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED")},
    )
)
PROMPT_TOKENS = define(
    Spec(
        "specmesh_prompt_tokens",
        "counter",
        "Prompt tokens of started requests (a prompt with n completions counts once)",
        S,
        ("method",),
        unit="tokens",
    )
)
GENERATED_TOKENS = define(
    Spec("specmesh_generated_tokens", "counter", "Tokens emitted by decoding cycles", S, ("method",), unit="tokens")
)
REQUESTS_RUNNING = define(
    Spec(
        "specmesh_requests_running",
        "gauge",
        "Completions decoding now on this router (Generate streams and HTTP completions)",
        S,
    )
)
QUEUE_DEPTH = define(Spec("specmesh_queue_depth", "gauge", "Requests waiting for a session slot", S))
QUEUE_TIME = define(
    Spec(
        "specmesh_request_queue_time_seconds",
        "histogram",
        "Time a request waited for a session slot",
        S,
        unit="seconds",
        buckets=(0.001, *LAT),
    )
)
TTFT = define(
    Spec(
        "specmesh_time_to_first_token_seconds",
        "histogram",
        "Time from a completion's start to its first token",
        S,
        ("method",),
        unit="seconds",
        buckets=LAT,
    )
)
PREFILL_TIME = define(
    Spec(
        "specmesh_request_prefill_time_seconds",
        "histogram",
        "A completion's first cycle, which reads its prompt (prefill) and makes its first token",
        S,
        ("method",),
        unit="seconds",
        buckets=LAT,
    )
)
TPOT = define(
    Spec(
        "specmesh_time_per_output_token_seconds",
        "histogram",
        "Decode time per output token (per cycle)",
        S,
        ("method",),
        unit="seconds",
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
    )
)
E2E = define(
    Spec(
        "specmesh_request_latency_seconds",
        "histogram",
        "End-to-end latency of a completion",
        S,
        ("method",),
        unit="seconds",
        buckets=LAT,
    )
)

# -- speculative decoding (vLLM's spec-decode counters, per method and draft source) ------------
S = "Speculative decoding"
CYCLES = define(
    Spec("specmesh_cycles", "counter", "Target verification forward passes (decoding cycles)", S, ("method",))
)
NUM_DRAFTS = define(
    Spec("specmesh_spec_decode_num_drafts", "counter", "Non-empty drafts verified", S, ("method", "source"))
)
NUM_DRAFT_TOKENS = define(
    Spec(
        "specmesh_spec_decode_num_draft_tokens",
        "counter",
        "Draft tokens verified",
        S,
        ("method", "source"),
        unit="tokens",
    )
)
NUM_ACCEPTED_TOKENS = define(
    Spec(
        "specmesh_spec_decode_num_accepted_tokens",
        "counter",
        "Draft tokens accepted",
        S,
        ("method", "source"),
        unit="tokens",
    )
)
ACCEPTED_PER_POS = define(
    Spec(
        "specmesh_spec_decode_num_accepted_tokens_per_pos",
        "counter",
        "Accepted draft tokens by position in the draft (0 = first)",
        S,
        ("method", "position"),
        unit="tokens",
    )
)
CYCLE_PARTS = ("draft", "verify", "gate", "network", "other")
CYCLE_SECONDS = define(
    Spec(
        "specmesh_cycle_seconds",
        "counter",
        "Decoding cycles' time on the router's clock, by part: draft (drafting, router and verifier side), "
        "verify (the target's forward and the commit), gate (the acceptance policy, a calibrated gate "
        "included), network (the router's wait for a verifier beyond the verifier's own time on the "
        "cycle), other (the rest: waiting for a batched step, bookkeeping)",
        S,
        ("method", "part"),
        unit="seconds",
        known={"part": CYCLE_PARTS},
    )
)

# -- hybrid drafting (HVD) -------------------------------------------------------------------------
S = "Hybrid drafting and the yield predictor"
HYBRID_DECISIONS = define(
    Spec(
        "specmesh_hybrid_decisions",
        "counter",
        "Hybrid router choices per cycle, by draft source",
        S,
        ("method", "source"),
    )
)
PREDICTED_VS_ACTUAL = define(
    Spec(
        "specmesh_hybrid_high_yield",
        "counter",
        "Cache drafts by predicted and actual high yield (at least 6 tokens): the predictor's precision and recall",
        S,
        ("method", "predicted", "actual"),
        known={"predicted": ("true", "false"), "actual": ("true", "false")},
    )
)

# -- calibrated verification (CSD) and the correction memory -------------------------------------
S = "Calibrated verification and the correction memory"
RESCUED_TOKENS = define(
    Spec(
        "specmesh_rescued_tokens",
        "counter",
        "Draft tokens accepted by relaxed (calibrated) verification",
        S,
        ("method",),
        unit="tokens",
    )
)
FIRST_REJECTIONS = define(
    Spec(
        "specmesh_first_rejections",
        "counter",
        "Cycles whose draft hit a true rejection (rescue-rate denominator)",
        S,
        ("method",),
    )
)
OCM_PAIRS = define(
    Spec(
        "specmesh_ocm_pairs",
        "gauge",
        "Distinct (draft, target) pairs in the correction memory's view",
        S,
        mode="livemax",
    )
)
REDIS_UP = define(
    Spec(
        "specmesh_redis_up",
        "gauge",
        "1 while the component's Redis link is healthy, 0 while it degrades to local memory, "
        "-1 when no Redis is configured (local memory by choice)",
        S,
        ("component",),
        mode="livemin",
    )
)
REDIS_ERRORS = define(
    Spec(
        "specmesh_redis_errors",
        "counter",
        "Redis operations that failed",
        S,
        ("component",),
        known={"component": COMPONENTS},
    )
)
SUFFIX_FEED_INGESTED = define(
    Spec(
        "specmesh_suffix_feed_ingested", "counter", "Outputs of other replicas ingested into the global suffix tree", S
    )
)
SUFFIX_FEED_PUBLISHED = define(
    Spec("specmesh_suffix_feed_published", "counter", "Finished outputs published to the shared suffix feed", S)
)
REDIS_BAD_ENTRIES = define(
    Spec(
        "specmesh_redis_bad_entries",
        "counter",
        "Entries read back from Redis that failed validation and were skipped (ragged or out-of-vocabulary "
        "suffix-feed tokens, malformed or non-finite correction-memory counts)",
        S,
        ("source",),
        known={"source": ("suffix_feed", "correction_memory")},
    )
)

# -- verifier replicas and the fleet --------------------------------------------------------------
S = "Verifier replicas and the fleet"
VERIFIER_SESSIONS = define(Spec("specmesh_verifier_sessions", "gauge", "Sessions open on this verifier replica", S))
VERIFIERS_LIVE = define(
    Spec(
        "specmesh_verifiers_live",
        "gauge",
        "Verifier replicas a router can place sessions on now (not left out after a failure; 1 for a "
        "verifier in its own process); component=router, as only routers export it",
        S,
        ("component",),
        mode="livemax",
    )
)
VERIFIER_FAILOVERS = define(
    Spec(
        "specmesh_verifier_failovers",
        "counter",
        "Sessions re-opened on another verifier replica after theirs failed, by when (open, cycle, or hang: no "
        "answer within the replica's budget)",
        S,
        ("stage",),
        known={"stage": ("open", "cycle", "hang")},
    )
)
VERIFIER_RESTARTS = define(
    Spec("specmesh_verifier_restarts", "counter", "Verifier processes the router restarted after they died", S)
)
VERIFY_BATCH = define(
    Spec(
        "specmesh_verify_batch_size",
        "histogram",
        "Sessions verified together in one target forward",
        S,
        unit="sessions",
        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256),
    )
)
ROUTER_MICRO_BATCHES = define(
    Spec(
        "specmesh_router_micro_batches",
        "gauge",
        "Alternating steps an in-process verifier's sessions run in now: 1, whole steps; 2, halves, the router "
        "drafting for one while the other's step runs (the overlap tuner's choice, or --micro-batches); 0 "
        "where the verifier is remote",
        S,
        mode="livemax",
    )
)
KV_CACHE_TOKENS = define(
    Spec(
        "specmesh_kv_cache_tokens",
        "gauge",
        "K/V positions held by the sessions of the verifier's latest step",
        S,
        unit="tokens",
    )
)
KV_CACHE_CAPACITY = define(
    Spec(
        "specmesh_kv_cache_capacity_tokens",
        "gauge",
        "K/V positions the verifier can hold: its session limit times the context length",
        S,
        unit="tokens",
    )
)
PREFILL_CHUNKS = define(
    Spec(
        "specmesh_prefill_chunks",
        "counter",
        "Prompt chunks fed beside decoding sessions' cycles (chunked prefill), not finishing a cycle",
        S,
    )
)
PREFIX_CACHE = define(
    Spec(
        "specmesh_prefix_cache_tokens",
        "counter",
        "Prompt positions looked up in the prefix cache (queried) and taken from it (hit)",
        S,
        ("kind",),
        unit="tokens",
        known={"kind": ("queried", "hit")},
    )
)
PREFIX_CACHE_BYTES = define(
    Spec(
        "specmesh_prefix_cache_bytes",
        "gauge",
        "Bytes held by the target's prefix cache (K/V, features)",
        S,
        unit="bytes",
    )
)

# -- structured output ---------------------------------------------------------------------------
S = "Structured output"
GRAMMAR_COMPILES = define(
    Spec(
        "specmesh_grammar_compiles",
        "counter",
        "Structured-output patterns looked up, by outcome (cached, compiled, invalid, too_complex)",
        S,
        ("outcome",),
        known={"outcome": ("cached", "compiled", "invalid", "too_complex")},
    )
)
GRAMMAR_COMPILE_SECONDS = define(
    Spec(
        "specmesh_grammar_compile_seconds",
        "histogram",
        "Time to compile a structured-output pattern (cache misses)",
        S,
        unit="seconds",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    )
)
del S

# The ``code`` label of each refusal: gRPC's status names, whichever front end refused.
REJECTED_AS = {
    refusals.Invalid: "INVALID_ARGUMENT",
    refusals.Overloaded: "RESOURCE_EXHAUSTED",
    refusals.DeadlineExceeded: "DEADLINE_EXCEEDED",
    refusals.Unavailable: "UNAVAILABLE",
    refusals.Cancelled: "CANCELLED",
}


def rejected_code(refusal: refusals.Refusal) -> str:
    return next((REJECTED_AS[k] for k in type(refusal).__mro__ if k in REJECTED_AS), "UNKNOWN")


class MethodMetrics:
    """Metric children bound once per request (label lookups stay off the per-cycle path)."""

    _cache: dict[str, "MethodMetrics"] = {}

    def __init__(self, method: str):
        self.method = method
        self.cycles = CYCLES.labels(method)
        self.generated = GENERATED_TOKENS.labels(method)
        self.rescued = RESCUED_TOKENS.labels(method)
        self.rejections = FIRST_REJECTIONS.labels(method)
        self.ttft, self.tpot, self.e2e = TTFT.labels(method), TPOT.labels(method), E2E.labels(method)
        self.prefill, self.prompt = PREFILL_TIME.labels(method), PROMPT_TOKENS.labels(method)
        self.seconds = tuple(CYCLE_SECONDS.labels(method, part) for part in CYCLE_PARTS)
        self._by_source: dict[str, tuple] = {}
        self._per_pos: list = []

    @classmethod
    def of(cls, method: str, counted: bool = True) -> "MethodMetrics":
        """``counted=False``: a request kept out of the metrics (a health probe's), as SGLang's
        ``log_metrics=False``."""
        if not counted:
            return UNCOUNTED
        if method not in cls._cache:
            cls._cache[method] = cls(method)
        return cls._cache[method]

    def cycle(
        self,
        source: str,
        drafted: int,
        accepted: int,
        emitted: int,
        rescued: int,
        rejected: bool,
        seconds: float,
        draft_s: float = 0.0,
        verify_s: float = 0.0,
        gate_s: float = 0.0,
        network_s: float = 0.0,
    ) -> None:
        """One cycle: ``seconds`` on the router's clock, of it ``draft_s`` drafting, ``verify_s``
        verifying (``gate_s`` of that in the acceptance policy) and ``network_s`` crossing to the
        verifier; the rest counts as other."""
        self.cycles.inc()
        draft, verify, gate, network, other = self.seconds
        draft.inc(draft_s)
        verify.inc(max(0.0, verify_s - gate_s))
        gate.inc(gate_s)
        if network_s:  # 0 for a verifier in this process
            network.inc(network_s)
        other.inc(max(0.0, seconds - draft_s - verify_s - network_s))
        self.generated.inc(emitted)
        if emitted:
            self.tpot.observe(seconds / emitted)
        if rescued:
            self.rescued.inc(rescued)
        if rejected:
            self.rejections.inc()
        if not drafted:
            return
        if source not in self._by_source:
            self._by_source[source] = (
                NUM_DRAFTS.labels(self.method, source),
                NUM_DRAFT_TOKENS.labels(self.method, source),
                NUM_ACCEPTED_TOKENS.labels(self.method, source),
            )
        n, t, a = self._by_source[source]
        n.inc()
        t.inc(drafted)
        a.inc(accepted)
        while len(self._per_pos) < accepted:
            self._per_pos.append(ACCEPTED_PER_POS.labels(self.method, str(len(self._per_pos))))
        for i in range(accepted):
            self._per_pos[i].inc()


class _Uncounted(MethodMetrics):
    """Records nothing."""

    class _Nothing:
        def observe(self, _value: float) -> None:
            pass

        def inc(self, _value: float = 1) -> None:
            pass

    def __init__(self):
        self.method = ""
        self.ttft = self.tpot = self.e2e = self.prefill = self.prompt = self._Nothing()

    def cycle(self, *_args) -> None:
        pass


UNCOUNTED = _Uncounted()


def decoding_totals() -> tuple[float, float]:
    """(cycles, tokens emitted) by this process's decoding so far, over all methods."""

    def total(counter) -> float:
        return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))

    return total(CYCLES), total(GENERATED_TOKENS)


def redis_off(component: str) -> None:
    """``component`` keeps its state in local memory by configuration (no Redis URL): its
    ``specmesh_redis_up`` reads -1 (the alert fires on 0 only) and its error count 0, so the
    dashboard's Redis panels have data in every topology."""
    REDIS_UP.labels(component).set(-1)
    REDIS_ERRORS.labels(component)
