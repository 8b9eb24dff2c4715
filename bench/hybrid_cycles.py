"""What the hybrids choose, cycle by cycle: per choice (cache draft, model drafter, plain step)
and per length of the cache draft on offer (0: none), the cycles, tokens per cycle, ms per
cycle and tokens per second; and the predictor's ŷ against the true yield per draft length.

Every method runs side by side on the same prompts, interleaved (``bench.harness``). A
cycle's time runs from the hybrid's choice to the commit it observes, so it holds drafting,
verification and bookkeeping. The predictor table pairs each consulted draft's raw ŷ (before
the online calibration) with its true yield, known once verified or shadow-verified.

    python -m bench.hybrid_cycles --workload humaneval --out bench/results/hybrid_cycles_humaneval.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.harness import benchmark, command, machine, pyplot, report, table_markdown, workload_args, write_figure
from bench.workloads import load


class Recorder:
    """Wraps one hybrid drafter's ``propose_batch`` (the engine's one call per step), ``observe``
    and its rule's ``realize``."""

    def __init__(self, hybrid):
        from services.drafter.hybrid import length_bucket

        self.clear()
        propose_batch, observe, realize = hybrid.propose_batch, hybrid.observe, hybrid.rule.realize
        started: dict[str, tuple[float, int]] = {}

        def timed_propose_batch(asks):
            t0 = time.perf_counter()
            out = propose_batch(asks)
            for req_id, _ in asks:
                started[req_id] = (t0, len(hybrid.states[req_id].cache_draft))
            return out

        def timed_observe(req_id, tokens, target_states=None):
            st = hybrid.states[req_id]
            if req_id in started and st.tracker.generated > 0:  # a request's first cycle holds its prefill
                t0, offered = started.pop(req_id)
                self.cycles[(st.choice, length_bucket(offered))].append((len(tokens), time.perf_counter() - t0))
            started.pop(req_id, None)
            observe(req_id, tokens, target_states)

        def recorded_realize(length, raw, y):
            self.yields[length_bucket(length)].append((raw, y))
            realize(length, raw, y)

        hybrid.propose_batch, hybrid.observe, hybrid.rule.realize = timed_propose_batch, timed_observe, recorded_realize

    def clear(self) -> None:
        self.cycles: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
        self.yields: dict[int, list[tuple[float, int]]] = defaultdict(list)

    def rows(self) -> tuple[list[dict], list[dict]]:
        cycles = []
        for (choice, bucket), xs in sorted(self.cycles.items()):
            tokens, secs = sum(k for k, _ in xs), sum(s for _, s in xs)
            cycles.append(
                {
                    "choice": choice,
                    "offered_bucket": bucket,
                    "cycles": len(xs),
                    "tokens_per_cycle": round(tokens / len(xs), 3),
                    "ms_per_cycle": round(1e3 * secs / len(xs), 3),
                    "tokens_per_s": round(tokens / secs, 1),
                }
            )
        yields = [
            {
                "bucket": b,
                "drafts": len(xs),
                "mean_raw_y_hat": round(sum(r for r, _ in xs) / len(xs), 3),
                "mean_y": round(sum(y for _, y in xs) / len(xs), 3),
            }
            for b, xs in sorted(self.yields.items())
        ]
        return cycles, yields


def bucket_label(b: int) -> str:
    """``length_bucket``'s inverse: 0–4 alone, then 5-8, 9-16, ..."""
    return str(b) if b <= 4 else f"{2 ** (b - 3) + 1}-{2 ** (b - 2)}"


