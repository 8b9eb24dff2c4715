"""Sweep the HVD decision threshold τ (and the rule-based hybrid's score threshold) on a workload.

Each setting runs on the same prompts (greedy) next to `vanilla`; `suffix` and the model
drafter (`eagle3`) run once as the single-source references, and so does the cost-aware
hybrid (the default, which weighs ŷ against measured cycle costs instead of τ). The report gives tokens per
cycle, cycles per 1,000 tokens and speedup vs vanilla per setting. Choose the default τ as
the fastest setting on `edit` that stays within 3 % of the best single source elsewhere.

    python -m bench.hybrid_sweep --workload edit --limit 20 --out bench/results/hybrid_sweep_edit.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.harness import benchmark, pyplot, workload_args, write_figure
from bench.workloads import load

KEYS = ("tokens_per_s", "speedup_vs_vanilla", "tau", "cycles_per_1k", "exact_match_vs_vanilla")
KNOBS = {"hybrid": "tau", "hybrid-rule": "threshold"}  # the rule attribute each sweep sets


def sweep(engine, prompts, max_new: int, settings: dict[str, list[float]]) -> list[dict]:
    """Rows for the single-source references, the cost-aware hybrid, and every setting of each
    hybrid's knob (the paper's threshold rule: no cost model)."""
    from services.drafter.hybrid import CycleCosts

    rows = []

    def run(methods: list[str], setting: float | str | None = None) -> None:
        engine.suffix_cache.clear()  # each setting starts from the same (empty) past outputs
        for r in benchmark(engine, prompts, ["vanilla", *methods], max_new, 1, None):
            if r["method"] != "vanilla":
                rows.append({"method": r["method"], "setting": setting, **{k: r[k] for k in KEYS}})

    run(["suffix", engine.model_fallback])
    hybrid = engine.drafters["hybrid"]
    hybrid.costs = CycleCosts()
    run(["hybrid"], "cost-aware")
    hybrid.costs = None
    todo = [(m, v) for m, values in settings.items() for v in values]
    for i, (method, value) in enumerate(todo):
        setattr(engine.drafters[method].rule, KNOBS[method], value)
        run([method], value)
        print(f"[hybrid-sweep] {i + 1}/{len(todo)} settings", file=sys.stderr, flush=True)
    return rows


def best(rows: list[dict], method: str) -> dict:
    """The fastest threshold setting of ``method``."""
    return max(
        (r for r in rows if r["method"] == method and isinstance(r["setting"], float)),
        key=lambda r: r["speedup_vs_vanilla"],
    )


def markdown(result: dict) -> str:
    lines = [
        f"### HVD τ sweep — {result['workload']}, {result['limit']} prompts, {result['max_new_tokens']} new tokens",
        "",
        "| method | setting | tok/s | speedup | tokens/cycle | cycles / 1k | exact vs vanilla |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        setting = (
            r["setting"]
            if isinstance(r["setting"], str)
            else "—"
            if r["setting"] is None
            else f"{KNOBS[r['method']]} = {r['setting']}"
        )
        lines.append(
            f"| {r['method']} | {setting} | {r['tokens_per_s']} | {r['speedup_vs_vanilla']} | {r['tau']} "
            f"| {r['cycles_per_1k']} | {r['exact_match_vs_vanilla']} |"
        )
    return "\n".join(lines + ["", f"Command: `{result['command']}`", ""])


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    hyb = [r for r in rows if r["method"] == "hybrid" and isinstance(r["setting"], float)]
    ax.plot(
        [r["setting"] for r in hyb], [r["speedup_vs_vanilla"] for r in hyb], "o-", label="hybrid (predicted yield > τ)"
    )
    for r in (r for r in rows if r["setting"] == "cost-aware"):
        ax.axhline(r["speedup_vs_vanilla"], ls="-", lw=1.2, color="C0", label="hybrid, cost-aware (default)")
    for i, r in enumerate(r for r in rows if r["setting"] is None):
        ax.axhline(r["speedup_vs_vanilla"], ls="--", lw=0.8, color=f"C{i + 1}", label=r["method"])
    rule = best(rows, "hybrid-rule")
    ax.axhline(
        rule["speedup_vs_vanilla"], ls=":", lw=0.8, color="C4", label=f"hybrid-rule, best (score ≥ {rule['setting']})"
    )
    ax.set_xlabel("τ")
    ax.set_ylabel("speedup vs vanilla")
    ax.set_title(f"HVD τ sweep — {result['workload']}")
    ax.legend(fontsize=7)
    write_figure(fig, path)


def main() -> None:
    from services.common.config import EngineConfig
    from services.common.runtime import freeze_startup_heap
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "edit", 20, 256)
    ap.add_argument("--taus", default="2,3,4,5,6,8,10")
    ap.add_argument("--thresholds", default="2,4,6,8,12")
    args = ap.parse_args()
    engine = Engine(EngineConfig(threads=args.threads))
    freeze_startup_heap()  # as `make bench` and a serving process do: no full collections of the start-up heap
    missing = [m for m in KNOBS if m not in engine.drafters]
    if missing:
        sys.exit(f"error: {missing} unavailable: the sweep needs models/eagle3 (or models/draft) and models/predictor")
    settings = {
        "hybrid": [float(t) for t in args.taus.split(",")],
        "hybrid-rule": [float(t) for t in args.thresholds.split(",")],
    }
    prompts = load(args.workload, args.limit)
    rows = sweep(engine, prompts, args.max_new_tokens, settings)
    result = {
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "command": "python -m bench.hybrid_sweep " + " ".join(sys.argv[1:]),
        "rows": rows,
        "best": {m: best(rows, m) for m in KNOBS},
    }
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
        plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
