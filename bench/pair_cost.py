"""What a draft step costs against a target step, per candidate shape, before training either:
batch-1 decode steps of randomly initialised models on the serving path (fp16-valued weights,
packed GEMMs on the CPU), a 1-layer draft with a reduced-vocabulary head (FR-Spec) against
each target shape, interleaved, medians. Issue 39's gate: the draft at most 10 % of a target
step on the CPU and on the GPU, with every bundled model in at most 100 MB (fp16).

    python -m bench.pair_cost [--targets 8x256,12x512] [--drafts 1x128,1x256] [--draft-vocab 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import report as save_and_print
from services.common.llama import Llama
from services.common.packed_linear import pack_linears
from services.common.progress import Progress
from training.pretrain import Preset, build_model

OUT = Path(__file__).resolve().parent / "results" / "pair_cost"
VOCAB = 8192


def shape(text: str) -> Preset:
    """``LxH``: L layers of width H, 3H MLP, 64-wide heads."""
    layers, hidden = (int(x) for x in text.split("x"))
    return Preset(layers=layers, hidden=hidden, intermediate=3 * hidden, heads=hidden // 64, tokens=0, batch=0, lr=0)


def prepared(p: Preset, device: str) -> tuple[Llama, float]:
    """The model on the serving path, and its parameters in millions (before packing)."""
    model = build_model(p, VOCAB, eos=0).to(device).eval()
    n = sum(q.numel() for q in model.parameters()) / 1e6  # parameters() yields a tied weight once
    with torch.no_grad():  # fp16 values, as the bundled weights are stored
        for q in model.parameters():
            q.copy_(q.half().float())
    if device == "cpu":
        pack_linears(model)
    return model, n


def step_ms(model: Llama, context: int, steps: int, head: torch.nn.Module | None, device: str) -> float:
    """Median ms of a batch-1 decode step after ``context`` tokens."""
    ids = torch.randint(1, VOCAB, (context + steps,)).tolist()
    cache = model.new_cache(1, context + steps + 1)
    times = []
    with torch.inference_mode():
        model.forward_ragged([ids[:context]], [0], [cache], tails=[1], head=head)
        for i in range(context, context + steps):
            t0 = time.perf_counter()
            logits, _ = model.forward_ragged([ids[i : i + 1]], [i], [cache], tails=[1], head=head)
            logits[0].argmax().item()  # the token the next step feeds: a host read, as decoding makes
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="8x256,10x384,12x384,12x512")
    ap.add_argument("--drafts", default="1x128,1x192,1x256")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="the draft's head rows (FR-Spec); 0 = all")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=OUT.with_suffix(".json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    models: dict[str, tuple[Llama, float, torch.nn.Module | None]] = {}
    for name in a.targets.split(","):
        models[name] = (*prepared(shape(name), a.device), None)
    for name in a.drafts.split(","):
        draft, n = prepared(shape(name), a.device)
        head = None  # FR-Spec: the head's rows are the most frequent tokens' (of the tied embedding)
        if a.draft_vocab:
            head = torch.nn.Linear(draft.s.hidden, a.draft_vocab, bias=False).to(a.device)
            if a.device == "cpu":
                pack_linears(head)
        models["draft " + name] = (draft, n, head)
    times: dict[str, list[float]] = {name: [] for name in models}
    bar = Progress(a.rounds, "pair_cost", "rounds")
    for _ in range(a.rounds):  # interleaved: each round times every model once
        for name, (model, _, head) in models.items():
            times[name].append(step_ms(model, a.context, a.steps, head, a.device))
        bar.advance()
    bar.close()
    rows = {
        name: {"params_m": n, "fp16_mb": 2 * n, "step_ms": statistics.median(times[name])}
        for name, (_, n, _) in models.items()
    }
    result = {
        "command": "python -m bench.pair_cost " + " ".join(sys.argv[1:]),
        "device": a.device,
        "threads": a.threads,
        "draft_vocab": a.draft_vocab or VOCAB,
        "targets": [t for t in rows if not t.startswith("draft ")],
        "drafts": [d for d in rows if d.startswith("draft ")],
        "models": rows,
    }
    save_and_print(result, a.out, lambda r: "\n".join(markdown(r)) + "\n", plot)
    return 0


def markdown(r: dict) -> list[str]:
    m = r["models"]
    drafts = r["drafts"]
    lines = [
        f"# Draft step against target step, by shape ({r['device']}, {r['threads']} thread(s), batch 1)",
        "",
        f"Command: `{r['command']}`. Random weights with fp16 values on the serving forward, a "
        f"{r['draft_vocab']}-token draft head (FR-Spec), medians of interleaved rounds. Draft steps: "
        + ", ".join(f"{d.removeprefix('draft ')} {m[d]['step_ms']:.2f} ms ({m[d]['fp16_mb']:.1f} MB)" for d in drafts)
        + ".",
        "",
        "| target | parameters | fp16 MB | step ms | " + " | ".join(f"{d} / target" for d in drafts) + " |",
        "|---|---|---|---|" + "---|" * len(drafts),
    ]
    for t in r["targets"]:
        shares = " | ".join(f"{100 * m[d]['step_ms'] / m[t]['step_ms']:.0f} %" for d in drafts)
        lines.append(f"| {t} | {m[t]['params_m']:.1f} M | {m[t]['fp16_mb']:.0f} | {m[t]['step_ms']:.2f} | {shares} |")
    return lines


def plot(r: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = r["models"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [m[t]["fp16_mb"] for t in r["targets"]]
    for d in r["drafts"]:
        ax.plot(xs, [100 * m[d]["step_ms"] / m[t]["step_ms"] for t in r["targets"]], "o-", label=d)
    for t, x in zip(r["targets"], xs):
        ax.annotate(t, (x, 100 * m[r["drafts"][-1]]["step_ms"] / m[t]["step_ms"]))
    ax.axhline(10, ls="--", c="grey")
    ax.set_xlabel("target fp16 MB")
    ax.set_ylabel("draft step / target step (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