def markdown(result: dict) -> str:
    parts = [
        table_markdown(
            f"### Hybrid methods side by side — {result['workload']}, {result['limit']} prompts, "
            f"{result['max_new_tokens']} new tokens, greedy",
            ["method", "speedup", "τ", "cycles / 1k", "cycles by source"],
            [
                [
                    r["method"],
                    r["speedup_vs_vanilla"],
                    r["tau"],
                    r["cycles_per_1k"],
                    ", ".join(f"{k} {v}" for k, v in sorted((r.get("cycles_by_source") or {}).items())) or "—",
                ]
                for r in result["rows"]
            ],
            result["command"],
            (f"Machine: {result['machine']}.",),
        )
    ]
    for name, h in result["hybrids"].items():
        parts.append(
            table_markdown(
                f"#### `{name}`: cycles by choice and by the cache draft's length on offer",
                ["choice", "cache draft on offer", "cycles", "tokens / cycle", "ms / cycle", "tokens / s"],
                [
                    [
                        r["choice"],
                        bucket_label(r["offered_bucket"]),
                        r["cycles"],
                        r["tokens_per_cycle"],
                        r["ms_per_cycle"],
                        r["tokens_per_s"],
                    ]
                    for r in h["cycles"]
                ],
                result["command"],
            )
        )
        if h["yields"]:
            parts.append(
                table_markdown(
                    f"#### `{name}`: the predictor's raw ŷ against the true yield, by draft length",
                    ["draft length", "drafts", "mean raw ŷ", "mean yield"],
                    [[bucket_label(r["bucket"]), r["drafts"], r["mean_raw_y_hat"], r["mean_y"]] for r in h["yields"]],
                    result["command"],
                )
            )
    return "\n".join(parts)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    names = list(result["hybrids"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = result["hybrids"][name]["cycles"]
        buckets = sorted({r["offered_bucket"] for r in rows})
        choices = sorted({r["choice"] for r in rows})
        width = 0.8 / len(choices)
        for j, c in enumerate(choices):
            rate = {r["offered_bucket"]: r["tokens_per_s"] for r in rows if r["choice"] == c}
            ax.bar(
                [i + (j - (len(choices) - 1) / 2) * width for i in range(len(buckets))],
                [rate.get(b, 0) for b in buckets],
                width,
                label=c,
            )
        ax.set_xticks(range(len(buckets)), [bucket_label(b) for b in buckets])
        ax.set(xlabel="cache draft on offer (tokens)", ylabel="tokens / s", title=f"{name} — {result['workload']}")
        ax.legend(fontsize=8)
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from services.common.config import EngineConfig
    from services.common.runtime import freeze_startup_heap
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "humaneval", 20, 128)
    ap.add_argument("--methods", default="vanilla,suffix,eagle3,hybrid,hybrid-rule")
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(threads=args.threads or 1))
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in engine.methods()]
    if unknown:
        sys.exit(f"error: unknown or unavailable methods {unknown}; available: {engine.methods()}")
    freeze_startup_heap()  # as `make bench` and a serving process do
    result = {
        "workload": args.workload,
        "machine": machine(),
        "command": command("bench.hybrid_cycles", argv),
        **measure(engine, load(args.workload, args.limit), methods, args.max_new_tokens),
    }
    report(result, args.out, markdown, plot)
    return result


def measure(engine, prompts, methods: list[str], max_new: int) -> dict:
    """The methods side by side (``bench.harness.benchmark``), with every hybrid drafter that
    one of them uses recorded after the warm-up."""
    from services.drafter.hybrid import HybridDrafter
    from services.router.engine import METHODS

    hybrids = {
        name: Recorder(d)
        for name, d in engine.drafters.items()
        if isinstance(d, HybridDrafter) and any(METHODS[m].router_drafter == name for m in methods)
    }
    rows = benchmark(
        engine, prompts, methods, max_new, 1, None, warmed=lambda: [rec.clear() for rec in hybrids.values()]
    )
    return {
        "limit": len(prompts),
        "max_new_tokens": max_new,
        "rows": [
            {k: r[k] for k in ("method", "speedup_vs_vanilla", "tau", "cycles_per_1k", "cycles_by_source")}
            for r in rows
        ],
        "hybrids": {name: dict(zip(("cycles", "yields"), rec.rows())) for name, rec in hybrids.items()},
    }


if __name__ == "__main__":
    main()
