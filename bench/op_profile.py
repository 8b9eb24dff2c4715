"""Where a single stream's decoding time goes, operator by operator (torch.profiler), on any device.

For each method, after a warm-up, ``--prompts`` requests of ``--max-new-tokens`` run under
the profiler. Reported per method: wall ms per cycle, then the operators with the most self
time (CPU, and on CUDA also device time), with calls per cycle, and the calls per cycle that
make the host wait for the device (``aten::_local_scalar_dense`` behind ``.item()``/``.tolist()``,
device-to-host copies, stream and device synchronizations). On CUDA those waits and the
per-operator launch cost are what a small model's step is made of; this is the report to read
before changing the CUDA step.

    python -m bench.op_profile --device cuda --methods vanilla,sd --out bench/results/cuda/op_profile.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.harness import report
from bench.workloads import load

WAITS = (
    "aten::_local_scalar_dense",
    "aten::item",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpyAsync",
    "cudaMemcpy",
)


def profile_method(engine, method: str, prompts: list[list[int]], max_new: int, top: int) -> dict:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from services.router.engine import GenerationRequest

    engine.generate(GenerationRequest(prompts[0], 16, method=method)).result()  # warm-up
    cuda = engine.cfg.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    cycles, t0 = 0, time.perf_counter()
    # the router's scheduler and step threads run the cycles: every thread is profiled, not only this one
    try:
        every_thread = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option profiles this thread only: the counts miss the cycles
        print(
            "op_profile: this torch cannot profile every thread; the cycles' operators are not counted", file=sys.stderr
        )
        every_thread = _ExperimentalConfig()
    with profile(activities=acts, experimental_config=every_thread) as prof:
        for ids in prompts:
            engine.verifier.clear_prefix_cache()  # every run prefills cold
            cycles += engine.generate(GenerationRequest(ids, max_new, method=method)).result()["stats"]["cycles"]
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def row(e) -> dict:
        out = {
            "op": e.key,
            "calls_per_cycle": round(e.count / cycles, 2),
            "self_cpu_us_per_cycle": round(e.self_cpu_time_total / cycles, 1),
        }
        if cuda:
            out["self_device_us_per_cycle"] = round(getattr(e, "self_device_time_total", 0.0) / cycles, 1)
        return out

    by_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    by_dev = sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:top] if cuda else []
    waits = {e.key: round(e.count / cycles, 2) for e in events if e.key in WAITS}
    return {
        "method": method,
        "cycles": cycles,
        "ms_per_cycle": round(1e3 * wall / cycles, 3),
        "profiled_ms_per_cycle_note": "wall under the profiler, which adds its own cost per operator",
        "top_cpu": [row(e) for e in by_cpu],
        "top_device": [row(e) for e in by_dev],
        "waits_per_cycle": waits,
    }


def markdown(result: dict) -> str:
    lines = [
        f"### Operator profile — {result['workload']}, {result['prompts']} prompts × {result['max_new_tokens']} "
        f"tokens, {result['device']} {result['dtype']}, {result['threads']} threads",
        "",
    ]
    for m in result["methods"]:
        lines += [
            f"**{m['method']}**: {m['cycles']} cycles, {m['ms_per_cycle']} ms per cycle under the profiler; "
            f"host waits per cycle: {m['waits_per_cycle'] or 'none'}",
            "",
        ]
        for key, title in (("top_cpu", "self CPU"), ("top_device", "self device")):
            if not m[key]:
                continue
            cols = list(m[key][0])
            lines += [f"Top operators by {title} time:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in m[key]]
            lines.append("")
    return "\n".join(lines + [f"Command: `{result['command']}`", ""])


def main(argv: list[str] | None = None) -> dict:
    from services.cli import add_engine_args, engine_config
    from services.router.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(p)
    p.add_argument("--methods", default="vanilla,sd")
    p.add_argument("--workload", default="stdlib-heldout")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    engine = Engine(engine_config(args))
    prompts = [engine.encode_fit(q.text, args.max_new_tokens) for q in load(args.workload, args.prompts)]
    rows = []
    for m in args.methods.split(","):
        rows.append(profile_method(engine, m, prompts, args.max_new_tokens, args.top))
        print(f"[op-profile] {m}: {rows[-1]['ms_per_cycle']} ms per cycle", file=sys.stderr, flush=True)
    result = {
        "workload": args.workload,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "device": engine.cfg.device,
        "dtype": engine.cfg.dtype,
        "threads": torch.get_num_threads(),
        "command": "python -m bench.op_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
        "methods": rows,
    }
    report(result, args.out, markdown)
    return result


if __name__ == "__main__":
    main()
