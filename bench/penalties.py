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

import statistics
from pathlib import Path

from bench.harness import run_settings, setting_bars, settings_main, table_markdown
from bench.workloads import load
from services.common.types import Sampling
from training.evaluate import seq_rep

SETTINGS = {
    "none": Sampling(),
    "repetition 1.2": Sampling(repetition_penalty=1.2),
    "presence 0.5 + frequency 0.5": Sampling(presence_penalty=0.5, frequency_penalty=0.5),
}


def run(engine, args) -> dict:
    encoded = [engine.encode_fit(p.text, args.max_new_tokens) for p in load(args.workload, args.limit)]
    return run_settings(
        engine,
        args.methods.split(","),
        {s: encoded for s in SETTINGS},
        {s: {"sampling": sp} for s, sp in SETTINGS.items()},
        args.max_new_tokens,
        args.repeats,
        "penalties",
    )


def rows(engine, runs: dict, methods: list[str]) -> list[dict]:
    out = []
    for s in SETTINGS:
        van = runs[(s, "vanilla")]
        for m in methods:
            rs = runs[(s, m)]
            cycles = sum(r.stats["cycles"] for r in rs)
            out.append(
                {
                    "setting": s,
                    "method": m,
                    "tokens_per_s": round(sum(len(r.ids) for r in rs) / sum(r.wall for r in rs), 1),
                    "speedup_vs_vanilla": round(statistics.median(v.wall / r.wall for v, r in zip(van, rs)), 3),
                    "tau": round(sum(r.stats["generated_tokens"] for r in rs) / cycles, 3),
                    "identical_to_vanilla": round(sum(r.ids == v.ids for v, r in zip(van, rs)) / len(rs), 3),
                    "seq_rep_4": round(statistics.mean(seq_rep(r.ids) for r in rs), 3),
                }
            )
    return out


def markdown(result: dict) -> str:
    a = result["args"]
    cols = [
        "penalties",
        "method",
        "tok/s",
        "speedup vs vanilla (same penalties)",
        "τ",
        "identical to vanilla",
        "seq-rep-4",
    ]
    table = [
        [
            r["setting"],
            r["method"],
            r["tokens_per_s"],
            r["speedup_vs_vanilla"],
            r["tau"],
            f"{100 * r['identical_to_vanilla']:.0f} %",
            r["seq_rep_4"],
        ]
        for r in result["rows"]
    ]
    title = (
        f"### Penalties — `{a['workload']}`, {a['limit']} prompts, {a['max_new_tokens']} new tokens, greedy, "
        f"{a['repeats']} repeat(s) (medians over prompts)"
    )
    return table_markdown(title, cols, table, result["command"], (f"Machine: {result['machine']}",))


def plot(result: dict, path: Path) -> None:
    setting_bars(result, SETTINGS, "speedup vs vanilla (same penalties)", path, lambda s: f"penalties: {s}")


def main(argv: list[str] | None = None) -> dict:
    return settings_main(
        "bench.penalties", __doc__, argv, {s: vars(sp) for s, sp in SETTINGS.items()}, run, rows, markdown, plot
    )


if __name__ == "__main__":
    main()
