"""Penalties and speculation: each method's speedup over `vanilla` under the same sampling
penalties (vLLM's repetition, presence and frequency penalties), greedy.

Penalties change what the target generates: they push it off repeated tokens and lines, and
repetition is what the suffix cache drafts from. For each prompt, every (setting, method) cell
runs once per repeat in rotated order, in one process; speedup is the median over prompts of
wall(`vanilla`, same setting) / wall(method). Every lossless method must equal `vanilla` token
for token under the same penalties ("identical"). seq-rep-4 (the share of an output's 4-grams
that repeat an earlier one) of the `vanilla` outputs shows what the penalties did to the text.

    python -m bench.penalties --workload humaneval --limit 20 --out bench/results/penalties_humaneval.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.harness import (bench_engine, command, machine, past_outputs, pyplot, report, run_ours, table_markdown,
                           workload_args, write_figure)
from bench.workloads import load
from services.common.types import SamplingParams
from training.evaluate import seq_rep

SETTINGS = {
    "none": SamplingParams(),
    "repetition 1.2": SamplingParams(repetition_penalty=1.2),
    "presence 0.5 + frequency 0.5": SamplingParams(presence_penalty=0.5, frequency_penalty=0.5),
}


def run(engine, args) -> dict:
    """(setting, method) → per-prompt runs (the median-wall repeat of each prompt)."""
    methods = args.methods.split(",")
    cells = [(s, m) for s in SETTINGS for m in methods]
    encoded = [engine.encode_fit(p.text, args.max_new_tokens) for p in load(args.workload, args.limit)]
    with past_outputs(engine, keep=False):   # warm-up; its outputs would leak into prompt 0
        for s, m in cells:
            run_ours(engine, m, encoded[0], 16, SETTINGS[s])
    runs: dict[tuple[str, str], list] = {c: [] for c in cells}
    t0 = time.time()
    for i, ids in enumerate(encoded):
        per: dict[tuple[str, str], list] = {c: [] for c in cells}
        with past_outputs(engine):   # no cell drafts from another cell's output of this prompt
            for _ in range(args.repeats):
                for s, m in cells[i % len(cells):] + cells[:i % len(cells)]:
                    per[(s, m)].append(run_ours(engine, m, ids, args.max_new_tokens, SETTINGS[s]))
        for c in cells:
            runs[c].append(sorted(per[c], key=lambda r: r.wall)[len(per[c]) // 2])
        rate = (time.time() - t0) / (i + 1)
        print(f"[penalties] {i + 1}/{len(encoded)} prompts  {rate:.1f} s/prompt  eta {rate * (len(encoded) - i - 1):.0f} s",
              file=sys.stderr, flush=True)
    return runs


def rows(runs: dict, methods: list[str]) -> list[dict]:
    out = []
    for s in SETTINGS:
        van = runs[(s, "vanilla")]
        for m in methods:
            rs = runs[(s, m)]
            cycles = sum(r.stats["cycles"] for r in rs)
            out.append({"setting": s, "method": m,
                        "tokens_per_s": round(sum(len(r.ids) for r in rs) / sum(r.wall for r in rs), 1),
                        "speedup_vs_vanilla": round(statistics.median(v.wall / r.wall for v, r in zip(van, rs)), 3),
                        "tau": round(sum(r.stats["generated_tokens"] for r in rs) / cycles, 3),
                        "identical_to_vanilla": round(sum(r.ids == v.ids for v, r in zip(van, rs)) / len(rs), 3),
                        "seq_rep_4": round(statistics.mean(seq_rep(r.ids) for r in rs), 3)})
    return out


def markdown(result: dict) -> str:
    a = result["args"]
    cols = ["penalties", "method", "tok/s", "speedup vs vanilla (same penalties)", "τ", "identical to vanilla",
            "seq-rep-4"]
    table = [[r["setting"], r["method"], r["tokens_per_s"], r["speedup_vs_vanilla"], r["tau"],
              f"{100 * r['identical_to_vanilla']:.0f} %", r["seq_rep_4"]] for r in result["rows"]]
    title = (f"### Penalties — `{a['workload']}`, {a['limit']} prompts, {a['max_new_tokens']} new tokens, greedy, "
             f"{a['repeats']} repeat(s) (medians over prompts)")
    return table_markdown(title, cols, table, result["command"], (f"Machine: {result['machine']}",))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    methods = [m for m in result["args"]["methods"].split(",") if m != "vanilla"]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / len(SETTINGS)
    for j, s in enumerate(SETTINGS):
        ax.bar([i + (j - (len(SETTINGS) - 1) / 2) * width for i in range(len(methods))],
               [next(r["speedup_vs_vanilla"] for r in result["rows"] if r["setting"] == s and r["method"] == m)
                for m in methods], width, label=f"penalties: {s}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(methods)), methods)
    ax.set(ylabel="speedup vs vanilla (same penalties)")
    ax.legend(fontsize=8)
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from services.cli import _engine_args

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _engine_args(p)
    workload_args(p, threads=False)   # --threads comes with the engine's arguments
    p.add_argument("--methods", default="vanilla,sd,suffix,eagle3,hybrid")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    if methods[0] != "vanilla":
        raise SystemExit("--methods must start with vanilla (the baseline of each setting)")
    engine = bench_engine(args)
    result = {"args": {k: getattr(args, k) for k in ("workload", "limit", "max_new_tokens", "repeats", "methods")},
              "settings": {s: vars(sp) for s, sp in SETTINGS.items()},
              "machine": machine(), "command": command("bench.penalties", argv),
              "rows": rows(run(engine, args), methods)}
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
