"""Sweep EAGLE-3 chain length k, for one or more heads, against `sd` on a workload.

Each setting runs `vanilla` and `eagle3` on the same prompts (greedy); `sd` runs once as the
reference where the engine has a draft LM. The engine's flags are ``specmesh serve``'s
(``--models-dir``, ``--target``, ...); ``--chat`` gives each prompt through the chat template
as ``python -m bench`` does. A head trained without training-time test agrees more at chain position 1 and
far less after it (`bench/results/eagle3_ablation.md`), so the best k depends on the head:
the sweep picks the head and k together.

    python -m bench.eagle3_sweep --workload humaneval --heads models/eagle3,build/models/eagle3-ttt1 \
        --ks 1,2,3,4 --out bench/results/eagle3_sweep.json
    python -m bench.eagle3_sweep --models-dir models/smollm2 --target build/models/smollm2 --chat \
        --ks 4 --confidences 0.2,0.35,0.5 --out bench/results/smollm2/eagle3_confidence.json

``--methods eagle3,hybrid`` runs the hybrid (or any method that drafts with the head) beside
`eagle3` at each setting, each setting from an empty suffix cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.harness import benchmark, pyplot, report, table_markdown, workload_args, write_figure
from bench.workloads import load

KEYS = (
    "tokens_per_s",
    "speedup_vs_vanilla",
    "tau",
    "cycles_per_1k",
    "acceptance_per_position",
    "exact_match_vs_vanilla",
    "draft_ms_per_cycle",
    "verify_ms_per_cycle",
)


def use_head(engine, head_dir: Path, k: int, confidence: float | None = None) -> None:
    """Serve ``head_dir`` as the engine's `eagle3` drafter with chains of at most ``k`` that
    stop after a token whose max q is below ``confidence`` (default: the engine's)."""
    from services.common.packed_linear import pack_linears
    from services.drafter.eagle3 import Eagle3Head
    from services.drafter.eagle3_drafter import Eagle3Drafter

    core, cfg = engine.verifier, engine.cfg
    head = Eagle3Head.from_pretrained(head_dir, core.runner.model.embed_tokens.weight)
    if cfg.packed_gemm:
        pack_linears(head)
    core.runner.capture_layers = head.aux_layers
    core.drafters["eagle3"] = Eagle3Drafter(head, cfg.eagle3_confidence if confidence is None else confidence)
    core.max_draft["eagle3"] = engine.max_draft["eagle3"] = k


def sweep(
    engine,
    prompts,
    max_new: int,
    heads: list[Path],
    ks: list[int],
    confidences: list[float] | None = None,
    methods: tuple[str, ...] = ("eagle3",),
) -> list[dict]:
    """Each (head, k, confidence) runs vanilla and ``methods`` (those that use the head:
    eagle3, hybrid, eagle3-tree, hybrid-tree) on ``prompts``, interleaved, from an empty suffix
    cache (which would otherwise hold an earlier setting's outputs of the same prompts)."""
    rows = []
    if "draft-lm" in engine.verifier.drafters:  # the reference, where the engine has a draft LM
        for r in benchmark(engine, prompts, ["vanilla", "sd"], max_new, 1, None):
            if r["method"] == "sd":
                rows.append(
                    {"method": "sd", "head": None, "k": engine.max_draft["draft-lm"], **{x: r[x] for x in KEYS}}
                )
    todo = [(h, k, c) for h in heads for k in ks for c in confidences or [engine.cfg.eagle3_confidence]]
    cache = getattr(engine, "suffix_cache", None)
    for i, (h, k, c) in enumerate(todo):
        use_head(engine, h, k, c)
        if cache is not None:  # each setting's hybrid starts as the first did: no earlier setting's answers
            cache.clear()
        for r in benchmark(engine, prompts, ["vanilla", *methods], max_new, 1, None):
            if r["method"] in methods:
                rows.append({"method": r["method"], "head": str(h), "k": k, "confidence": c, **{x: r[x] for x in KEYS}})
        print(f"[eagle3-sweep] {i + 1}/{len(todo)} settings", file=sys.stderr, flush=True)
    return rows


def markdown(result: dict) -> str:
    return table_markdown(
        f"### EAGLE-3 chain-length sweep — {result['workload']}, {result['limit']} prompts, "
        f"{result['max_new_tokens']} new tokens",
        [
            "method",
            "head",
            "k",
            "confidence",
            "tok/s",
            "speedup",
            "τ",
            "cycles / 1k",
            "draft ms / cycle",
            "accepted at position 1.. (per cycle)",
        ],
        [
            [
                r["method"],
                r["head"] or "—",
                r["k"],
                r.get("confidence", "—"),
                r["tokens_per_s"],
                r["speedup_vs_vanilla"],
                r["tau"],
                r["cycles_per_1k"],
                r.get("draft_ms_per_cycle", "—"),
                ", ".join(f"{a:.2f}" for a in (r["acceptance_per_position"] or [])),
            ]
            for r in result["rows"]
        ],
        result["command"],
    )


def plot(result: dict, path: Path) -> None:
    """Speedup and τ against chain length k, one line per head; `sd` as a dashed reference."""
    fig, axes = pyplot().subplots(1, 2, figsize=(9, 3.6))
    sd = next((r for r in result["rows"] if r["method"] == "sd"), None)
    for ax, key, label in (
        (axes[0], "speedup_vs_vanilla", "speedup over vanilla"),
        (axes[1], "tau", "τ (tokens / target forward)"),
    ):
        for m, head, c in dict.fromkeys(
            (r["method"], r["head"], r.get("confidence")) for r in result["rows"] if r["method"] != "sd"
        ):
            rows = [r for r in result["rows"] if (r["method"], r["head"], r.get("confidence")) == (m, head, c)]
            ax.plot(
                [r["k"] for r in rows],
                [r[key] for r in rows],
                marker="o",
                label=f"{m} {Path(head).name}" + ("" if c is None else f", confidence {c}"),
            )
        if sd is not None:
            ax.axhline(sd[key], color="grey", linestyle="--", label=f"sd (k={sd['k']})")
        ax.set_xlabel("chain length k")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"EAGLE-3 chain sweep — {result['workload']}")
    write_figure(fig, path)


