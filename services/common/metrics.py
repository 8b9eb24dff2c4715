"""Prometheus metric catalog: prefix `specmesh_`, base units, counters end in `_total`.

Defined once here; components increment them. `serve` exposes them over HTTP.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge

REDIS_ERRORS = Counter("specmesh_redis_errors_total", "Redis operations that failed", ["component"])
REDIS_UP = Gauge("specmesh_redis_up", "1 when the component's Redis link is healthy", ["component"])
SUFFIX_FEED_INGESTED = Counter("specmesh_suffix_feed_ingested_total",
                               "Outputs of other replicas ingested into the global suffix tree")
SUFFIX_FEED_PUBLISHED = Counter("specmesh_suffix_feed_published_total",
                                "Finished outputs published to the shared suffix feed")
OCM_PAIRS = Gauge("specmesh_ocm_pairs", "Distinct (draft, target) pairs in the correction memory view")
RESCUED_TOKENS = Counter("specmesh_rescued_tokens_total", "Draft tokens accepted by relaxed (calibrated) verification",
                         ["method"])
FIRST_REJECTIONS = Counter("specmesh_first_rejections_total",
                           "Cycles whose draft hit a true rejection (rescue-rate denominator)", ["method"])
HYBRID_DECISIONS = Counter("specmesh_hybrid_decisions_total", "Hybrid router choices per cycle",
                           ["method", "source"])
