"""Token trees against chains, side by side in one interleaved run on a workload.

`suffix` against `suffix-tree` (SuffixDecoding's speculation trees), `eagle3` against
`eagle3-tree` under each tree shape (topk:steps:tokens:min_score, SGLang's
speculative_eagle_topk / num_steps / num_draft_tokens plus a score floor), and `hybrid`
against `hybrid-tree` (both drafters on trees, the engine's shape). Every method is lossless
greedy, so τ and cycles compare the drafts and speed compares what verifying a tree costs.

    python -m bench.trees --workload humaneval --shapes 2:4:8:0,2:4:6:0.1 --out bench/results/trees_humaneval.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.harness import (
    bench_engine,
    benchmark,
    command,
    machine,
    pyplot,
    report,
    table_markdown,
    workload_args,
    write_figure,
)
from bench.workloads import load

KEYS = (
    "tokens_per_s",
    "speedup_vs_vanilla",
    "tau",
    "cycles_per_1k",
    "acceptance_rate",
    "exact_match_vs_vanilla",
    "draft_ms_per_cycle",
    "verify_ms_per_cycle",
)


def parse_shape(text: str):
    from services.drafter.eagle3_drafter import TreeShape

    try:
        topk, steps, tokens, floor = text.split(":")
        return TreeShape(int(topk), int(steps), float(floor)), int(tokens)
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not topk:steps:tokens:min_score (e.g. 2:4:8:0)") from None


def add_shape(engine, text: str) -> str:
    """An `eagle3-tree[shape]` method: the engine's EAGLE-3 head drafting trees of that shape."""
    from services.drafter.eagle3_drafter import Eagle3Drafter
    from services.router.engine import METHODS, MethodSpec

    shape, tokens = parse_shape(text)
    name = f"eagle3-tree[{text}]"
    core = engine.verifier
    base = core.drafters["eagle3"]
    core.drafters[name] = Eagle3Drafter(base.head, prefix=base.prefix, tree=shape, name=name)
    core.max_draft[name] = engine.max_draft[name] = tokens
    METHODS[name] = MethodSpec(name, None, name, "lossless", f"EAGLE-3 draft trees {text}")
    return name


def markdown(result: dict) -> str:
    a = result["args"]
    return table_markdown(
        f"### Token trees against chains — {a['workload']}, {a['limit']} prompts, {a['max_new_tokens']} new tokens, greedy",
        [
            "method",
            "tok/s",
            "speedup",
            "τ",
            "cycles / 1k",
            "acceptance",
            "exact vs vanilla",
            "draft ms / cycle",
            "verify ms / cycle",
        ],
        [[r["method"], *(r[k] for k in KEYS)] for r in result["rows"]],
        result["command"],
        (
            f"Machine: {result['machine']}. Shapes are topk:steps:tokens:min_score; `eagle3-tree` is the engine's "
            f"({result['engine_shape']}).",
        ),
    )


def plot(result: dict, path: Path) -> None:
    rows = [r for r in result["rows"] if r["method"] != "vanilla"]
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 3.8))
    names = [r["method"] for r in rows]
    colors = ["tab:orange" if "tree" in n else "tab:blue" for n in names]
    for ax, key, title in (
        (axes[0], "speedup_vs_vanilla", "speedup vs vanilla"),
        (axes[1], "tau", "τ (tokens / cycle)"),
    ):
        ax.bar(names, [r[key] for r in rows], color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=35, labelsize=7)
    fig.suptitle(f"Trees (orange) vs chains (blue) — {result['args']['workload']}")
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from services.cli import add_engine_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(ap)
    workload_args(ap, "humaneval", 20, 128, threads=False)
    ap.add_argument("--shapes", default="", help="extra EAGLE tree shapes, comma-separated topk:steps:tokens:min_score")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    engine = bench_engine(args)
    needed = {"suffix-tree", "eagle3-tree", "hybrid-tree"}
    if not needed <= set(engine.methods()):
        sys.exit(f"error: needs {sorted(needed)}: models/eagle3, models/predictor and --eagle3-topk > 1")
    shapes = [add_shape(engine, s) for s in args.shapes.split(",") if s]
    methods = ["vanilla", "suffix", "suffix-tree", "eagle3", "eagle3-tree", *shapes, "hybrid", "hybrid-tree"]
    rows = benchmark(engine, load(args.workload, args.limit), methods, args.max_new_tokens, args.repeats, None)
    cfg = engine.cfg
    result = {
        "args": {
            "workload": args.workload,
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
        },
        "engine_shape": f"{cfg.eagle3_topk}:{cfg.eagle3_k}:{cfg.eagle3_tree_tokens}:{cfg.eagle3_tree_min_score}",
        "machine": machine(),
        "command": command("bench.trees", argv),
        "rows": [{"method": r["method"], **{k: r.get(k) for k in KEYS}} for r in rows],
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