def main() -> None:
    from services.cli import add_engine_args, engine_config
    from services.common.runtime import freeze_startup_heap
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    workload_args(ap, "humaneval", 20, 128, threads=False)  # --threads comes with the engine's flags
    ap.add_argument("--chat", action="store_true", help="give each prompt through the chat template")
    ap.add_argument("--heads", default=None, help="comma-separated EAGLE-3 head directories (default: the engine's)")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument(
        "--methods",
        default="eagle3",
        help="comma-separated methods run with each head (eagle3, hybrid, eagle3-tree, hybrid-tree)",
    )
    ap.add_argument(
        "--confidences", default=None, help="comma-separated chain-stop confidences (default: the engine's)"
    )
    args = ap.parse_args()
    engine = Engine(engine_config(args))
    freeze_startup_heap()  # as `make bench` and a serving process do: no full collections of the start-up heap
    if "eagle3" not in engine.verifier.drafters:
        sys.exit(f"error: the sweep needs an EAGLE-3 head; {engine.cfg.eagle3} holds none")
    prompts = load(args.workload, args.limit, engine.tokenizer if args.chat else None)
    rows = sweep(
        engine,
        prompts,
        args.max_new_tokens,
        [Path(h) for h in args.heads.split(",")] if args.heads else [Path(engine.cfg.eagle3)],
        [int(k) for k in args.ks.split(",")],
        [float(c) for c in args.confidences.split(",")] if args.confidences else None,
        tuple(args.methods.split(",")),
    )
    result = {
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "chat": args.chat,
        "command": "python -m bench.eagle3_sweep " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    report(result, args.out, markdown, plot)


if __name__ == "__main__":
    main()
