"""Training throughput with bf16 autocast on and off (``training/precision.py``), on this CPU.

Two training steps, each on the bundled weights and real pretraining text:
- ``draft LM``: ``training.pretrain``'s step (next-token loss, backward, AdamW) on ``models/draft``;
- ``EAGLE-3 head``: ``training.eagle3``'s step (the target's features and soft labels, the
  4-step TTT loss, backward, AdamW) on ``models/eagle3`` over ``models/target``.
Precisions alternate round by round, each with its own copy of the weights and optimizer, and
the table reports median tokens/s over rounds. "Δ first loss" is the bf16 loss minus the fp32
loss of the same first batch from the same weights: what autocast changes in what is learned.

    python -m bench.train_precision --rounds 5 --steps 3 --out bench/results/train_precision.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from bench.harness import command, machine, pyplot, report, table_markdown, write_figure
from services.common.llama import Llama
from training.precision import autocast, bf16_native

CPU = torch.device("cpu")


def corpus_batch(rows: int, width: int, offset: float) -> torch.Tensor:
    from training.sequences import corpus_windows

    return torch.tensor(corpus_windows(rows * width, width=width, offset=offset)[:rows])


class DraftStep:
    name = "draft LM"

    def __init__(self, rows: int):
        from training.pretrain import lm_loss

        self.model = Llama.from_pretrained("models/draft")
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.loss_fn, self.x = lm_loss, corpus_batch(rows, 1024, 0.37)

    def __call__(self, bf16: bool) -> float:
        with autocast(CPU, bf16):
            loss = self.loss_fn(self.model, self.x)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


class Eagle3Step:
    name = "EAGLE-3 head"

    def __init__(self, rows: int):
        from training.eagle3 import ttt_loss, warm_head

        self.target = Llama.from_pretrained("models/target")
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.aux = (1, 4, 7)
        self.head, self.vocab_ids = warm_head(Path("models/eagle3"), self.target, self.aux, 2048, CPU)
        self.opt = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=1e-4)
        self.loss_fn, self.x = ttt_loss, corpus_batch(rows, 512, 0.61)
        self.lengths = torch.full((rows,), 512)

    def __call__(self, bf16: bool) -> float:
        with autocast(CPU, bf16):
            with torch.no_grad():
                logits, hidden = self.target.forward_train(self.x, capture=self.aux)
                keep = self.head.t2d[logits.argmax(-1)]
                probs = torch.softmax(logits[..., self.vocab_ids].float(), -1)
            loss, _ = self.loss_fn(self.head, torch.cat(hidden, -1), probs, self.x, self.lengths, 4, keep)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def measure(job_cls, rows: int, rounds: int, steps: int) -> dict:
    """Median tokens/s per precision over ``rounds`` alternating rounds of ``steps`` steps."""
    fp32 = job_cls(rows)
    jobs = {False: fp32, True: copy.deepcopy(fp32)}
    first = {bf16: job(bf16) for bf16, job in jobs.items()}  # also the warm-up step
    tokens = fp32.x.numel() * steps
    rates: dict[bool, list[float]] = {False: [], True: []}
    t_start = time.time()
    for r in range(rounds):
        for bf16 in (False, True) if r % 2 == 0 else (True, False):
            t0 = time.perf_counter()
            for _ in range(steps):
                jobs[bf16](bf16)
            rates[bf16].append(tokens / (time.perf_counter() - t0))
        done = (r + 1) / rounds
        print(
            f"[train_precision] {job_cls.name}: round {r + 1}/{rounds} "
            f"eta {(time.time() - t_start) * (1 - done) / done:.0f}s",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "job": job_cls.name,
        "tokens_per_step": fp32.x.numel(),
        "fp32_tokens_per_s": round(med[False], 1),
        "bf16_tokens_per_s": round(med[True], 1),
        "speedup": round(med[True] / med[False], 3),
        "first_loss_fp32": round(first[False], 4),
        "first_loss_bf16": round(first[True], 4),
        "rates": {"fp32": [round(x, 1) for x in rates[False]], "bf16": [round(x, 1) for x in rates[True]]},
    }


def markdown(result: dict) -> str:
    rows = [
        [
            r["job"],
            r["tokens_per_step"],
            r["fp32_tokens_per_s"],
            r["bf16_tokens_per_s"],
            r["speedup"],
            f"{r['first_loss_bf16'] - r['first_loss_fp32']:+.4f} (of {r['first_loss_fp32']})",
        ]
        for r in result["rows"]
    ]
    return table_markdown(
        f"### Training throughput, bf16 autocast on vs off — {result['threads']} thread(s), "
        f"median over {result['rounds']} rounds of {result['steps']} steps",
        ["step", "tokens / step", "fp32 tok/s", "bf16 tok/s", "bf16 / fp32", "Δ first loss"],
        rows,
        result["command"],
        (
            f"Machine: {result['machine']}; bf16 native here: {result['bf16_native']}.",
            *([result["note"]] if result.get("note") else []),
        ),
    )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r["job"] for r in result["rows"]]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r["fp32_tokens_per_s"] for r in result["rows"]], 0.4, label="fp32")
    ax.bar([x + 0.2 for x in xs], [r["bf16_tokens_per_s"] for r in result["rows"]], 0.4, label="bf16 autocast")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("training tokens / s")
    ax.legend()
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-rows", type=int, default=4, help="1024-token sequences per draft LM step")
    ap.add_argument("--eagle3-rows", type=int, default=8, help="512-token windows per EAGLE-3 step")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="", help="a line on the conditions of the run, printed under the table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [
        measure(DraftStep, args.draft_rows, args.rounds, args.steps),
        measure(Eagle3Step, args.eagle3_rows, args.rounds, args.steps),
    ]
    result = {
        "rows": rows,
        "rounds": args.rounds,
        "steps": args.steps,
        "threads": args.threads,
        "bf16_native": bf16_native(CPU),
        "machine": machine(),
        "note": args.note,
        "command": command("bench.train_precision", argv),
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
