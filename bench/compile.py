"""torch.compile against the eager forward, on the bundled target: a batch-1 decode step and a
5-token verification step (the k + 1 rows a chain of 4 is verified in), per variant, interleaved
per round, medians; and each variant's greedy tokens against eager's over a decoded stretch.

Variants: ``eager`` (the serving path; FBGEMM-packed fp16-weight GEMMs on the CPU, as
``--packed-gemm``), ``eager-unpacked``, ``compile`` (inductor over the unpacked model, shapes
dynamic), ``compile-packed`` (over the packed one: the packed GEMM is an opaque call, so the
graph breaks around it), and on CUDA ``reduce-overhead`` (inductor with CUDA graphs). The
``static`` variants run ``Llama.forward_static`` (no shape depends on the position; attention
over the whole cache, masked): eager, ``static-compile`` (inductor, shapes fixed) and on CUDA
``static-graphs`` (``services/common/graphs.py``: a CUDA graph captured per cache and step
length, then replayed, as ``--static-steps`` serves on a GPU). Every cache
holds ``CAPACITY`` positions, so each variant sees the same shapes.

    python -m bench.compile [--variants eager,compile] [--device cuda] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.harness import report as save_and_print
from bench.workloads import humaneval
from services.common.config import EngineConfig
from services.common.graphs import StaticSteps
from services.common.llama import Llama, static_width
from services.common.packed_linear import pack_linears
from services.common.progress import Progress
from services.router.engine import Engine

OUT = Path(__file__).resolve().parent / "results" / "compile"
VARIANTS = (
    "eager",
    "eager-unpacked",
    "compile",
    "compile-packed",
    "reduce-overhead",
    "static",
    "static-compile",
    "static-graphs",
)
CUDA_ONLY = ("reduce-overhead", "static-graphs")
VERIFY_ROWS = 5
CAPACITY = 1024  # positions of every cache (prompt, timed steps and greedy tokens fit)


def positional(step: Callable) -> Callable:
    """A static step behind ``forward``'s signature (ids, start, cache, last_only)."""

    def call(ids: torch.Tensor, start: int, cache, last_only: bool = False, **_):
        end = start + ids.shape[1]
        logits, _ = step(ids, torch.arange(start, end, device=ids.device), cache, static_width(end, cache.capacity))
        return (logits[:, -1:] if last_only else logits), []

    return call


def built(variant: str, device: str, dtype: torch.dtype) -> tuple[Llama, Callable, float]:
    """The variant's model, its forward, and the seconds its first two calls took (compilation)."""
    model = Llama.from_pretrained(EngineConfig().target, dtype=dtype, device=device)
    if device == "cpu" and variant in ("eager", "compile-packed", "static"):
        pack_linears(model)
    forward: Callable = model.forward
    if variant.startswith("compile"):
        forward = torch.compile(model.forward, dynamic=True)
    elif variant == "reduce-overhead":
        forward = torch.compile(model.forward, dynamic=False, mode="reduce-overhead")
    elif variant == "static":
        forward = positional(model.forward_static)
    elif variant == "static-compile":
        forward = positional(torch.compile(model.forward_static, dynamic=False))
    elif variant == "static-graphs":
        forward = positional(StaticSteps(model, graphs=True))
    t0 = time.perf_counter()
    with torch.inference_mode():  # a prefill, a decode and a verification shape before timing
        cache = model.new_cache(1, CAPACITY)
        forward(torch.ones(1, 8, dtype=torch.long, device=device), 0, cache, last_only=True)
        forward(torch.ones(1, 1, dtype=torch.long, device=device), 8, cache, last_only=True)
        forward(torch.ones(1, VERIFY_ROWS, dtype=torch.long, device=device), 9, cache)
    return model, forward, time.perf_counter() - t0


def greedy(model: Llama, forward: Callable, prompt: list[int], n: int, device: str) -> list[int]:
    """``n`` greedy tokens after ``prompt``, one decode step each."""
    cache = model.new_cache(1, CAPACITY)
    out: list[int] = []
    with torch.inference_mode():
        logits, _ = forward(torch.tensor([prompt], device=device), 0, cache, last_only=True)
        for i in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits, _ = forward(torch.tensor([[out[-1]]], device=device), len(prompt) + i, cache, last_only=True)
    return out


