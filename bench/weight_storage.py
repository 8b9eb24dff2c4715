"""The real target stored in fp32 (its Q4_1 values exact) against fp16 (rounded), side by side.

Both directories come from the same GGUF file (``python -m training.smollm2 --dtype``). Each is
loaded as the verifier loads a target (fp32 in memory, packed fp16-weight GEMMs where the values
are fp16-exact: all of the fp16 one, none of the fp32 one). Timed: a verification step of 1-8
tokens after a 256-token context, batch 1, interleaved rounds, medians. Compared: how often the
two give the same greedy token, teacher-forced on held-out traces.

    python -m bench.weight_storage --fp32 build/models/smollm2-fp32 --fp16 build/models/smollm2 \\
        --heldout build/traces/smollm2-stdlib-heldout.jsonl --out bench/results/smollm2/weight_storage.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import report
from services.common.llama import Llama
from services.common.packed_linear import pack_linears
from services.common.progress import Progress
from training.sequences import batches, build_sequences, pad

TOKENS = (1, 2, 3, 5, 8)


def step_ms(model: Llama, context: int, t: int, reps: int) -> float:
    """Median time of a t-token step after ``context`` tokens (the step's K/V dropped each time)."""
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(100, model.s.vocab, (1, context + t), generator=g)
    cache = model.new_cache(1, context + t)
    times = []
    with torch.inference_mode():
        model(ids[:, :context], 0, cache)
        for _ in range(reps):
            t0 = time.perf_counter()
            model(ids[:, context:], context, cache)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def agreement(a: Llama, b: Llama, heldout: Path, limit: int) -> tuple[float, int]:
    """Share of positions where the two argmaxes agree, teacher-forced on held-out sequences."""
    seqs = build_sequences([heldout], a.s.max_positions)[:limit]
    same = count = 0
    for batch in batches(seqs, 2048, seed=0):
        ids, lengths = pad(batch, pad_id=0)
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        eq = a.forward_train(ids).argmax(-1) == b.forward_train(ids).argmax(-1)
        same, count = same + int((eq & valid).sum()), count + int(valid.sum())
    return same / max(count, 1), count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32", type=Path, required=True)
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--sequences", type=int, default=20, help="held-out sequences for the agreement")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    models = {"fp32": Llama.from_pretrained(a.fp32), "fp16": Llama.from_pretrained(a.fp16)}
    packed = {name: pack_linears(model) for name, model in models.items()}  # as the verifier loads a target
    times: dict[str, dict[int, list[float]]] = {name: {t: [] for t in TOKENS} for name in models}
    bar = Progress(a.rounds, "weight_storage", "rounds")
    for r in range(a.rounds):  # interleaved, the order alternating
        for name in list(models)[:: 1 if r % 2 == 0 else -1]:
            for t in TOKENS:
                times[name][t].append(step_ms(models[name], a.context, t, a.reps))
        bar.advance()
    bar.close()
    same, positions = agreement(models["fp32"], models["fp16"], a.heldout, a.sequences)
    result = {
        "command": "python -m bench.weight_storage " + " ".join(sys.argv[1:]),
        "threads": a.threads,
        "context": a.context,
        "packed_linears": packed,
        "step_ms": {name: {str(t): statistics.median(v) for t, v in per.items()} for name, per in times.items()},
        "greedy_agreement": same,
        "positions": positions,
    }
    report(result, a.out, markdown, plot)
    return 0


def markdown(r: dict) -> str:
    ms = r["step_ms"]
    lines = [
        "# SmolLM2-135M-Instruct stored in fp32 or fp16: step cost and greedy agreement",
        "",
        f"Command: `{r['command']}`. Batch 1, {r['threads']} thread(s), a step after {r['context']} tokens, "
        f"medians of interleaved rounds. Packed fp16-weight linears: fp32 {r['packed_linears']['fp32']}, "
        f"fp16 {r['packed_linears']['fp16']}. The two give the same greedy token at "
        f"{100 * r['greedy_agreement']:.2f} % of {r['positions']:,} held-out positions (teacher-forced).",
        "",
        "| tokens in the step | fp32 ms | fp16 ms | fp16 / fp32 | fp32: / 1-token step | fp16: / 1-token step |",
        "|---|---|---|---|---|---|",
    ]
    for t in ms["fp32"]:
        a, b = ms["fp32"][t], ms["fp16"][t]
        lines.append(
            f"| {t} | {a:.1f} | {b:.1f} | {b / a:.2f} | {a / ms['fp32']['1']:.2f} | {b / ms['fp16']['1']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(r: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, per in r["step_ms"].items():
        ax.plot([int(t) for t in per], list(per.values()), marker="o", label=f"{name} weights")
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("ms (median)")
    ax.set_title("SmolLM2-135M-Instruct step, batch 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
