"""Rank the vocabulary by next-token frequency in the target's generations of training
prompts, and ship the ranking beside a drafter (``--draft-vocab N`` serves its N best).

    python -m training.vocab --traces build/traces/stdlib-train.jsonl,build/traces/edit-train.jsonl \
        --out models/draft
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.drafter.vocab import RANKING_FILE, coverage, frequency_ranking, save_ranking, top_vocabulary
from training.sequences import build_sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True, help="comma-separated trace files (training prompts only)")
    ap.add_argument("--out", type=Path, required=True, help="the drafter's model directory")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the drafter's config)")
    ap.add_argument("--heldout", default="", help="trace files to report coverage on")
    args = ap.parse_args()
    if args.vocab is None:
        from transformers import AutoConfig

        args.vocab = AutoConfig.from_pretrained(str(args.out)).vocab_size
    seqs = build_sequences([Path(p) for p in args.traces.split(",")], 1 << 30)
    ranking = frequency_ranking(seqs, args.vocab)
    save_ranking(args.out / RANKING_FILE, ranking, args.traces)
    held = build_sequences([Path(p) for p in args.heldout.split(",") if p], 1 << 30)
    for n in (1024, 2048, 4096):
        ids = top_vocabulary(ranking, n)
        line = f"[vocab] top {n}: {coverage(seqs, ids, args.vocab):.1%} of training tokens"
        print(line + (f", {coverage(held, ids, args.vocab):.1%} held-out" if held else ""), flush=True)
    print(f"[vocab] wrote {args.out / RANKING_FILE}", flush=True)


if __name__ == "__main__":
    main()
