"""Sweep the CSD gate (τ × top-k, min_count) on a workload and plot τ against quality.

Every configuration runs `csd` on the same prompts (greedy), next to `vanilla` and `sd`;
the report has τ (tokens/cycle), speedup vs vanilla, target NLL relative to vanilla,
parse rate, exact match and rescue rate, so defaults can be chosen where τ rises while NLL
stays within 3 % and the parse rate within 1 point of vanilla.

    python -m bench.csd_sweep --workload humaneval --limit 20 --out bench/results/csd_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from bench.harness import benchmark, pyplot, workload_args, write_figure
from bench.workloads import load
from services.common.config import EngineConfig, GateConfig, models_dir
from services.verifier.policies import CalibratedGreedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "humaneval", 20, 128)
    ap.add_argument("--taus", default="0.05,0.1,0.2,0.3,0.5,0.8")
    ap.add_argument("--top-ks", default="3,5,10")
    ap.add_argument("--min-counts", default="3")
    args = ap.parse_args()
    from services.router.engine import Engine

    engine = Engine(
        EngineConfig(target=models_dir() / "target", draft=models_dir() / "draft", eagle3=None, threads=args.threads)
    )
    prompts = load(args.workload, args.limit)
    base = {r["method"]: r for r in benchmark(engine, prompts, ["vanilla", "sd"], args.max_new_tokens, 1, None)}
    rows = []
    grid = list(
        itertools.product(
            [float(t) for t in args.taus.split(",")],
            [int(k) for k in args.top_ks.split(",")],
            [float(c) for c in args.min_counts.split(",")],
        )
    )
    for i, (tau, k, c) in enumerate(grid):
        gate = GateConfig(min_count=c, top_k=k, tau=tau)
        engine.verifier.policies["csd"] = CalibratedGreedy(gate, engine.verifier.memory)
        engine.verifier.policies["scg"] = CalibratedGreedy(GateConfig(min_count=c, top_k=k, tau=tau, use_memory=False))
        for r in benchmark(engine, prompts, ["vanilla", "csd", "scg"], args.max_new_tokens, 1, None):
            if r["method"] == "vanilla":
                continue
            r.update(
                gate_tau=tau,
                gate_top_k=k,
                gate_min_count=c,
                nll_vs_vanilla=round(r["target_nll"] / base["vanilla"]["target_nll"] - 1, 4),
                parse_vs_vanilla=round(r["parse_rate"] - base["vanilla"]["parse_rate"], 3),
                tau_vs_sd=round(r["tau"] / base["sd"]["tau"], 3),
            )
            r.pop("rescued_kinds", None)
            rows.append(r)
        print(f"[csd-sweep] {i + 1}/{len(grid)} configurations", file=sys.stderr, flush=True)
    result = {
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "command": "python -m bench.csd_sweep " + " ".join(sys.argv[1:]),
        "baseline": base,
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method, marker in (("csd", "o"), ("scg", "s")):
        rows = [r for r in result["rows"] if r["method"] == method]
        ax.scatter([100 * r["nll_vs_vanilla"] for r in rows], [r["tau"] for r in rows], marker=marker, label=method)
        for r in rows:
            ax.annotate(f"τ={r['gate_tau']},k={r['gate_top_k']}", (100 * r["nll_vs_vanilla"], r["tau"]), fontsize=6)
    ax.axhline(result["baseline"]["sd"]["tau"], color="gray", ls="--", lw=0.8, label="sd")
    ax.axvline(3.0, color="red", ls=":", lw=0.8, label="NLL +3 %")
    ax.set_xlabel("target NLL vs vanilla (%)")
    ax.set_ylabel("tokens per cycle")
    ax.set_title(f"CSD gate sweep — {result['workload']}")
    ax.legend(fontsize=7)
    write_figure(fig, path)


if __name__ == "__main__":
    main()
