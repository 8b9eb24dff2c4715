"""FR-Spec for the draft LM: `sd` with its LM head over the N most frequent tokens, side by
side with the whole vocabulary, in one process on the same prompts, interleaved.

Every setting is lossless (greedy `sd` equals `vanilla`); what changes is the draft's cost
per token and, where a drafted token would have been a rarer one, acceptance.

    python -m bench.draft_vocab --workload humaneval --sizes 0,4096,2048 --out bench/results/draft_vocab_humaneval.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.harness import pyplot, run_ours, save, workload_args, write_figure
from bench.workloads import load


def measure(engines: dict[int, object], prompts: list[list[int]], max_new: int) -> list[dict]:
    runs: dict[int, list] = {n: [] for n in engines}
    sizes = list(engines)
    for i, ids in enumerate(prompts):
        for n in sizes if i % 2 == 0 else sizes[::-1]:
            runs[n].append(run_ours(engines[n], "sd", ids, max_new))
        print(f"[draft-vocab] {i + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    base = runs[sizes[0]]
    rows = []
    for n, rs in runs.items():
        cycles = sum(r.stats["cycles"] for r in rs)
        gen = sum(r.stats["generated_tokens"] for r in rs)
        rows.append(
            {
                "draft_vocab": n or "all",
                "tokens_per_s": round(statistics.median(len(r.ids) / r.wall for r in rs), 2),
                "speed_vs_first": round(statistics.median(b.wall / r.wall for b, r in zip(base, rs)), 3),
                "tau": round(gen / cycles, 3),
                "draft_ms_per_cycle": round(1e3 * sum(r.stats["draft_s"] for r in rs) / cycles, 3),
                "verify_ms_per_cycle": round(1e3 * sum(r.stats["verify_s"] for r in rs) / cycles, 3),
                "same_output_as_first": sum(b.ids == r.ids for b, r in zip(base, rs)) / len(rs),
            }
        )
    return rows


def markdown(result: dict) -> str:
    cols = [
        "draft_vocab",
        "tokens_per_s",
        "speed_vs_first",
        "tau",
        "draft_ms_per_cycle",
        "verify_ms_per_cycle",
        "same_output_as_first",
    ]
    lines = [
        f"### FR-Spec draft vocabulary for `sd` — {result['workload']}, {result['limit']} prompts, "
        f"{result['max_new_tokens']} new tokens",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in result["rows"]]
    return "\n".join(lines + ["", f"Command: `{result['command']}`", ""])


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    rows = result["rows"]
    names = [str(r["draft_vocab"]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, key, title in zip(
        axes,
        ("speed_vs_first", "draft_ms_per_cycle", "tau"),
        ("speed vs whole vocabulary", "draft ms / cycle", "τ (tokens / cycle)"),
    ):
        ax.bar(names, [r[key] for r in rows], color="#4c72b0")
        ax.set_title(title)
        ax.set_xlabel("draft vocabulary")
    fig.suptitle(f"FR-Spec `sd` — {result['workload']}")
    write_figure(fig, path)


def main() -> None:
    from services.common.config import EngineConfig
    from services.common.runtime import freeze_startup_heap
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "humaneval", 20, 128)
    ap.add_argument("--sizes", default="0,4096,2048", help="draft vocabulary sizes; 0 = the whole vocabulary")
    args = ap.parse_args()
    engines = {int(n): Engine(EngineConfig(threads=args.threads, draft_vocab=int(n))) for n in args.sizes.split(",")}
    freeze_startup_heap()  # as `make bench` and a serving process do: no full collections of the start-up heap
    first = next(iter(engines.values()))
    prompts = [first.encode_fit(p.text, args.max_new_tokens) for p in load(args.workload, args.limit)]
    for eng in engines.values():  # warm-up
        run_ours(eng, "sd", prompts[0], 16)
    result = {
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "command": "python -m bench.draft_vocab " + " ".join(sys.argv[1:]),
        "rows": measure(engines, prompts, args.max_new_tokens),
    }
    print(markdown(result))
    if args.out:
        save(args.out, result, markdown, plot)


if __name__ == "__main__":
    main()
