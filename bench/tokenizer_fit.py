"""Does a tokenizer retrained on the package corpus encode held-out text in fewer tokens than the
bundled one? A byte-level BPE of the bundled size trained on the exported corpus's train splits
(standard library and packages), against the bundled tokenizer, on both held-out splits.

    python -m training.packages --out build/corpus   # first
    python -m bench.tokenizer_fit [--corpus build/corpus]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from bench.harness import report
from training.corpus import EOS
from training.packages import read_documents
from training.tokenizer import bpe

OUT = Path(__file__).resolve().parent / "results" / "tokenizer_fit.json"


def retrained(texts: list[str], vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=bpe(texts, vocab_size))


def main() -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("build/corpus"))
    ap.add_argument("--tokenizer", type=Path, default=Path("models/tokenizer"))
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    train = read_documents(a.corpus / "stdlib-train.txt.xz", EOS) + read_documents(
        a.corpus / "packages-train.txt.xz", EOS
    )
    random.Random(0).shuffle(train)
    bundled = AutoTokenizer.from_pretrained(str(a.tokenizer))
    t0 = time.time()
    new = retrained(train, len(bundled))
    seconds = time.time() - t0
    rows = {}
    for split in ("stdlib-heldout", "packages-heldout"):
        docs = read_documents(a.corpus / f"{split}.txt.xz", EOS)
        chars = sum(map(len, docs))
        counts = {
            name: sum(map(len, t(docs, add_special_tokens=False)["input_ids"]))
            for name, t in (("bundled", bundled), ("retrained", new))
        }
        rows[split] = {"chars": chars, **{f"{k}_tokens": v for k, v in counts.items()}}
    result = {
        "command": "python -m bench.tokenizer_fit " + " ".join(sys.argv[1:]),
        "vocab_size": len(bundled),
        "train_mb": sum(map(len, train)) / 1e6,
        "train_seconds": seconds,
        "splits": rows,
    }
    report(result, a.out, markdown, plot)
    return 0


def markdown(r: dict) -> str:
    lines = [
        "# The bundled tokenizer against one retrained on the package corpus",
        "",
        f"Command: `{r['command']}`. Byte-level BPE, {r['vocab_size']:,} tokens, retrained on "
        f"{r['train_mb']:.0f} MB of the exported train splits in {r['train_seconds']:.0f} s.",
        "",
        "| held-out split | chars/token, bundled | chars/token, retrained | fewer tokens |",
        "|---|---|---|---|",
    ]
    for split, s in r["splits"].items():
        b, n = s["bundled_tokens"], s["retrained_tokens"]
        lines.append(f"| {split} | {s['chars'] / b:.3f} | {s['chars'] / n:.3f} | {100 * (b - n) / b:.1f} % |")
    return "\n".join(lines) + "\n"


def plot(r: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    splits = list(r["splits"])
    for k, name in enumerate(("bundled", "retrained")):
        ys = [r["splits"][s]["chars"] / r["splits"][s][f"{name}_tokens"] for s in splits]
        ax.bar([i + 0.4 * k for i in range(len(splits))], ys, 0.4, label=name)
    ax.set_xticks([i + 0.2 for i in range(len(splits))], splits)
    ax.set_ylabel("characters per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
