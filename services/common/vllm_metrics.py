"""vLLM's metric names over specmesh's metrics, for dashboards and alerts written for vLLM.

A collector, not a second set of counters: at each scrape it reads specmesh's metrics and
yields the mapped ones under vLLM's names, with vLLM's ``model_name`` label (the served model
name) and specmesh's per-method (and per-draft-source) series summed, as one vLLM server
reports one speculative method. The decode path is untouched. Finish reasons map as vLLM's
``finished_reason``: eos and stop → stop, length → length, cancelled and abort → abort.

Registered by the router (``serve``, embedded or router role), where requests and cycles are
counted, and by a Ray Serve node's exporter over the node's processes (``families``: the
multiprocess collector's sums instead of this process's metrics).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.common import metrics as m

FINISHED = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "abort": "abort"}

# vLLM name: (specmesh metric, the specmesh labels vLLM keeps, renamed, with value maps)
COUNTERS = {
    "vllm:prompt_tokens": (m.PROMPT_TOKENS, {}),
    "vllm:generation_tokens": (m.GENERATED_TOKENS, {}),
    "vllm:request_success": (m.REQUESTS, {"finish_reason": ("finished_reason", FINISHED)}),
    "vllm:spec_decode_num_drafts": (m.NUM_DRAFTS, {}),
    "vllm:spec_decode_num_draft_tokens": (m.NUM_DRAFT_TOKENS, {}),
    "vllm:spec_decode_num_accepted_tokens": (m.NUM_ACCEPTED_TOKENS, {}),
    "vllm:spec_decode_num_accepted_tokens_per_pos": (m.ACCEPTED_PER_POS, {"position": ("position", None)}),
}
GAUGES: dict[str, tuple[Any, dict[str, str]]] = {  # vLLM name: (specmesh gauge, the labels its samples must carry)
    "vllm:num_requests_running": (m.REQUESTS_RUNNING, {}),
    "vllm:num_requests_waiting": (m.QUEUE_DEPTH, {}),
}
# vLLM's KV-cache usage, a fraction: positions held over what the verifiers can hold
RATIOS = {"vllm:kv_cache_usage_perc": (m.KV_CACHE_TOKENS, m.KV_CACHE_CAPACITY)}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": m.TTFT,
    "vllm:time_per_output_token_seconds": m.TPOT,
    "vllm:e2e_request_latency_seconds": m.E2E,
    "vllm:request_queue_time_seconds": m.QUEUE_TIME,
    "vllm:request_prefill_time_seconds": m.PREFILL_TIME,
}


def own_families():
    """This process's specmesh metrics."""
    for metric in m._BY_NAME.values():
        yield from metric.collect()


def _samples(now: dict, metric, suffix: str):
    """(labels, value) of the metric's samples named ``<family><suffix>`` in ``now`` (families by name)."""
    family = now.get(metric._name)
    if family is None:
        return
    for s in family.samples:
        if s.name == family.name + suffix:
            yield s.labels, s.value


class VllmNames(Collector):
    """``families()``: where specmesh's metric families are read at each scrape."""

    def __init__(self, model_name: str, families: Callable[[], Iterable] = own_families):
        self.model_name, self.families = model_name, families

    def collect(self):
        now = {f.name: f for f in self.families()}  # one reading per scrape (scrapes may overlap)
        for name, (metric, keep) in COUNTERS.items():
            yield self._counter(now, name, metric, keep)
        for name, (metric, only) in GAUGES.items():
            g = GaugeMetricFamily(name, f"{metric._documentation} (specmesh's)", labels=["model_name"])
            values = (v for lab, v in _samples(now, metric, "") if only.items() <= lab.items())
            g.add_metric([self.model_name], sum(values))
            yield g
        for name, (used, capacity) in RATIOS.items():
            g = GaugeMetricFamily(name, f"{used._documentation}, over its capacity (specmesh's)", labels=["model_name"])
            held, room = (sum(v for _, v in _samples(now, x, "")) for x in (used, capacity))
            if room:  # only where a verifier holds K/V (not a router alone)
                g.add_metric([self.model_name], held / room)
            yield g
        for name, metric in HISTOGRAMS.items():
            yield self._histogram(now, name, metric)

    def _counter(self, now: dict, name: str, metric, keep: dict) -> CounterMetricFamily:
        labels = [new for new, _ in keep.values()]
        sums: dict[tuple, float] = defaultdict(float)
        for lab, v in _samples(now, metric, "_total"):
            key = tuple(values.get(lab[old], lab[old]) if values else lab[old] for old, (_, values) in keep.items())
            sums[key] += v
        c = CounterMetricFamily(name, f"{metric._documentation} (specmesh's)", labels=["model_name", *labels])
        for key, v in sorted(sums.items()):
            c.add_metric([self.model_name, *key], v)
        return c

    def _histogram(self, now: dict, name: str, metric) -> HistogramMetricFamily:
        buckets: dict[str, float] = defaultdict(float)
        for lab, v in _samples(now, metric, "_bucket"):
            buckets[lab["le"]] += v
        total = sum(v for _, v in _samples(now, metric, "_sum"))
        h = HistogramMetricFamily(name, f"{metric._documentation} (specmesh's)", labels=["model_name"])
        if buckets:  # none until a method observes one
            h.add_metric([self.model_name], sorted(buckets.items(), key=lambda kv: float(kv[0])), total)
        return h


_registered: VllmNames | None = None


def register(model_name: str) -> VllmNames:
    """Expose vLLM's names beside specmesh's in the default registry, once per process (a
    later call renames the model)."""
    global _registered
    from prometheus_client import REGISTRY

    if _registered is None:
        _registered = VllmNames(model_name)
        REGISTRY.register(_registered)
    _registered.model_name = model_name
    return _registered
