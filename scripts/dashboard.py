"""Write the Grafana dashboard (deploy/grafana/specmesh.json) from the panel table below.

Every query is written once, plainly; the filters of the dashboard's variables are added to
each metric selector here: ``namespace`` and ``pod`` everywhere, ``model`` on vLLM's names (the
ones that carry ``model_name``). ``--check`` exits non-zero when the file is stale (CI runs it
through tests/unit/test_docs.py). tests/integration/test_prometheus.py evaluates every query
against a real Prometheus scraping a real server.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from generated import write_or_check

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "specmesh.json"
R = "[$__rate_interval]"


def rate(metric: str, by: str = "", match: str = "") -> str:
    sel = f"{metric}{{{match}}}" if match else metric
    return f"sum(rate({sel}{R}))" + (f" by ({by})" if by else "")


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum(rate({metric}_bucket{R})) by (le))"


TP, PREDICTED, ACTUAL = 'predicted="true",actual="true"', 'predicted="true"', 'actual="true"'
HIT, QUERIED = 'kind="hit"', 'kind="queried"'

# (row, [(title, unit, [(expr, legend), ...]), ...])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Latency",
        [
            (
                "Time to first token",
                "s",
                [(quantile(q, "vllm:time_to_first_token_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95)],
            ),
            (
                "Inter-token latency (time per output token)",
                "s",
                [(quantile(q, "vllm:time_per_output_token_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95)],
            ),
            (
                "End-to-end latency",
                "s",
                [(quantile(q, "vllm:e2e_request_latency_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95)],
            ),
            (
                "Queue time and prefill (p95)",
                "s",
                [
                    (quantile(0.95, "vllm:request_queue_time_seconds"), "queue"),
                    (quantile(0.95, "vllm:request_prefill_time_seconds"), "prefill (first cycle)"),
                ],
            ),
        ],
    ),
    (
        "Throughput and load",
        [
            (
                "Tokens per second",
                "tokens/s",
                [(rate("vllm:prompt_tokens_total"), "prompt"), (rate("vllm:generation_tokens_total"), "generated")],
            ),
            (
                "Generated tokens per second by method",
                "tokens/s",
                [(rate("specmesh_generated_tokens_total", "method"), "{{method}}")],
            ),
            (
                "Finished requests per second",
                "reqps",
                [(rate("vllm:request_success_total", "finished_reason"), "{{finished_reason}}")],
            ),
            (
                "Requests running and waiting",
                "short",
                [("sum(vllm:num_requests_running)", "running"), ("sum(vllm:num_requests_waiting)", "waiting")],
            ),
            ("KV-cache usage", "percentunit", [("avg(vllm:kv_cache_usage_perc)", "used")]),
            (
                "Refused requests per second",
                "reqps",
                [(rate("specmesh_requests_rejected_total", "code"), "{{code}}")],
            ),
        ],
    ),
    (
        "Acceptance",
        [
            (
                "Acceptance rate (accepted / drafted tokens)",
                "percentunit",
                [
                    (
                        f"{rate('specmesh_spec_decode_num_accepted_tokens_total', 'method')} / "
                        f"{rate('specmesh_spec_decode_num_draft_tokens_total', 'method')}",
                        "{{method}}",
                    )
                ],
            ),
            (
                "Mean accepted length τ (tokens per cycle)",
                "short",
                [
                    (
                        f"{rate('specmesh_generated_tokens_total', 'method')} / {rate('specmesh_cycles_total', 'method')}",
                        "{{method}}",
                    )
                ],
            ),
            (
                "Cycles per 1,000 tokens",
                "short",
                [
                    (
                        f"1000 * {rate('specmesh_cycles_total', 'method')} / "
                        f"{rate('specmesh_generated_tokens_total', 'method')}",
                        "{{method}}",
                    )
                ],
            ),
            (
                "Acceptance by draft position",
                "percentunit",
                [
                    (
                        f"{rate('specmesh_spec_decode_num_accepted_tokens_per_pos_total', 'position')} / "
                        f"scalar({rate('specmesh_spec_decode_num_drafts_total')})",
                        "position {{position}}",
                    )
                ],
            ),
            (
                "Acceptance rate by draft source",
                "percentunit",
                [
                    (
                        f"{rate('specmesh_spec_decode_num_accepted_tokens_total', 'source')} / "
                        f"{rate('specmesh_spec_decode_num_draft_tokens_total', 'source')}",
                        "{{source}}",
                    )
                ],
            ),
            (
                "Draft source mix (drafts/s)",
                "short",
                [
                    (rate("specmesh_spec_decode_num_drafts_total", "source"), "verified {{source}}"),
                    (rate("specmesh_hybrid_decisions_total", "source"), "hybrid chose {{source}}"),
                ],
            ),
            (
                "Cycle time by part (per cycle)",
                "ms",
                [
                    (
                        f"1000 * {rate('specmesh_cycle_seconds_total', 'part')} / "
                        f"scalar({rate('specmesh_cycles_total')})",
                        "{{part}}",
                    )
                ],
            ),
            (
                "Verification batch size (mean sessions per forward)",
                "short",
                [
                    (
                        f"{rate('specmesh_verify_batch_size_sum')} / {rate('specmesh_verify_batch_size_count')}",
                        "sessions",
                    )
                ],
            ),
        ],
    ),
    (
        "Calibrated verification (CSD) and the yield predictor",
        [
            (
                "CSD rescue rate (rescued / mismatches)",
                "percentunit",
                [
                    (
                        f"{rate('specmesh_rescued_tokens_total', 'method')} / ({rate('specmesh_rescued_tokens_total', 'method')}"
                        f" + {rate('specmesh_first_rejections_total', 'method')})",
                        "{{method}}",
                    )
                ],
            ),
            (
                "Rescued tokens and true rejections per second",
                "short",
                [
                    (rate("specmesh_rescued_tokens_total", "method"), "rescued {{method}}"),
                    (rate("specmesh_first_rejections_total", "method"), "rejected {{method}}"),
                ],
            ),
            (
                "Yield predictor precision / recall (high yield ≥ 6)",
                "percentunit",
                [
                    (
                        f"{rate('specmesh_hybrid_high_yield_total', match=TP)} / "
                        f"{rate('specmesh_hybrid_high_yield_total', match=PREDICTED)}",
                        "precision",
                    ),
                    (
                        f"{rate('specmesh_hybrid_high_yield_total', match=TP)} / "
                        f"{rate('specmesh_hybrid_high_yield_total', match=ACTUAL)}",
                        "recall",
                    ),
                ],
            ),
        ],
    ),
    (
        "Correction memory and Redis",
        [
            (
                "Redis link (1 up, 0 degraded to local, -1 none configured)",
                "short",
                [("min(specmesh_redis_up) by (component)", "{{component}}")],
            ),
            ("Redis errors per second", "short", [(rate("specmesh_redis_errors_total", "component"), "{{component}}")]),
            ("Correction memory pairs", "short", [("max(specmesh_ocm_pairs)", "pairs")]),
            (
                "Suffix feed (outputs per second)",
                "short",
                [
                    (rate("specmesh_suffix_feed_published_total"), "published"),
                    (rate("specmesh_suffix_feed_ingested_total"), "ingested"),
                ],
            ),
        ],
    ),
    (
        "Fleet health",
        [
            ("Live verifier replicas", "short", [("sum(specmesh_verifiers_live)", "live")]),
            (
                "Verifier restarts and failovers (per 5 min)",
                "short",
                [
                    ("sum(increase(specmesh_verifier_restarts_total[5m]))", "restarts"),
                    ("sum(increase(specmesh_verifier_failovers_total[5m])) by (stage)", "failover {{stage}}"),
                ],
            ),
            (
                "Sessions: router completions and verifier sessions",
                "short",
                [("sum(specmesh_requests_running)", "router"), ("sum(specmesh_verifier_sessions)", "verifiers")],
            ),
            (
                "Prefix cache hit rate and chunked prefill",
                "short",
                [
                    (
                        f"{rate('specmesh_prefix_cache_tokens_total', match=HIT)} / "
                        f"{rate('specmesh_prefix_cache_tokens_total', match=QUERIED)}",
                        "hit rate",
                    ),
                    (rate("specmesh_prefill_chunks_total"), "prefill chunks/s"),
                ],
            ),
            (
                "Structured output: grammar compiles",
                "short",
                [
                    (rate("specmesh_grammar_compiles_total", "outcome"), "{{outcome}}/s"),
                    (quantile(0.95, "specmesh_grammar_compile_seconds"), "compile p95 (s)"),
                ],
            ),
        ],
    ),
]

METRIC = re.compile(r"\b((?:specmesh_|vllm:)[a-z0-9_:]+)(\{[^}]*\})?")


def filtered(expr: str) -> str:
    """``expr`` with the variables' matchers on each metric selector."""

    def add(m: re.Match) -> str:
        name, inner = m.group(1), (m.group(2) or "{}")[1:-1]
        mine = ['namespace=~"$namespace"', 'pod=~"$pod"'] + (
            ['model_name=~"$model"'] if name.startswith("vllm:") else []
        )
        return name + "{" + ",".join(([inner] if inner else []) + mine) + "}"

    return METRIC.sub(add, expr)


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
    }


