"""Greedy equality of the lossless methods with vanilla, per dtype, on this machine's CPU: the
bundled models, HumanEval's first prompts and held-out stdlib windows. A k+1-row verification
and a one-row decode round differently in reduced precision, so a lossless method can leave
vanilla's tokens where two candidates' logits are within rounding of each other.

    python -m bench.bf16_lossless [--dtypes float32,bfloat16] [--prompts 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.workloads import humaneval, stdlib_heldout
from services.common.config import EngineConfig
from services.common.progress import Progress
from services.router.engine import Engine, GenerationRequest

OUT = Path(__file__).resolve().parent / "results" / "bf16_lossless"
METHODS = ("sd", "suffix", "eagle3", "hybrid")


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(dtype: str, texts: list[str], max_new: int) -> dict:
    engine = Engine(EngineConfig(dtype=dtype))
    bar = Progress(len(texts), f"{dtype}", "prompts")
    rows = {m: {"differing": 0, "first_difference": []} for m in METHODS}
    for text in texts:
        ids = engine.encode(text)
        vanilla = engine.generate(GenerationRequest(ids, max_new, method="vanilla")).result()["token_ids"]
        for m in METHODS:
            out = engine.generate(GenerationRequest(ids, max_new, method=m)).result()["token_ids"]
            k = first_difference(out, vanilla)
            if k is not None:
                rows[m]["differing"] += 1
                rows[m]["first_difference"].append(k)
        bar.advance(1)
    bar.close()
    engine.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=8, help="of each workload")
    p.add_argument("--max-new-tokens", type=int, default=96)
    a = p.parse_args()
    texts = [x.text for x in humaneval(a.prompts)] + [x.text for x in stdlib_heldout(a.prompts, prompt_chars=600)]
    result = {
        "command": "python -m bench.bf16_lossless " + " ".join(sys.argv[1:]),
        "prompts": len(texts),
        "max_new_tokens": a.max_new_tokens,
        "dtypes": {d: run(d, texts, a.max_new_tokens) for d in a.dtypes.split(",")},
    }
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Lossless methods against vanilla, per dtype (CPU)",
        "",
        f"Command: `{result['command']}`. {len(texts)} prompts, {a.max_new_tokens} new tokens, greedy.",
        "",
        "| dtype | " + " | ".join(METHODS) + " |",
        "|---|" + "---|" * len(METHODS),
    ]
    for d, rows in result["dtypes"].items():
        lines.append(f"| {d} | " + " | ".join(f"{rows[m]['differing']} of {len(texts)}" for m in METHODS) + " |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(result, OUT.with_suffix(".png"))
    print("\n".join(lines))
    return 0


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    dtypes = list(result["dtypes"])
    width = 0.8 / len(dtypes)
    for k, d in enumerate(dtypes):
        xs = [i + k * width for i in range(len(METHODS))]
        ax.bar(xs, [result["dtypes"][d][m]["differing"] for m in METHODS], width, label=d)
    ax.set_xticks([i + width * (len(dtypes) - 1) / 2 for i in range(len(METHODS))], METHODS)
    ax.set_ylabel(f"prompts differing from vanilla (of {result['prompts']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
