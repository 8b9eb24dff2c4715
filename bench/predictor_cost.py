"""Per-call cost of the yield predictor: in-process MLP vs the PredictYield gRPC service, and
the router's real per-cycle pattern: featurize + predict right after a target forward (cold
CPU caches), against the same calls in a warm loop.

    python -m bench.predictor_cost --predictor models/predictor --out bench/results/predictor_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from services.common.config import models_dir
from services.predictor.client import RemotePredictor
from services.predictor.features import FEATURES
from services.predictor.grpc_server import build_predictor_server
from services.predictor.mlp import YieldMLP


def per_call_us(fn, x, n: int) -> float:
    fn(x)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(times), 1)


def per_cycle_us(mlp: YieldMLP, target: Path, n: int) -> dict:
    """Median µs of featurize and predict on one draft, warm (back to back) and cold (each
    right after a 3-token target forward, as the router calls them once per cycle)."""
    import torch
    from transformers import AutoTokenizer

    from services.common.llama import Llama
    from services.common.packed_linear import pack_linears
    from services.common.types import Draft
    from services.predictor.features import TokenFlags, YieldTracker, featurize

    torch.set_num_threads(1)
    model = Llama.from_pretrained(target)
    pack_linears(model)  # as the engine serves it
    flags, tracker = TokenFlags(AutoTokenizer.from_pretrained(str(target))), YieldTracker(200, 128)
    draft = Draft(token_ids=[11, 12, 13, 14], source="suffix", token_probs=[0.6, 0.5, 0.4, 0.3])
    phi = featurize(draft, tracker, flags, 16)
    calls = {"featurize": lambda: featurize(draft, tracker, flags, 16), "predict": lambda: mlp.predict(phi)}
    cache, feed = model.new_cache(1), torch.tensor([[5, 6, 7]])
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, model.s.vocab, (1, 200)), 0, cache)
        for name, fn in calls.items():
            warm = per_call_us(lambda _, fn=fn: fn(), None, n)
            cold = []
            for _ in range(n):
                model(feed, 200, cache)
                t0 = time.perf_counter()
                fn()
                cold.append(time.perf_counter() - t0)
            out[name] = {"warm": warm, "after_target_forward": round(1e6 * statistics.median(cold), 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--predictor", type=Path, default=models_dir() / "predictor")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--target", type=Path, default=models_dir() / "target")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    mlp = YieldMLP.load(args.predictor) if (args.predictor / "config.json").exists() else YieldMLP()
    server, port = build_predictor_server(mlp, "127.0.0.1", 0)
    server.start()
    remote = RemotePredictor(f"127.0.0.1:{port}")
    rng = np.random.default_rng(0)
    rows = {}
    for batch in (1, 16, 64):
        x = rng.normal(size=(batch, len(FEATURES))).astype(np.float32)
        rows[str(batch)] = {
            "in_process_us": per_call_us(mlp.predict, x, args.calls),
            "grpc_us": per_call_us(remote.predict, x, args.calls),
        }
        rows[str(batch)]["grpc_us_per_item"] = round(rows[str(batch)]["grpc_us"] / batch, 2)
    server.stop(0)
    result = {
        "command": "python -m bench.predictor_cost " + " ".join(sys.argv[1:]),
        "trained_model": (args.predictor / "config.json").exists(),
        "batch": rows,
        "per_cycle_us": per_cycle_us(mlp, args.target, args.calls),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
