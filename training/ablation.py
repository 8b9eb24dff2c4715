"""EAGLE-3 ablations on held-out traces: training-time test (TTT steps) and training-data size.

Every head is scored the same way, at the same chain positions whatever it was trained with:
per-position agreement with the target's greedy token (teacher-forced) and greedy chain
acceptance (positions 1..j all agree), whose sum is the mean accepted length of a k-token
chain. A head trained without TTT (1 step) never saw its own hidden states as input, so
its later positions show what TTT buys.

    python -m training.ablation --heads models/eagle3,build/models/eagle3-ttt1 \
        --heldout build/traces/stdlib-heldout.jsonl,build/traces/edit-heldout.jsonl \
        --out bench/results/eagle3_ablation.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from services.common.llama import Llama
from services.drafter.eagle3 import Eagle3Head
from training.cards import stages
from training.eagle3 import chain_agreement
from training.sequences import build_sequences


def score_head(head_dir: Path, target: Llama, seqs: list[list[int]], positions: int) -> dict:
    state = json.loads((head_dir / "training_state.json").read_text())
    head = Eagle3Head.from_pretrained(head_dir, target.embed_tokens.weight, torch.float32, "cpu").eval()
    agree, chain = chain_agreement(head, target, seqs, positions)
    runs = stages(state)  # a continued head (--init): every stage's data counts
    return {
        "head": str(head_dir),
        "ttt_steps": state["ttt_steps"],
        "train_tokens": sum(st["tokens"] for st in runs),
        "stage_tokens": [st["tokens"] for st in runs],
        "trace_fraction": state.get("trace_fraction", 1.0),
        "epochs": state["epochs"],
        "steps": state["step"],
        "draft_vocab": head.draft_vocab,
        "corpus_tokens": sum(st.get("corpus_tokens", 0) for st in runs),
        "agreement_per_position": agree,
        "chain_acceptance_per_position": chain,
        "mean_accepted_length": round(sum(chain), 4),
    }


def table(rows: list[dict], heldout: str, n_seqs: int, command: str) -> str:
    k = len(rows[0]["agreement_per_position"])
    head = " | ".join(f"pos {j + 1}" for j in range(k))
    lines = [
        f"### EAGLE-3 ablation — {n_seqs} held-out traces ({heldout})",
        "",
        "Agreement per chain position (teacher-forced); in brackets, greedy chain acceptance.",
        "",
        f"| head | TTT steps | draft vocabulary | train tokens (of them pretraining text) | {head} | "
        f"mean accepted ({k}-token chain) |",
        "|---|---|---|---|" + "---|" * k + "---|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{a:.1%} ({c:.1%})" for a, c in zip(r["agreement_per_position"], r["chain_acceptance_per_position"])
        )
        corpus, vocab = r.get("corpus_tokens", 0), r.get("draft_vocab")
        tokens = " + ".join(f"{t:,}" for t in r.get("stage_tokens", [r["train_tokens"]]))
        lines.append(
            f"| `{r['head']}` | {r['ttt_steps']} | {'—' if vocab is None else f'{vocab:,}'} | {tokens}"
            f"{f' ({corpus:,})' if corpus else ''} | {cells} | "
            f"{r['mean_accepted_length']:.2f} |"
        )
    return "\n".join(lines + ["", f"Command: `{command}`", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", required=True, help="comma-separated EAGLE-3 head directories")
    ap.add_argument("--target", type=Path, default=Path("models/target"))
    ap.add_argument("--heldout", required=True, help="comma-separated held-out trace files")
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Llama.from_pretrained(args.target).eval()
    seqs = build_sequences([Path(p) for p in args.heldout.split(",")], target.s.max_positions)
    heads = [Path(h) for h in args.heads.split(",")]
    rows, t0 = [], time.time()
    for i, h in enumerate(heads):
        rows.append(score_head(h, target, seqs, args.positions))
        el = time.time() - t0
        print(
            f"[ablation] {i + 1}/{len(heads)} heads scored, {el:.0f}s, eta {el / (i + 1) * (len(heads) - i - 1):.0f}s",
            file=sys.stderr,
            flush=True,
        )
    command = "python -m training.ablation " + " ".join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"command": command, "heldout": args.heldout, "heldout_sequences": len(seqs), "rows": rows}, indent=1
        )
    )
    args.out.with_suffix(".md").write_text(table(rows, args.heldout, len(seqs), command))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
