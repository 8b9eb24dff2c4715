"""Suffix trees side by side over the same replayed traces (depth 64), in one run: our Python
reference, our compiled tree (with and without live outputs in the global tree), and
ArcticInference's C++ tree built from its sdist (bench/arctic.py; left out, with the reason
printed, when it cannot be built).

Each round replays every trace through a fresh drafter of each kind, in an order rotated per
round; the timings are medians over rounds. Reported per kind: τ, µs per speculate call, per
update token (with and without ending the request), per indexed prompt token, the ratio of
each to Arctic's, the share of a `suffix` cycle speculation plus update take, and indexing a
2,000-token prompt against the target's prefill (scaled from the longest prefill the context
allows).

    python -m bench.suffix_micro --traces build/traces/edit-heldout.jsonl --out bench/results/suffix_micro.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import arctic
from bench.harness import report
from services.common.config import SuffixConfig, models_dir
from services.common.llama import Llama
from services.common.runtime import tune_gc
from services.drafter.replay import load_traces, replay
from services.drafter.suffix import SuffixDrafter

# kind -> (what it is, SuffixConfig overrides); "arctic" is added when it builds
KINDS = {
    "python": ("our Python tree (the reference), outputs enter the global tree when finished",
               {"compiled": False, "live_outputs": False}),
    "compiled-finished": ("our compiled tree, outputs enter the global tree when finished", {"live_outputs": False}),
    "compiled": ("our compiled tree, live outputs in the global tree (the default)", {}),
}  # fmt: skip
TIMINGS = (
    "us_per_speculate_call",
    "us_per_update_token",
    "us_per_update_token_with_stop",
    "us_per_indexed_prompt_token",
)


@torch.inference_mode()
def prefill_ms(model: Llama, n: int, repeats: int = 3) -> float:
    ids = torch.randint(0, model.s.vocab, (1, n))
    best = float("inf")
    for _ in range(repeats):
        cache = model.new_cache(capacity=n)
        t0 = time.perf_counter()
        model(ids, 0, cache)
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def heldout_text_traces(n: int):
    """Replay traces from real held-out source text (no target needed): deterministic."""
    from transformers import AutoTokenizer

    from services.drafter.replay import Trace
    from training.corpus import read_source, source_files

    tok = AutoTokenizer.from_pretrained(str(models_dir() / "tokenizer"))
    out = []
    for p in source_files("heldout"):
        ids = tok(read_source(p) or "", add_special_tokens=False)["input_ids"]
        if len(ids) > 900:
            out.append(Trace(p.name, ids[:600], ids[600:900], 300))
        if len(out) == n:
            break
    return out


def drafters(arctic_cls, tree: bool) -> dict:
    """kind -> a function making a fresh drafter of that kind."""
    made = {
        kind: (lambda over=over: SuffixDrafter(SuffixConfig(tree=tree, **over))) for kind, (_, over) in KINDS.items()
    }
    if arctic_cls is not None:
        spec = SuffixConfig().spec
        made["arctic"] = lambda: arctic.ArcticDrafter(arctic_cls, 64, 1000, spec, tree)
    return made


def index_ms(make, prompt: list[int]) -> float:
    d = make()
    t0 = time.perf_counter()
    d.start("index", prompt)
    return 1000 * (time.perf_counter() - t0)


def measure(makers: dict, traces, prompt_2k: list[int], rounds: int) -> dict:
    """Interleaved rounds: kind -> replay report with median timings."""
    runs: dict[str, list[dict]] = {k: [] for k in makers}
    kinds = list(makers)
    for r in range(rounds):
        t0 = time.perf_counter()
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            rep = replay(makers[kind](), traces, 16).report()
            rep["index_2000_tokens_ms"] = index_ms(makers[kind], prompt_2k)
            runs[kind].append(rep)
        took = time.perf_counter() - t0
        print(f"[suffix_micro] round {r + 1}/{rounds}: {took:.1f}s, eta {took * (rounds - r - 1):.0f}s", flush=True)
    out = {}
    for kind, reps in runs.items():
        assert len({rep["tau"] for rep in reps}) == 1, f"{kind}: τ differs between rounds"
        row = dict(reps[0])
        for key in (*TIMINGS, "index_2000_tokens_ms"):
            row[key] = round(statistics.median(rep[key] for rep in reps), 3)
        out[kind] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=None, help="target traces (specmesh trace)")
    ap.add_argument(
        "--heldout-text",
        type=int,
        default=0,
        help="instead: N traces cut from held-out stdlib files (600-token prompt, 300-token text)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tree", action="store_true", help="speculation trees instead of paths")
    ap.add_argument("--no-arctic", action="store_true", help="leave ArcticInference out")
    ap.add_argument("--target", type=Path, default=models_dir() / "target")
    ap.add_argument("--cycle-ms", type=float, default=None, help="a measured `suffix` cycle (default: 17-token step)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tune_gc()  # as every specmesh process does
    traces = load_traces(args.traces) if args.traces else heldout_text_traces(args.heldout_text)
    arctic_cls = None if args.no_arctic else arctic.load()
    prompt_2k = [t for tr in traces for t in tr.prompt_ids][:2000]  # trace prompts joined to length
    kinds = measure(drafters(arctic_cls, args.tree), traces, prompt_2k, args.rounds)
    model = Llama.from_pretrained(args.target)
    n = min(1000, model.s.max_positions)
    prefill_2k_ms = prefill_ms(model, n) * 2000 / n  # linear scaling is conservative (attention grows faster)
    cycle_ms = args.cycle_ms or prefill_ms(model, 17)  # a 16-token draft + 1 verified in one forward
    for row in kinds.values():
        per_cycle_us = row["us_per_speculate_call"] + row["us_per_update_token"] * row["tau"]
        row["speculate_plus_update_share_of_cycle"] = round(per_cycle_us / (1000 * cycle_ms), 4)
        row["index_share_of_prefill"] = round(row["index_2000_tokens_ms"] / prefill_2k_ms, 4)
        if "arctic" in kinds:
            ref = kinds["arctic"]
            row["vs_arctic"] = {k: round(row[k] / ref[k], 3) for k in (*TIMINGS, "index_2000_tokens_ms")}
            row["vs_arctic"]["tau"] = round(row["tau"] / ref["tau"], 4)
    result = {
        "command": "python -m bench.suffix_micro " + " ".join(sys.argv[1:]),
        "traces": str(args.traces) if args.traces else f"{len(traces)} held-out stdlib texts",
        "rounds": args.rounds,
        "tree": args.tree,
        "kinds": {k: KINDS[k][0] for k in KINDS} | ({"arctic": f"arctic-inference {arctic.VERSION}'s C++ tree, "
                                                      "built from its sdist"} if arctic_cls else {}),
        "arctic": "measured" if arctic_cls else "left out: " + ("--no-arctic" if args.no_arctic else "not built"),
        "cycle_ms": round(cycle_ms, 3),
        "target_prefill_2000_tokens_ms_est": round(prefill_2k_ms, 2),
        "replay": kinds,
    }  # fmt: skip
    report(result, args.out, markdown, plot)


def markdown(result: dict) -> str:
    rows = result["replay"]
    lines = [
        "# Suffix trees side by side",
        "",
        f"Command: `{result['command']}`. Traces: {result['traces']}; {'trees' if result['tree'] else 'paths'}; "
        f"medians of {result['rounds']} interleaved rounds. Arctic: {result['arctic']}.",
        "",
        "| kind | τ | µs / speculate | µs / update token | with stop | µs / indexed token | "
        "2k-token index ms | share of cycle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in rows.items():
        lines.append(
            f"| {kind} | {r['tau']:.4f} | {r['us_per_speculate_call']:.2f} | {r['us_per_update_token']:.2f} | "
            f"{r['us_per_update_token_with_stop']:.2f} | {r['us_per_indexed_prompt_token']:.2f} | "
            f"{r['index_2000_tokens_ms']:.2f} | {r['speculate_plus_update_share_of_cycle']:.2%} |"
        )
    if "arctic" in rows:
        lines += ["", "Ratio to Arctic (below 1: faster; τ above 1: more tokens per cycle):", "",
                  "| kind | speculate | update | update with stop | index | τ |", "|---|---|---|---|---|---|"]  # fmt: skip
        for kind, r in rows.items():
            v = r["vs_arctic"]
            lines.append(
                f"| {kind} | {v['us_per_speculate_call']:.2f} | {v['us_per_update_token']:.2f} | "
                f"{v['us_per_update_token_with_stop']:.2f} | {v['index_2000_tokens_ms']:.2f} | {v['tau']:.4f} |"
            )
    lines += ["", "Kinds:", ""] + [f"- `{k}`: {what}" for k, what in result["kinds"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["replay"]
    labels = ["speculate call", "update token", "update token\n(with stop)", "indexed token"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(rows)
    for i, (kind, r) in enumerate(rows.items()):
        xs = [j + i * width for j in range(len(TIMINGS))]
        ax.bar(xs, [r[k] for k in TIMINGS], width, label=f"{kind} (τ {r['tau']:.3f})")
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(TIMINGS))], labels)
    ax.set_ylabel("µs (median of rounds)")
    ax.set_title(f"Suffix trees on {result['traces']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