def step_ms(model: Llama, forward: Callable, prompt: list[int], rows: int, steps: int, device: str) -> float:
    """Median ms of a step feeding ``rows`` tokens (logits for all of them) after ``prompt``."""
    cache = model.new_cache(1, CAPACITY)
    times = []
    with torch.inference_mode():
        forward(torch.tensor([prompt], device=device), 0, cache, last_only=True)
        ids = torch.tensor([prompt[:rows]], device=device)
        for i in range(steps):
            t0 = time.perf_counter()
            logits, _ = forward(ids, len(prompt) + i * rows, cache)
            logits[0, -1].argmax().item()  # the host reads each step's result, as decoding does
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(variants: list[str], device: str, dtype: torch.dtype, rounds: int, steps: int, tokens: int) -> dict:
    engine = Engine(EngineConfig(device=device))
    prompts = [engine.encode(p.text) for p in humaneval(3)]
    engine.close()
    models, failed = {}, {}
    for v in variants:
        try:  # a variant that cannot build here (a CUDA graph's capture) is reported, not fatal
            model, forward, compile_s = built(v, device, dtype)
        except Exception as e:  # noqa: BLE001 - whatever the compiler or the capture raised
            failed[v] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{v}: failed: {failed[v]}", file=sys.stderr)
            continue
        models[v] = (model, forward)
        print(f"{v}: ready in {compile_s:.1f} s", file=sys.stderr)
    variants = [v for v in variants if v in models]
    rows: dict[str, dict] = {
        v: {"decode_ms": [], "verify_ms": [], "differing": 0, "first_difference": []} for v in variants
    }
    reference = {i: greedy(*models[variants[0]], p, tokens, device) for i, p in enumerate(prompts)}
    bar = Progress(rounds, "rounds", "rounds")
    for r in range(rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:  # rotated order
            model, forward = models[v]
            prompt = prompts[r % len(prompts)]
            rows[v]["decode_ms"].append(step_ms(model, forward, prompt, 1, steps, device))
            rows[v]["verify_ms"].append(step_ms(model, forward, prompt, VERIFY_ROWS, steps, device))
        bar.advance()
    bar.close()
    for v in variants:
        for i, p in enumerate(prompts):
            out = greedy(*models[v], p, tokens, device)
            if out != reference[i]:
                rows[v]["differing"] += 1
                rows[v]["first_difference"].append(next(j for j, (a, b) in enumerate(zip(out, reference[i])) if a != b))
        rows[v]["decode_median_ms"] = statistics.median(rows[v]["decode_ms"])
        rows[v]["verify_median_ms"] = statistics.median(rows[v]["verify_ms"])
    return {**rows, **{v: {"failed": why} for v, why in failed.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants", default="eager,eager-unpacked,compile,compile-packed", help=f"of {', '.join(VARIANTS)}"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6, help="each times every variant once, in rotated order")
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant and round")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt compared with the first variant's")
    p.add_argument("--out", type=Path, default=OUT.with_suffix(".json"), help="the JSON; .md and .png beside it")
    a = p.parse_args()
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS or (v in CUDA_ONLY and not a.device.startswith("cuda"))]
    if bad:
        p.error(
            f"--variants: {', '.join(bad)} unknown here; known: {', '.join(VARIANTS)} ({', '.join(CUDA_ONLY)}: CUDA only)"
        )
    torch.set_num_threads(a.threads)
    result = {
        "command": "python -m bench.compile " + " ".join(sys.argv[1:]),
        "device": a.device,
        "dtype": a.dtype,
        "threads": a.threads,
        "torch": torch.__version__,
        "verify_rows": VERIFY_ROWS,
        "tokens": a.tokens,
        "variants": run(variants, a.device, getattr(torch, a.dtype), a.rounds, a.steps, a.tokens),
    }
    save_and_print(result, a.out, markdown, plot)
    return 0


def markdown(result: dict) -> str:
    variants = result["variants"]
    base = next(iter(variants))
    lines = [
        f"# torch.compile against the eager forward ({result['device']}, {result['dtype']}, "
        f"{result['threads']} thread(s), torch {result['torch']})",
        "",
        f"Command: `{result['command']}`. The bundled target, batch 1; medians over rounds (each "
        f"variant once per round, rotated); greedy tokens over {result['tokens']} decode steps of 3 "
        f"HumanEval prompts against {base}'s.",
        "",
        f"| variant | decode step ms | {result['verify_rows']}-token verify ms | verify / decode | "
        f"prompts off {base}'s tokens |",
        "|---|---|---|---|---|",
    ]
    for v, r in variants.items():
        if "failed" in r:
            lines.append(f"| {v} | failed: {r['failed']} | | | |")
            continue
        d, w = r["decode_median_ms"], r["verify_median_ms"]
        rel = "" if v == base else f" ({d / variants[base]['decode_median_ms']:.2f}x {base}'s)"
        lines.append(f"| {v} | {d:.2f}{rel} | {w:.2f} | {w / d:.2f} | {r['differing']} of 3 |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v, r in result["variants"].items() if "failed" not in r]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = range(len(variants))
    ax.bar([x - 0.2 for x in xs], [result["variants"][v]["decode_median_ms"] for v in variants], 0.4, label="decode")
    ax.bar([x + 0.2 for x in xs], [result["variants"][v]["verify_median_ms"] for v in variants], 0.4, label="verify")
    ax.set_xticks(list(xs), variants)
    ax.set_ylabel("ms per step (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
