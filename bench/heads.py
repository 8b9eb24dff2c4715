"""EAGLE-3 heads side by side: the methods that draft with the head, once per head, interleaved
with `vanilla` on the same prompts in one process.

Each head gets an engine of its own (same target, draft and predictor; only ``--eagle3``
differs), so nothing a method learns while running (the hybrid's measured cycle costs, the
suffix cache's past outputs) crosses from one head to the other. Per prompt, every cell
(`vanilla`, then each method under each head) runs once in rotated order, prefilled cold;
speedups are medians over prompts of `vanilla`'s wall time over the cell's.

    python -m bench.heads --workload edit --limit 20 --max-new-tokens 256 \\
        --heads models/eagle3,build/models/eagle3-stage3 --methods eagle3,hybrid --out bench/results/heads_edit.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.harness import (
    command,
    grouped_bars,
    machine,
    past_outputs,
    pyplot,
    report,
    run_ours,
    summarize,
    table_markdown,
    target_nll,
    workload_args,
    write_figure,
)
from bench.workloads import load


def run(engines: dict[str, object], prompts, methods: list[str], max_new: int) -> dict[tuple[str, str], list]:
    """(method, head) → per-prompt runs; (`vanilla`, "") on the first head's engine."""
    first = next(iter(engines.values()))
    cells = [("vanilla", "")] + [(m, h) for h in engines for m in methods]
    encoded = [first.encode_fit(p.text, max_new) for p in prompts]
    for m, h in cells:  # warm-up; its outputs would leak into prompt 0
        eng = engines[h] if h else first
        with past_outputs(eng, keep=False):
            run_ours(eng, m, encoded[0], 16)
    runs: dict[tuple[str, str], list] = {c: [] for c in cells}
    t0 = time.time()
    for i, ids in enumerate(encoded):
        order = cells[i % len(cells) :] + cells[: i % len(cells)]
        with contextlib.ExitStack() as defer:  # no cell drafts from another cell's output of this prompt
            for eng in engines.values():
                defer.enter_context(past_outputs(eng))
            for m, h in order:
                runs[(m, h)].append(run_ours(engines[h] if h else first, m, ids, max_new))
        rate = (time.time() - t0) / (i + 1)
        print(
            f"[heads] {i + 1}/{len(encoded)} prompts  {rate:.1f} s/prompt  eta {rate * (len(encoded) - i - 1):.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return runs


def rows(engine, prompts, runs, max_new: int) -> list[dict]:
    encoded = [engine.encode_fit(p.text, max_new) for p in prompts]
    out = []
    for (m, h), rs in runs.items():
        nll = [0.0, 0]
        for ids, r in zip(encoded, rs):
            s, n = target_nll(engine, ids, r.ids)
            nll[0] += s
            nll[1] += n
        texts = [engine.tokenizer.decode(r.ids) for r in rs]
        row = summarize(
            m,
            rs,
            runs[("vanilla", "")],
            tuple(nll),
            [None] * len(rs),
            texts,
            [p.text for p in prompts],
            engine.tokenizer,
        )
        out.append({"head": h or None, **row})
    return out


def markdown(result: dict) -> str:
    return table_markdown(
        f"### EAGLE-3 heads side by side — {result['workload']}, {result['limit']} prompts, "
        f"{result['max_new_tokens']} new tokens, greedy",
        [
            "method",
            "head",
            "tok/s",
            "speedup",
            "τ",
            "cycles / 1k",
            "draft ms / cycle",
            "cycles by source",
            "exact vs vanilla",
        ],
        [
            [
                r["method"],
                f"`{r['head']}`" if r["head"] else "—",
                r["tokens_per_s"],
                r["speedup_vs_vanilla"],
                r["tau"],
                r["cycles_per_1k"],
                r.get("draft_ms_per_cycle", "—"),
                ", ".join(f"{k} {v}" for k, v in sorted((r.get("cycles_by_source") or {}).items())) or "—",
                r["exact_match_vs_vanilla"],
            ]
            for r in result["rows"]
        ],
        result["command"],
        (f"Machine: {result['machine']}.",),
    )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    methods = list(dict.fromkeys(r["method"] for r in result["rows"] if r["method"] != "vanilla"))
    heads = list(dict.fromkeys(r["head"] for r in result["rows"] if r["head"]))
    fig, ax = plt.subplots(figsize=(7, 3.4))
    speedup = {(r["head"], r["method"]): r["speedup_vs_vanilla"] for r in result["rows"]}
    grouped_bars(ax, methods, heads, lambda h, m: speedup[(h, m)])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel="speedup over vanilla", title=f"EAGLE-3 heads — {result['workload']}")
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from services.cli import add_engine_args, engine_config
    from services.common.runtime import freeze_startup_heap
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "humaneval", 20, 128, threads=False)  # --threads comes with the engine's flags
    add_engine_args(ap)  # the target, predictor and the rest, as `python -m bench` takes them
    ap.add_argument("--heads", required=True, help="comma-separated EAGLE-3 head directories")
    ap.add_argument("--methods", default="eagle3,hybrid", help="methods that draft with the head")
    ap.add_argument("--chat", action="store_true", help="give each prompt through the chat template")
    args = ap.parse_args(argv)
    cfg = engine_config(args)
    engines = {h: Engine(replace(cfg, eagle3=Path(h), threads=cfg.threads or 1)) for h in args.heads.split(",")}
    freeze_startup_heap()  # as `make bench` and a serving process do: no full collections of the start-up heap
    for h, eng in engines.items():
        if "eagle3" not in eng.verifier.drafters:
            sys.exit(f"error: {h} is not an EAGLE-3 head for the target")
    prompts = load(args.workload, args.limit, next(iter(engines.values())).tokenizer if args.chat else None)
    methods = args.methods.split(",")
    runs = run(engines, prompts, methods, args.max_new_tokens)
    result = {
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "heads": list(engines),
        "methods": methods,
        "chat": args.chat,
        "target": str(cfg.target),
        "machine": machine(),
        "command": command("bench.heads", argv),
        "rows": rows(next(iter(engines.values())), prompts, runs, args.max_new_tokens),
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
