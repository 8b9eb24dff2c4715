"""Suffix-drafter micro-benchmark over replayed real traces (depth 64), and prompt indexing
against the target's prefill.

Reports µs per speculate call, per speculated token, per update token and per indexed
prompt token, their ratio to ArcticInference's C++ tree measured on this machine over stdlib
traces (37 µs / call, 2.75 µs / update token, 1.9 µs / indexed prompt token), the share of
a `suffix` cycle they take, and indexing time of a 2,000-token prompt vs the target's
prefill (scaled from the longest prefill the context allows).

    python -m bench.suffix_micro --traces build/traces/edit-heldout.jsonl --out bench/results/suffix_micro.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from services.common.config import SuffixConfig, models_dir
from services.common.llama import Llama
from services.common.runtime import tune_gc
from services.drafter.replay import load_traces, replay
from services.drafter.suffix import SuffixDrafter
from services.drafter.suffix_tree import SuffixTree

CPP = {"us_per_speculate_call": 37.0, "us_per_update_token": 2.75, "us_per_indexed_prompt_token": 1.9}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=None, help="target traces (specmesh trace)")
    ap.add_argument(
        "--heldout-text",
        type=int,
        default=0,
        help="instead: N traces cut from held-out stdlib files (600-token prompt, 300-token text)",
    )
    ap.add_argument("--target", type=Path, default=models_dir() / "target")
    ap.add_argument("--cycle-ms", type=float, default=None, help="a measured `suffix` cycle (default: 1-token step)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tune_gc()  # as every specmesh process does
    traces = load_traces(args.traces) if args.traces else heldout_text_traces(args.heldout_text)
    rep = replay(SuffixDrafter(SuffixConfig()), traces, 16).report()
    # indexing a 2,000-token prompt (a trace prompt repeated to length)
    prompt = [t for tr in traces for t in tr.prompt_ids][:2000]
    t0 = time.perf_counter()
    SuffixTree(64).extend([], prompt)
    index_ms = 1000 * (time.perf_counter() - t0)
    model = Llama.from_pretrained(args.target)
    n = min(1000, model.s.max_positions)
    prefill_2k_ms = prefill_ms(model, n) * 2000 / n  # linear scaling is conservative (attention grows faster)
    cycle_ms = args.cycle_ms or prefill_ms(model, 17)  # a 16-token draft + 1 verified in one forward
    per_cycle_us = rep["us_per_speculate_call"] + rep["us_per_update_token"] * rep["tau"]
    result = {
        "command": "python -m bench.suffix_micro " + " ".join(sys.argv[1:]),
        "traces": str(args.traces) if args.traces else f"{len(traces)} held-out stdlib texts",
        "replay": rep,
        "vs_cpp": {k: round(rep[k] / v, 2) for k, v in CPP.items()},
        "speculate_plus_update_share_of_cycle": round(per_cycle_us / (1000 * cycle_ms), 4),
        "index_2000_tokens_ms": round(index_ms, 2),
        "target_prefill_2000_tokens_ms_est": round(prefill_2k_ms, 2),
        "index_share_of_prefill": round(index_ms / prefill_2k_ms, 4),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
