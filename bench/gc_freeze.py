"""Start-up heap frozen (``gc.freeze``) or not, side by side in one process.

Serving processes freeze what start-up leaves alive (``services.common.runtime.freeze_startup_heap``)
so full collections stop walking torch's, transformers' and gRPC's objects inside decoding
cycles. Per prompt, each method runs once with the start-up heap frozen and once with it
unfrozen (``gc.unfreeze``; the order alternates), under the serving GC thresholds. The report
gives median tokens/s, the frozen/unfrozen ratio, the collector's mean pause time per 1,000
tokens (``gc.callbacks``) and the collections per generation over the whole run.

    python -m bench.gc_freeze --workload edit --limit 10 --max-new-tokens 256 --out bench/results/gc_freeze.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from bench.harness import past_outputs, workload_args
from bench.workloads import load


class PauseClock:
    """Total seconds spent in cyclic-GC collections, per generation."""

    def __init__(self):
        self.total = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t0 = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total[info["generation"]] += time.perf_counter() - self._t0
            self.count[info["generation"]] += 1

    def seconds(self) -> float:
        return sum(self.total)


def set_frozen(frozen: bool) -> None:
    """No collection here: the collector's counters run on as they would while serving."""
    gc.unfreeze()
    if frozen:
        gc.freeze()


def full_collection_ms(frozen: bool, repeats: int = 5) -> float:
    """Median pause of one full (generation-2) collection of this process's heap."""
    set_frozen(frozen)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def run(engine, ids: list[int], n: int, method: str, clock: PauseClock) -> tuple[float, float, list[int]]:
    """(tokens/s, GC ms per 1,000 tokens, token ids)."""
    from services.router.engine import GenerationRequest

    engine.verifier.clear_prefix_cache()  # every run prefills cold
    before = clock.seconds()
    out = engine.generate(GenerationRequest(ids, n, method=method)).result()
    k = max(1, len(out["token_ids"]))
    return k / out["stats"]["wall_s"], 1e6 * (clock.seconds() - before) / k, out["token_ids"]


def measure(engine, prompts, methods, n: int, clock: PauseClock) -> dict:
    speed = {(m, f): [] for m in methods for f in (True, False)}
    pauses = {(m, f): [] for m in methods for f in (True, False)}
    t0 = time.time()
    for i, p in enumerate(prompts):
        ids = engine.encode_fit(p.text, n)
        with past_outputs(engine):
            for frozen in (True, False) if i % 2 == 0 else (False, True):
                set_frozen(frozen)
                for m in methods:
                    tps, ms, _ = run(engine, ids, n, m, clock)
                    speed[m, frozen].append(tps)
                    pauses[m, frozen].append(ms)
        rate = (time.time() - t0) / (i + 1)
        print(
            f"[gc-freeze] {i + 1}/{len(prompts)} prompts {rate:.1f} s/prompt eta {rate * (len(prompts) - i - 1):.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return {"speed": speed, "pauses": pauses}


def main() -> None:
    from services.common.config import EngineConfig
    from services.common.runtime import tune_gc
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "edit", 10, 256)
    ap.add_argument("--methods", default="vanilla,sd,suffix,hybrid,hybrid-csd")
    args = ap.parse_args()
    tune_gc()
    engine = Engine(EngineConfig(threads=args.threads))
    methods = args.methods.split(",")
    prompts = load(args.workload, args.limit)
    clock = PauseClock()
    with past_outputs(engine, keep=False):  # warm-up
        for m in methods:
            run(engine, engine.encode_fit(prompts[0].text, 16), 16, m, clock)
    r = measure(engine, prompts, methods, args.max_new_tokens, clock)
    collections = list(clock.count)
    pause = {f: round(full_collection_ms(f), 1) for f in (True, False)}
    med = statistics.median
    rows = [
        {
            "method": m,
            "tokens_per_s_frozen": round(med(r["speed"][m, True]), 1),
            "tokens_per_s_unfrozen": round(med(r["speed"][m, False]), 1),
            "frozen_vs_unfrozen": round(med(a / b for a, b in zip(r["speed"][m, True], r["speed"][m, False])), 3),
            "gc_ms_per_1k_frozen": round(statistics.mean(r["pauses"][m, True]), 2),
            "gc_ms_per_1k_unfrozen": round(statistics.mean(r["pauses"][m, False]), 2),
        }
        for m in methods
    ]
    report(args, rows, len(prompts), pause, collections)


def report(args, rows: list[dict], n_prompts: int, pause: dict, gens: list[int]) -> None:
    command = "python -m bench.gc_freeze " + " ".join(sys.argv[1:])
    lines = [
        f"### Start-up heap frozen vs unfrozen — {args.workload}, {n_prompts} prompts, "
        f"{args.max_new_tokens} new tokens, {args.threads} thread(s)",
        "",
        "| method | tok/s frozen | tok/s unfrozen | frozen / unfrozen (median per prompt) | "
        "GC ms per 1k tokens frozen (mean) | unfrozen (mean) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['tokens_per_s_frozen']} | {r['tokens_per_s_unfrozen']} | {r['frozen_vs_unfrozen']} | "
        f"{r['gc_ms_per_1k_frozen']} | {r['gc_ms_per_1k_unfrozen']} |"
        for r in rows
    ]
    text = "\n".join(
        lines
        + [
            "",
            f"Collections in the run, generations 0/1/2: {gens[0]}/{gens[1]}/{gens[2]}. "
            f"One full collection of this process after the run: {pause[True]} ms frozen, "
            f"{pause[False]} ms unfrozen.",
            "",
            f"Command: `{command}`",
            "",
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": command,
                    "workload": args.workload,
                    "limit": n_prompts,
                    "max_new_tokens": args.max_new_tokens,
                    "full_collection_ms": {"frozen": pause[True], "unfrozen": pause[False]},
                    "collections_per_generation": gens,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
