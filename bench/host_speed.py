"""How steady this host is: the speed probe (``bench.harness.speed_probe``) and the target's
1-token forward, sampled over time in one thread. Run it before benchmarking on a shared
machine: a benchmark compares methods interleaved, so a drift cancels out of its ratios, but
its absolute tokens/s compare with another run's only at a like probe.

    python -m bench.host_speed --samples 24 --interval 5 --out bench/results/host_speed.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import command, machine, pyplot, report, speed_probe, table_markdown, write_figure
from services.common.config import models_dir


def forward_ms(model, cache, reps: int = 30) -> float:
    """Median ms of the model's 1-token forward after a 100-token prompt."""
    ids = torch.tensor([[5]])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(ids, 100, cache)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=models_dir() / "target")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from services.common.llama import Llama
    from services.common.packed_linear import pack_linears

    model = Llama.from_pretrained(args.target)
    pack_linears(model)  # as the verifier runs it
    cache = model.new_cache(1, 1024)
    samples, t0 = [], time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([list(range(100))]), 0, cache)
        for i in range(args.samples):
            gemm, op = speed_probe()
            samples.append(
                {
                    "t_s": round(time.perf_counter() - t0, 1),
                    "gemm_ms": round(gemm, 3),
                    "op_us": round(op, 2),
                    "forward_ms": round(forward_ms(model, cache), 3),
                }
            )
            print(f"[host_speed] {i + 1}/{args.samples}: {samples[-1]}", flush=True)
            if i + 1 < args.samples:
                time.sleep(args.interval)
    result = {"command": command("bench.host_speed", argv), "machine": machine(), "samples": samples}
    for k in ("gemm_ms", "op_us", "forward_ms"):
        xs = [s[k] for s in samples]
        result[k] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
    report(result, args.out, markdown, plot)


def markdown(result: dict) -> str:
    names = {"gemm_ms": "probe GEMM, ms", "op_us": "probe op, µs", "forward_ms": "target 1-token forward, ms"}
    rows = [
        [
            names[k],
            result[k]["min"],
            result[k]["median"],
            result[k]["max"],
            round(result[k]["max"] / result[k]["min"], 2),
        ]
        for k in names
    ]
    return table_markdown(
        f"### Host speed over time — {len(result['samples'])} samples",
        ["measure", "min", "median", "max", "max / min"],
        rows,
        result["command"],
        (f"Machine: {result['machine']}",),
    )


def plot(result: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(6.5, 3.5))
    t = [s["t_s"] for s in result["samples"]]
    for k, label in (("forward_ms", "target 1-token forward (ms)"), ("gemm_ms", "probe GEMM (ms)")):
        ax.plot(t, [s[k] for s in result["samples"]], marker="o", label=label)
    ax.set_xlabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("host speed over time (one thread)")
    write_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])
