"""Prometheus metric catalog: prefix `specmesh_`, base units, counters end in `_total`.

Defined once here; components increment them. `serve` exposes them over HTTP. Under Ray
Serve each replica is its own process: with ``PROMETHEUS_MULTIPROC_DIR`` set (the Serve app
sets it), every process on a node writes its values there and one of them serves the node's
sum (``start_node_exporter``). Gauges say how they combine across processes.
"""

from __future__ import annotations

import os

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # value files are created with the metrics below
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

from prometheus_client import Counter, Gauge, Histogram  # noqa: E402

from services.common import refusals  # noqa: E402

REDIS_ERRORS = Counter("specmesh_redis_errors_total", "Redis operations that failed", ["component"])
REDIS_UP = Gauge(
    "specmesh_redis_up", "1 when the component's Redis link is healthy", ["component"], multiprocess_mode="livemin"
)
SUFFIX_FEED_INGESTED = Counter(
    "specmesh_suffix_feed_ingested_total", "Outputs of other replicas ingested into the global suffix tree"
)
SUFFIX_FEED_PUBLISHED = Counter(
    "specmesh_suffix_feed_published_total", "Finished outputs published to the shared suffix feed"
)
OCM_PAIRS = Gauge(
    "specmesh_ocm_pairs", "Distinct (draft, target) pairs in the correction memory view", multiprocess_mode="livemax"
)
RESCUED_TOKENS = Counter(
    "specmesh_rescued_tokens_total", "Draft tokens accepted by relaxed (calibrated) verification", ["method"]
)
FIRST_REJECTIONS = Counter(
    "specmesh_first_rejections_total", "Cycles whose draft hit a true rejection (rescue-rate denominator)", ["method"]
)
HYBRID_DECISIONS = Counter("specmesh_hybrid_decisions_total", "Hybrid router choices per cycle", ["method", "source"])

# -- fleet -----------------------------------------------------------------------------------------
VERIFIER_FAILOVERS = Counter(
    "specmesh_verifier_failovers_total",
    "Sessions re-opened on another verifier replica after theirs failed, by when (open, cycle, or "
    "hang: no answer within the replica's budget)",
    ["stage"],
)
for _stage in ("open", "cycle", "hang"):
    VERIFIER_FAILOVERS.labels(_stage)  # known label values start at 0
VERIFIER_RESTARTS = Counter(
    "specmesh_verifier_restarts_total", "Verifier processes the router restarted after they died"
)

# -- speculative decoding (vLLM's spec-decode counters, per method and draft source) ------------
CYCLES = Counter("specmesh_cycles_total", "Target verification forward passes", ["method"])
GENERATED_TOKENS = Counter("specmesh_generated_tokens_total", "Tokens emitted by decoding cycles", ["method"])
NUM_DRAFTS = Counter("specmesh_spec_decode_num_drafts_total", "Non-empty drafts verified", ["method", "source"])
NUM_DRAFT_TOKENS = Counter("specmesh_spec_decode_num_draft_tokens_total", "Draft tokens verified", ["method", "source"])
NUM_ACCEPTED_TOKENS = Counter(
    "specmesh_spec_decode_num_accepted_tokens_total", "Draft tokens accepted", ["method", "source"]
)
ACCEPTED_PER_POS = Counter(
    "specmesh_spec_decode_num_accepted_tokens_per_pos_total",
    "Accepted draft tokens by position in the draft",
    ["method", "position"],
)
PREDICTED_VS_ACTUAL = Counter(
    "specmesh_hybrid_high_yield_total",
    "Cache drafts by predicted and actual high yield (≥ 6 tokens)",
    ["method", "predicted", "actual"],
)

