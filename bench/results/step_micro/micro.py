"""Micro-measures quoted in docs/decisions.md for this stop's changes, one run on this machine:
``python bench/results/step_micro/micro.py`` (from the project root) writes micro.{json,md} here.

- a cycle result's conversion on the wire, now and at d3c3e21 (that ``wire.py`` read from git);
- batch-invariant linears: each shape's row block (``invariant.row_block``) and its probe's time,
  a 512-row GEMM whole and in its blocks, and the block lookup ``invariant.Linear`` now skips."""

import json
import subprocess
import sys
import time
import timeit
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import invariant
from services.common.types import CycleResult
from services.verifier import wire

HERE = Path(__file__).parent


def us(fn, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def old_wire() -> types.ModuleType:
    src = subprocess.run(["git", "show", "d3c3e218:services/verifier/wire.py"], capture_output=True, text=True, check=True)
    mod = types.ModuleType("old_wire")
    exec(compile(src.stdout, "old_wire.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    out: dict = {"command": "python bench/results/step_micro/micro.py", "cpu_flags": cpu_flags()}
    r = CycleResult(committed=[1, 2, 3], drafted=8, accepted=2, source="suffix", verify_s=0.01, server_s=0.02, batch_size=64)
    old = old_wire()
    out["wire_us"] = {
        side: {
            "result_to_pb": us(lambda m=m: m.result_to_pb(r), 20000),
            "result_from_pb": us(lambda m=m, p=m.result_to_pb(r): m.result_from_pb(p), 20000),
        }
        for side, m in (("d3c3e21", old), ("now", wire))
    }
    out["linear"] = []
    for o, k in [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]:
        t0 = time.perf_counter()
        block = invariant.row_block(o, k, torch.bfloat16, "cpu")
        probe_s = time.perf_counter() - t0
        w, x = torch.randn(o, k).bfloat16(), torch.randn(512, k).bfloat16()
        n = 3 if o > 10000 else 20
        out["linear"].append(
            {
                "out": o,
                "in": k,
                "row_block": block,
                "probe_s": probe_s,
                "whole_512_ms": us(lambda: F.linear(x, w), n) / 1e3,
                "invariant_512_ms": us(lambda: invariant.linear(x, w), n) / 1e3,
                "block_lookup_us": us(lambda: invariant._block(w), 20000),
            }
        )
    (HERE / "micro.json").write_text(json.dumps(out, indent=1))
    (HERE / "micro.md").write_text(markdown(out))
    print(markdown(out))


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return sorted({f for f in text.split() if f.startswith(("amx", "avx512_bf16"))})


def markdown(out: dict) -> str:
    w = out["wire_us"]
    lines = [
        "# Step micro-measures",
        "",
        f"Command: `{out['command']}`. CPU flags: {', '.join(out['cpu_flags']) or 'no AMX / AVX-512 bf16'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Best of 5 repeats.",
        "",
        "| a cycle result | d3c3e21 µs | now µs |",
        "|---|---|---|",
    ]
    lines += [f"| {f} | {w['d3c3e21'][f]:.2f} | {w['now'][f]:.2f} |" for f in ("result_to_pb", "result_from_pb")]
    lines += [
        "",
        "| bf16 GEMM (in → out) | row block (0: any) | probe s | 512 rows whole ms | 512 rows invariant ms | block lookup µs |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {x['in']} → {x['out']} | {x['row_block']} | {x['probe_s']:.3f} | {x['whole_512_ms']:.2f} | "
        f"{x['invariant_512_ms']:.2f} | {x['block_lookup_us']:.2f} |"
        for x in out["linear"]
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
