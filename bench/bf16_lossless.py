"""Greedy equality of the lossless methods with vanilla per verification mode, and what the
batch-invariant mode costs, on this machine's CPU: the bundled models, HumanEval's first
prompts and held-out stdlib windows.

A mode is a dtype with batch-invariant verification on or off (``services/common/invariant``).
Without it a k+1-row verification and a one-row decode round differently in reduced
precision, so a lossless method can leave vanilla's tokens where two candidates' logits are
within rounding of each other. Each prompt runs every method under every mode in turn
(interleaved), so the speeds compare like with like.

A mode may also set device drafts on or off (``EngineConfig.device_drafts``: a greedy chain
read once per draft) and static steps on (``EngineConfig.static_steps``: CUDA graphs on a GPU),
so their cost or gain is measured the same way.

    python -m bench.bf16_lossless [--modes float32,bfloat16,bfloat16-invariant] [--prompts 8] [--device cuda]
    python -m bench.bf16_lossless --modes float32,float32-device-drafts
    python -m bench.bf16_lossless --models-dir models/smollm2 --target build/models/smollm2 --chat

The engine's flags are ``specmesh serve``'s (``--target``, ``--models-dir``, ``--device``, ...);
a mode sets its dtype and verification on top of them, and a method the engine lacks (``sd``
without a draft) is left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.harness import past_outputs
from bench.harness import report as save_and_print
from bench.workloads import humaneval, stdlib_heldout, through_chat
from services.cli import add_engine_args, engine_config
from services.common.config import EngineConfig
from services.common.progress import Progress
from services.router.engine import Engine, GenerationRequest

OUT = Path(__file__).resolve().parent / "results" / "bf16_lossless"
METHODS = ("sd", "suffix", "eagle3", "hybrid", "suffix-tree", "eagle3-tree", "hybrid-tree", "ngram")
DRAFTS = {"device-drafts": True, "host-drafts": False}  # left out: the device's default


def mode_config(name: str) -> dict | None:
    """A mode's engine settings: ``DTYPE[-invariant][-static][-device-drafts|-host-drafts]``
    (``EngineConfig.batch_invariant``, ``static_steps``, ``device_drafts``); None for a name
    of another shape."""
    dtype, sep, rest = name.partition("-")
    if sep and not rest:
        return None
    chains = None
    for suffix, value in DRAFTS.items():
        if rest == suffix or rest.endswith("-" + suffix):
            chains, rest = value, rest.removesuffix(suffix).rstrip("-")
    parts = rest.split("-") if rest else []
    if dtype not in ("float32", "bfloat16", "float16") or parts not in (
        [],
        ["invariant"],
        ["static"],
        ["invariant", "static"],
    ):
        return None
    return {
        "dtype": dtype,
        "batch_invariant": "invariant" in parts,
        "static_steps": "static" in parts,
        "device_drafts": chains,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def timed(engine: Engine, ids: list[int], max_new: int, method: str) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = engine.generate(GenerationRequest(ids, max_new, method=method)).result()["token_ids"]
    return out, len(out) / (time.perf_counter() - t0)


def run(modes: list[str], texts: list[str], max_new: int, cfg: EngineConfig) -> dict:
    engines = {m: Engine(replace(cfg, **(mode_config(m) or {}))) for m in modes}
    methods = [m for m in METHODS if m in next(iter(engines.values())).methods()]
    rows = {
        mode: {m: {"differing": 0, "first_difference": [], "tok_s": []} for m in ("vanilla", *methods)}
        for mode in modes
    }
    bar = Progress(len(texts), "prompts", "prompts")
    for text in texts:
        for mode, engine in engines.items():
            ids = engine.encode(text)
            with past_outputs(engine):  # no method drafts from another's answer to this prompt
                vanilla, speed = timed(engine, ids, max_new, "vanilla")
                rows[mode]["vanilla"]["tok_s"].append(speed)
                for m in methods:
                    out, speed = timed(engine, ids, max_new, m)
                    rows[mode][m]["tok_s"].append(speed)
                    k = first_difference(out, vanilla)
                    if k is not None:
                        rows[mode][m]["differing"] += 1
                        rows[mode][m]["first_difference"].append(k)
        bar.advance()
    bar.close()
    for engine in engines.values():
        engine.close()
    for per_method in rows.values():
        for r in per_method.values():
            r["median_tok_s"] = statistics.median(r["tok_s"])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--modes",
        default="float32,bfloat16,bfloat16-invariant",
        help="comma-separated DTYPE[-invariant][-static][-device-drafts|-host-drafts] (float32, bfloat16, float16)",
    )
    p.add_argument("--prompts", type=int, default=8, help="of each workload")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--chat", action="store_true", help="give each prompt through the chat template (bench.workloads.through_chat)"
    )
    p.add_argument("--out", type=Path, default=OUT.with_suffix(".json"), help="the JSON; .md and .png beside it")
    add_engine_args(p)
    a = p.parse_args()
    modes = a.modes.split(",")
    unknown = [m for m in modes if mode_config(m) is None]
    if unknown:
        p.error(f"--modes: {', '.join(unknown)} is not DTYPE[-invariant][-static][-device-drafts|-host-drafts]")
    cfg = engine_config(a)
    texts = [x.text for x in humaneval(a.prompts)] + [x.text for x in stdlib_heldout(a.prompts, prompt_chars=600)]
    if a.chat:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(cfg.target))
        texts = [through_chat(tokenizer, t) for t in texts]
    result = {
        "command": "python -m bench.bf16_lossless " + " ".join(sys.argv[1:]),
        "target": str(cfg.target),
        "prompts": len(texts),
        "max_new_tokens": a.max_new_tokens,
        "device": cfg.device,
        "modes": run(modes, texts, a.max_new_tokens, cfg),
    }
    save_and_print(result, a.out, lambda r: "\n".join(markdown(r)) + "\n", plot)
    return 0


def ran(result: dict) -> tuple[str, ...]:
    """The methods a result has (vanilla's peers the engine had)."""
    return tuple(m for m in next(iter(result["modes"].values())) if m != "vanilla")


def markdown(result: dict) -> list[str]:
    n, modes, methods = result["prompts"], result["modes"], ran(result)
    lines = [
        f"# Lossless methods against vanilla, per verification mode ({result['device']})",
        "",
        f"Command: `{result['command']}`. Target: `{result.get('target', 'the bundled one')}`. {n} prompts, "
        f"{result['max_new_tokens']} new tokens, greedy; every method under every mode per prompt, interleaved.",
        "",
        "Prompts on which a method's tokens leave vanilla's:",
        "",
        *_table(modes, methods, lambda rows, m: f"{rows[m]['differing']} of {n}"),
        "",
        "Median tokens/s (speedup over the mode's own vanilla):",
        "",
        *_table(modes, ("vanilla", *methods), _speed),
    ]
    for base in modes:
        for other in (f"{base}-invariant", f"{base}-static", f"{base}-device-drafts", f"{base}-host-drafts"):
            if other in modes:
                ratios = {
                    m: modes[other][m]["median_tok_s"] / modes[base][m]["median_tok_s"] for m in ("vanilla", *methods)
                }
                lines += [
                    "",
                    f"{other} against {base}: {min(ratios.values()):.2f}-{max(ratios.values()):.2f}x the tokens/s ("
                    + ", ".join(f"{m} {r:.2f}x" for m, r in ratios.items())
                    + ").",
                ]
    return lines


def _table(modes: dict, columns: tuple[str, ...], cell) -> list[str]:
    """A mode per row, a method per column, ``cell(mode's rows, method)`` in each."""
    head = ["| mode | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    return head + [f"| {mode} | " + " | ".join(cell(rows, m) for m in columns) + " |" for mode, rows in modes.items()]


def _speed(rows: dict, m: str) -> str:
    tok_s = rows[m]["median_tok_s"]
    return f"{tok_s:.1f}" if m == "vanilla" else f"{tok_s:.1f} ({tok_s / rows['vanilla']['median_tok_s']:.2f}x)"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    modes, methods = list(result["modes"]), ran(result)
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        xs = [i + k * width for i in range(len(methods))]
        ax.bar(xs, [result["modes"][mode][m]["differing"] for m in methods], width, label=mode)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(methods))], methods)
    ax.set_ylabel(f"prompts differing from vanilla (of {result['prompts']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
