"""CSD's own cost per cycle: the gate (calibrated policy minus exact greedy on the same
verification) and the correction memory (record of the first rejection), as a share of the
`csd` cycle, with the in-process memory and with the Redis-backed one (write-behind).

Both engines run `csd` on the same prompts. Every cycle's policy call is timed, and so is
exact greedy on the same draft and logits (which of the two runs first alternates); memory
records are timed where the verifier makes them. The accepted lengths of both policies on
those same cycles show what rescues add inside a cycle, apart from where the text goes next.

    python -m bench.csd_overhead --workload humaneval --limit 10 --out bench/results/csd_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from bench.harness import workload_args
from bench.workloads import load
from services.verifier.policies import exact_greedy


class Timed:
    """Wraps the calibrated policy and the memory's ``record``; sums seconds per cycle."""

    def __init__(self, core):
        self.gate_s, self.exact_s, self.record_s = [], [], []
        self.accepted_csd, self.accepted_exact = [], []  # the same verification, both policies
        policy, memory = core.policies["csd"], core.memory
        record = memory.record

        def timed_policy(draft, logits, sp, rng):
            # alternate which runs first: the first pass over fresh logits pays their cache misses
            calls = [lambda: policy(draft, logits, sp, rng), lambda: exact_greedy(draft, logits, sp, rng)]
            order = (0, 1) if len(self.gate_s) % 2 == 0 else (1, 0)
            secs, out = [0.0, 0.0], [None, None]
            for i in order:
                t0 = time.perf_counter()
                out[i] = calls[i]()
                secs[i] = time.perf_counter() - t0
            self.gate_s.append(secs[0])
            self.exact_s.append(secs[1])
            self.accepted_csd.append(out[0].accepted)
            self.accepted_exact.append(out[1].accepted)
            return out[0]

        def timed_record(pairs):
            t0 = time.perf_counter()
            record(pairs)
            self.record_s.append(time.perf_counter() - t0)

        core.policies["csd"] = timed_policy
        memory.record = timed_record


def measure(engine, prompts, max_new: int) -> dict:
    from services.router.engine import GenerationRequest

    t = Timed(engine.verifier)
    wall = cycles = 0.0
    for p in prompts:
        engine.verifier.clear_prefix_cache()  # every run prefills cold
        out = engine.generate(GenerationRequest(engine.encode(p.text), max_new, method="csd")).result()
        wall += out["stats"]["wall_s"]
        cycles += out["stats"]["cycles"]
    cycle_us = 1e6 * wall / cycles
    gate_us = 1e6 * (sum(t.gate_s) - sum(t.exact_s)) / cycles
    record_us = 1e6 * sum(t.record_s) / cycles
    return {
        "cycles": int(cycles),
        "cycle_us": round(cycle_us, 1),
        "gate_us_per_cycle": round(gate_us, 2),
        "record_us_per_cycle": round(record_us, 2),
        "median_record_us": round(1e6 * statistics.median(t.record_s), 2) if t.record_s else 0.0,
        # in-cycle effect of the gate: accepted draft tokens per cycle, same drafts and logits
        "accepted_per_cycle_csd": round(statistics.mean(t.accepted_csd), 4),
        "accepted_per_cycle_exact": round(statistics.mean(t.accepted_exact), 4),
        "overhead_share": round((gate_us + record_us) / cycle_us, 5),
    }


def main() -> None:
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap, "humaneval", 10, 128)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    prompts = load(args.workload, args.limit)
    base = EngineConfig(threads=args.threads, eagle3=None, predictor=None)
    rows = {}
    for name, cfg in (("local", base), ("redis", replace(base, redis_url=args.redis_url))):
        engine = Engine(cfg)
        measure(engine, prompts[:1], 16)  # warm-up
        rows[name] = measure(engine, prompts, args.max_new_tokens)
        engine.close()
        print(f"[csd-overhead] {name}: {rows[name]}", file=sys.stderr, flush=True)
    result = {
        "command": "python -m bench.csd_overhead " + " ".join(sys.argv[1:]),
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "memories": rows,
    }
    lines = [
        f"### CSD overhead per cycle — {args.workload}, {len(prompts)} prompts",
        "",
        "| memory | cycles | µs / cycle | gate µs / cycle | record µs / cycle | gate + memory share | "
        "accepted / cycle, csd vs exact on the same cycles |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {r['cycles']} | {r['cycle_us']} | {r['gate_us_per_cycle']} | {r['record_us_per_cycle']} | "
        f"{100 * r['overhead_share']:.2f} % | {r['accepted_per_cycle_csd']:.3f} vs {r['accepted_per_cycle_exact']:.3f} |"
        for k, r in rows.items()
    ]
    text = "\n".join(lines + ["", f"Command: `{result['command']}`", ""])
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
