"""Quality of calibrated verification on many prompts, with 95 % bootstrap intervals.

Greedy outputs are deterministic, so τ and target NLL need no timing: this scores many more
prompts than the side-by-side speed benchmark can, and it may run beside other work (speed
belongs to ``bench.harness``). One output that takes another path after an early rescue can
move a 20-prompt NLL figure by several percent either way, so each figure here comes with an
interval from resampling the prompts (vanilla's, sd's and the method's outputs of a prompt
are resampled together).

Per gate ``tau:top_k:min_count[:confirm]`` it runs ``csd`` (and ``scg``, the same gate without the
memory) and reports: pooled target NLL per token relative to vanilla's; τ (tokens per cycle,
pooled) relative to sd's; parse rate against vanilla's; the share of outputs equal to
vanilla's; rescues per 1,000 tokens; and the NLL change split by where the output first leaves
vanilla's (in its first two tokens, or later). The correction memory is reset to the shipped
calibration snapshot before every gate, so gates do not learn from each other's runs.

    python -m bench.csd_quality --workload humaneval --limit 100 --out bench/results/csd_quality_humaneval.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from bench.harness import pyplot, report, run_ours, target_nll, workload_args, write_figure
from bench.quality import parses
from bench.workloads import load
from services.common.config import EngineConfig, GateConfig
from services.memory.correction_memory import LocalCorrectionMemory
from services.verifier.policies import CalibratedGreedy

EARLY = 2  # a first divergence within this many tokens counts as early


def score(engine, method: str, prompts: list[list[int]], max_new: int, label: str) -> list[dict]:
    """One greedy run of ``method`` per prompt: its tokens, target NLL and cycle counts."""
    out, t0 = [], time.time()
    for i, ids in enumerate(prompts):
        r = run_ours(engine, method, ids, max_new)
        nll, n = target_nll(engine, ids, r.ids)
        out.append(
            {
                "ids": r.ids,
                "nll": nll,
                "n": n,
                "cycles": r.stats["cycles"],
                "gen": r.stats["generated_tokens"],
                "rescued": r.stats.get("rescued_tokens", 0),
            }
        )
        if (i + 1) % 20 == 0 or i + 1 == len(prompts):
            rate = (time.time() - t0) / (i + 1)
            print(
                f"[csd-quality] {label}: {i + 1}/{len(prompts)}  {rate:.2f} s/prompt  "
                f"eta {rate * (len(prompts) - i - 1):.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return out


def pooled_ratio(num: list[dict], den: list[dict], key_n: str, key_d: str, idx: list[int]) -> float:
    """(Σ num[key_n] / Σ num[key_d]) / (Σ den[key_n] / Σ den[key_d]) over prompts ``idx``."""
    a = sum(num[i][key_n] for i in idx) / max(1e-9, sum(num[i][key_d] for i in idx))
    b = sum(den[i][key_n] for i in idx) / max(1e-9, sum(den[i][key_d] for i in idx))
    return a / b if b else float("nan")


def interval(stat, n: int, draws: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile bootstrap interval of ``stat(indices)`` over n prompts."""
    rng = random.Random(seed)
    values = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return [round(values[int(0.025 * draws)], 4), round(values[int(0.975 * draws) - 1], 4)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(
    runs: list[dict], vanilla: list[dict], sd: list[dict], texts: list[str], v_texts: list[str], prompt_texts: list[str]
) -> dict:
    n = len(runs)
    every = list(range(n))
    nll = lambda idx: pooled_ratio(runs, vanilla, "nll", "n", idx) - 1  # noqa: E731
    tau = lambda idx: pooled_ratio(runs, sd, "gen", "cycles", idx)  # noqa: E731  (tokens per cycle)
    div = [first_divergence(r["ids"], v["ids"]) for r, v in zip(runs, vanilla)]
    early = [i for i, d in enumerate(div) if d is not None and d < EARLY]
    late = [i for i, d in enumerate(div) if d is not None and d >= EARLY]
    tokens = sum(r["n"] for r in runs)
    return {
        "nll_vs_vanilla": round(nll(every), 4),
        "nll_vs_vanilla_ci95": interval(nll, n),
        "tau_vs_sd": round(tau(every), 4),
        "tau_vs_sd_ci95": interval(tau, n),
        "parse_rate": round(sum(parses(p, t) for p, t in zip(prompt_texts, texts)) / n, 3),
        "parse_rate_vanilla": round(sum(parses(p, t) for p, t in zip(prompt_texts, v_texts)) / n, 3),
        "exact_match_vs_vanilla": round(sum(d is None for d in div) / n, 3),
        "rescues_per_1k": round(1000 * sum(r["rescued"] for r in runs) / max(1, tokens), 2),
        "early_divergence": {"prompts": len(early), "nll_vs_vanilla": round(nll(early) if early else 0.0, 4)},
        "late_divergence": {"prompts": len(late), "nll_vs_vanilla": round(nll(late) if late else 0.0, 4)},
    }


def parse_gate(spec: str) -> GateConfig:
    """``tau:top_k:min_count[:confirm]``."""
    tau, top_k, min_count, *confirm = spec.split(":")
    return GateConfig(
        min_count=float(min_count), top_k=int(top_k), tau=float(tau), confirm=int(confirm[0]) if confirm else 0
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "humaneval", 100, 128)
    ap.add_argument(
        "--gates", default="0.5:2:3", help="comma-separated tau:top_k:min_count[:confirm] (default: the shipped gate)"
    )
    ap.add_argument("--scg", action="store_true", help="also run each gate without the memory (scg)")
    args = ap.parse_args()
    import torch

    from services.router.engine import Engine

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(eagle3=None, threads=args.threads))
    loaded = load(args.workload, args.limit)
    prompts = [engine.encode_fit(p.text, args.max_new_tokens) for p in loaded]
    prompt_texts = [p.text for p in loaded]
    decode = lambda runs: [engine.tokenizer.decode(r["ids"]) for r in runs]  # noqa: E731
    prior = engine.verifier.memory.snapshot()
    vanilla = score(engine, "vanilla", prompts, args.max_new_tokens, "vanilla")
    sd = score(engine, "sd", prompts, args.max_new_tokens, "sd")
    v_texts = decode(vanilla)
    rows = []
    for spec in args.gates.split(","):
        gate = parse_gate(spec)
        fresh = LocalCorrectionMemory()
        fresh.restore(prior)
        engine.verifier.set_memory(fresh)
        engine.verifier.policies["csd"] = CalibratedGreedy(gate, engine.verifier.memory)
        engine.verifier.policies["scg"] = CalibratedGreedy(
            GateConfig(top_k=gate.top_k, tau=gate.tau, use_memory=False, confirm=gate.confirm)
        )
        for method in ("csd", "scg") if args.scg else ("csd",):
            runs = score(engine, method, prompts, args.max_new_tokens, f"{method} {spec}")
            rows.append(
                {"method": method, "gate": spec, **compare(runs, vanilla, sd, decode(runs), v_texts, prompt_texts)}
            )
    result = {
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "command": "python -m bench.csd_quality " + " ".join(sys.argv[1:]),
        "sd_tau": round(sum(r["gen"] for r in sd) / sum(r["cycles"] for r in sd), 3),
        "vanilla_nll": round(sum(r["nll"] for r in vanilla) / sum(r["n"] for r in vanilla), 4),
        "rows": rows,
    }
    report(result, args.out, markdown, plot)