# -- structured output ---------------------------------------------------------------------------
GRAMMAR_COMPILES = Counter(
    "specmesh_grammar_compiles_total",
    "Structured-output patterns looked up, by outcome (cached, compiled, invalid, too_complex)",
    ["outcome"],
)
GRAMMAR_COMPILE_SECONDS = Histogram(
    "specmesh_grammar_compile_seconds",
    "Time to compile a structured-output pattern (cache misses)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

# -- requests and latency --------------------------------------------------------------------------
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REQUESTS = Counter("specmesh_requests_total", "Finished requests", ["method", "finish_reason"])
REQUESTS_REJECTED = Counter("specmesh_requests_rejected_total", "Requests refused before decoding", ["code"])
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


ACTIVE_SESSIONS = Gauge(
    "specmesh_active_sessions",
    "Sessions in progress: component=router counts Generate streams (and HTTP completions), "
    "component=verifier the sessions open on a verifier replica",
    ["component"],
    multiprocess_mode="livesum",
)
for _component in ("router", "verifier"):
    ACTIVE_SESSIONS.labels(_component)  # one name, two series: a process running both sets each
QUEUE_DEPTH = Gauge("specmesh_queue_depth", "Generate requests waiting for a session slot", multiprocess_mode="livesum")
CYCLE_SECONDS = Counter(
    "specmesh_cycle_seconds_total",
    "Decoding cycles' time on the router's clock, by part: draft (drafting, router and "
    "verifier side), verify (the target's forward, the policy and the commit), other (the "
    "rest: crossing to a verifier replica, waiting for a batched step, bookkeeping)",
    ["method", "part"],
)
CYCLE_PARTS = ("draft", "verify", "other")
TTFT = Histogram("specmesh_time_to_first_token_seconds", "Time to first token", ["method"], buckets=_LAT)
TPOT = Histogram(
    "specmesh_time_per_output_token_seconds",
    "Decode time per output token (per cycle)",
    ["method"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
)
E2E = Histogram("specmesh_request_latency_seconds", "End-to-end request latency", ["method"], buckets=_LAT)


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
    ) -> None:
        """One cycle: ``seconds`` on the router's clock, ``draft_s`` and ``verify_s`` of it
        spent drafting and verifying (the rest counts as other)."""
        self.cycles.inc()
        draft, verify, other = self.seconds
        draft.inc(draft_s)
        verify.inc(verify_s)
        other.inc(max(0.0, seconds - draft_s - verify_s))
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

    def __init__(self):
        self.method = ""
        self.ttft = self.tpot = self.e2e = self._Nothing()

    def cycle(self, *_args) -> None:
        pass


UNCOUNTED = _Uncounted()


def decoding_totals() -> tuple[float, float]:
    """(cycles, tokens emitted) by this process's decoding so far, over all methods."""

    def total(counter) -> float:
        return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))

    return total(CYCLES), total(GENERATED_TOKENS)


VERIFY_BATCH = Histogram(
    "specmesh_verify_batch_size",
    "Sessions verified together in one target forward",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
)
PREFILL_CHUNKS = Counter(
    "specmesh_prefill_chunks_total",
    "Prompt chunks fed beside decoding sessions' cycles (chunked prefill), not finishing a cycle",
)
PREFIX_CACHE = Counter(
    "specmesh_prefix_cache_tokens_total",
    "Prompt positions looked up in the prefix cache (queried) and taken from it (hit)",
    ["kind"],
)
PREFIX_CACHE_BYTES = Gauge(
    "specmesh_prefix_cache_bytes",
    "Bytes held by the target's prefix cache (K/V, features)",
    multiprocess_mode="livesum",
)


def start_node_exporter(port: int, host: str = "0.0.0.0", retry_s: float = 10.0) -> bool:
    """Serve the sum over every process of this node's ``PROMETHEUS_MULTIPROC_DIR`` on ``port``.

    Rule: every replica calls it; whichever binds the port first serves, the others retry
    every ``retry_s`` so the endpoint outlives the replica serving it. A process that exits
    marks itself dead, so live-mode gauges drop its values. Returns False without the
    multiprocess directory (nothing to aggregate) or without a port.
    """
    import atexit
    import threading
    import time

    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    if not port or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    atexit.register(multiprocess.mark_process_dead, os.getpid())
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)

    def bind() -> None:
        while True:
            try:
                start_http_server(port, addr=host, registry=registry)
                return
            except OSError:
                time.sleep(retry_s)

    threading.Thread(target=bind, daemon=True, name="specmesh-node-metrics").start()
    return True
