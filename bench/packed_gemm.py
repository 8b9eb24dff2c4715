"""Packed fp16-weight GEMMs on or off (``--packed-gemm``), side by side in one process.

Two engines on the same bundled models, one with FBGEMM's fp16-weight GEMMs (fused q|k|v and
gate|up) and one with plain fp32 ``nn.Linear``. Per prompt, each method runs on both engines
(the order alternates), and the report gives median tokens/s, the on/off ratio and how often
the greedy outputs agree exactly (the two paths differ only in summation order).

    python -m bench.packed_gemm --workload humaneval --limit 10 --out bench/results/packed_gemm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from bench.harness import workload_args
from bench.workloads import load


def run(engine, ids: list[int], n: int, method: str) -> tuple[float, list[int]]:
    from services.router.engine import GenerationRequest

    engine.verifier.clear_prefix_cache()  # every run prefills cold
    out = engine.generate(GenerationRequest(ids, n, method=method)).result()
    return len(out["token_ids"]) / out["stats"]["wall_s"], out["token_ids"]


def main() -> None:
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "humaneval", 10, 128)
    ap.add_argument("--methods", default="vanilla,sd")
    args = ap.parse_args()
    base = EngineConfig(threads=args.threads, eagle3=None, predictor=None)
    engines = {"on": Engine(replace(base, packed_gemm=True)), "off": Engine(replace(base, packed_gemm=False))}
    prompts = load(args.workload, args.limit)
    methods = args.methods.split(",")
    speed = {(m, e): [] for m in methods for e in engines}
    same = {m: 0 for m in methods}
    for i, p in enumerate(prompts):
        ids = engines["on"].encode(p.text)
        for m in methods:
            order = ["on", "off"] if i % 2 == 0 else ["off", "on"]
            outs = {}
            for e in order:
                if i == 0:  # warm-up
                    run(engines[e], ids, 8, m)
                tps, outs[e] = run(engines[e], ids, args.max_new_tokens, m)
                speed[m, e].append(tps)
            same[m] += outs["on"] == outs["off"]
        print(f"[packed-gemm] {i + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    rows = [
        {
            "method": m,
            "tokens_per_s_on": round(statistics.median(speed[m, "on"]), 1),
            "tokens_per_s_off": round(statistics.median(speed[m, "off"]), 1),
            "on_vs_off": round(statistics.median(a / b for a, b in zip(speed[m, "on"], speed[m, "off"])), 3),
            "identical_outputs": round(same[m] / len(prompts), 3),
        }
        for m in methods
    ]
    command = "python -m bench.packed_gemm " + " ".join(sys.argv[1:])
    lines = [
        f"### Packed fp16-weight GEMMs on vs off — {args.workload}, {len(prompts)} prompts, "
        f"{args.max_new_tokens} new tokens, {args.threads} thread(s)",
        "",
        "| method | tok/s on | tok/s off | on / off (median per prompt) | identical greedy outputs |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['tokens_per_s_on']} | {r['tokens_per_s_off']} | {r['on_vs_off']} | "
        f"{r['identical_outputs']:.0%} |"
        for r in rows
    ]
    text = "\n".join(lines + ["", f"Command: `{command}`", ""])
    print(text)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": command,
                    "workload": args.workload,
                    "limit": len(prompts),
                    "max_new_tokens": args.max_new_tokens,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