def markdown(result: dict) -> str:
    lines = [
        f"### CSD quality on `{result['workload']}` — {result['limit']} prompts, {result['max_new_tokens']} "
        f"new tokens, greedy (95 % bootstrap intervals over prompts)",
        "",
        f"vanilla NLL {result['vanilla_nll']} per token; sd τ {result['sd_tau']}. Goals: τ ≥ 1.15× sd's, "
        "NLL within 3 % of vanilla's, parse rate at most 1 point below vanilla's.",
        "",
        "| method | gate τ:top-k:min-count[:confirm] | NLL vs vanilla | τ vs sd | parse (vanilla) | exact | rescues/1k "
        "| early div: prompts, NLL | later div: prompts, NLL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    pct = lambda x: f"{100 * x:+.1f} %"  # noqa: E731
    for r in result["rows"]:
        lo, hi = r["nll_vs_vanilla_ci95"]
        tlo, thi = r["tau_vs_sd_ci95"]
        e, la = r["early_divergence"], r["late_divergence"]
        lines.append(
            f"| {r['method']} | {r['gate']} | {pct(r['nll_vs_vanilla'])} [{pct(lo)}, {pct(hi)}] | "
            f"{r['tau_vs_sd']:.3f} [{tlo:.3f}, {thi:.3f}] | {r['parse_rate']} ({r['parse_rate_vanilla']}) | "
            f"{r['exact_match_vs_vanilla']} | {r['rescues_per_1k']} | {e['prompts']}, {pct(e['nll_vs_vanilla'])} | "
            f"{la['prompts']}, {pct(la['nll_vs_vanilla'])} |"
        )
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    fig, ax = pyplot().subplots(figsize=(6.4, 4.4))
    for r in result["rows"]:
        x, y = r["tau_vs_sd"], 100 * r["nll_vs_vanilla"]
        (xl, xh), (yl, yh) = r["tau_vs_sd_ci95"], r["nll_vs_vanilla_ci95"]
        ax.errorbar(
            [x],
            [y],
            xerr=[[x - xl], [xh - x]],
            yerr=[[y - 100 * yl], [100 * yh - y]],
            fmt="o",
            capsize=3,
            color="tab:blue" if r["method"] == "csd" else "tab:orange",
        )
        ax.annotate(f"{r['method']} {r['gate']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhspan(-100, 3, xmin=0, xmax=1, color="tab:green", alpha=0.06)
    ax.axvline(1.15, color="tab:green", ls="--", lw=0.8)
    ax.axhline(3, color="tab:green", ls="--", lw=0.8)
    ax.set_xlabel("τ relative to sd (goal ≥ 1.15)")
    ax.set_ylabel("target NLL vs vanilla, % (goal ≤ 3)")
    ax.set_ylim(min(-10, ax.get_ylim()[0]), max(20, ax.get_ylim()[1]))
    ax.set_title(f"CSD quality, {result['workload']} ({result['limit']} prompts)")
    write_figure(fig, path)


if __name__ == "__main__":
    main()