def dashboard() -> dict:
    panels, y, ids = [], 0, iter(range(1, 1000))
    for row, members in ROWS:
        panels.append({"type": "row", "title": row, "id": next(ids), "collapsed": False, "gridPos": pos(0, y, 24, 1)})
        y += 1
        for i, (title, unit, queries) in enumerate(members):
            panels.append(
                {
                    "type": "timeseries",
                    "title": title,
                    "id": next(ids),
                    "gridPos": pos(12 * (i % 2), y + 8 * (i // 2), 12, 8),
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "targets": [
                        {"refId": chr(ord("A") + j), "expr": filtered(e), "legendFormat": legend}
                        for j, (e, legend) in enumerate(queries)
                    ],
                }
            )
        y += 8 * ((len(members) + 1) // 2)
    return {
        "title": "specmesh — speculative decoding",
        "uid": "specmesh",
        "schemaVersion": 39,
        "version": 2,
        "tags": ["specmesh", "llm", "speculative-decoding"],
        "timezone": "browser",
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
                variable("namespace", "Namespace", "label_values(specmesh_cycles_total, namespace)"),
                variable("model", "Model", "label_values(vllm:generation_tokens_total, model_name)"),
                variable("pod", "Pod", 'label_values(specmesh_cycles_total{namespace=~"$namespace"}, pod)'),
            ]
        },
        "panels": panels,
    }


def pos(x: int, y: int, w: int, h: int) -> dict:
    return {"x": x, "y": y, "w": w, "h": h}


def main() -> None:
    write_or_check(OUT, json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n", "dashboard.py")


if __name__ == "__main__":
    main()
