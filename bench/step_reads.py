"""A step's greedy verdicts, per session against batched: the time from a step's logits to every
session's verdict.

- ``per session``: each session's rows [k+1, V] copied to the host as fp32 and its policy run on
  them (how the verifier took a step's verdicts before ``policies.read_greedy``);
- ``batched``: one ``read_greedy`` over the step's joined logits (one argmax, one transfer of
  ids, gaps and ranks), then each session's walk on its reads (how it takes them now).

Logits are random [B·(k+1), V] in the target's dtype on ``--device``, each draft agreeing with
its rows' argmax for a random prefix, then straying to the second-ranked token (so CSD's gate
reads gaps and ranks); exact greedy and CSD (its memory knows every pair), interleaved rounds,
medians. On a GPU the per-session path pays a copy and a stall per session.

    python -m bench.step_reads [--device cuda] [--vocab 8192,49152] [--batch 1,8,32,64,128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from bench.harness import command, grouped_bars, pyplot, report, table_markdown, write_figure
from services.common.config import GateConfig
from services.common.progress import Progress
from services.common.types import Draft, Sampling
from services.memory.correction_memory import LocalCorrectionMemory
from services.verifier.policies import CalibratedGreedy, exact_greedy, read_greedy, rows_policy

OUT = Path(__file__).resolve().parent / "results" / "step_reads.json"
PATHS = ("per session", "batched")


def step(batch: int, k: int, vocab: int, dtype: torch.dtype, device: str, seed: int):
    """Joined logits [batch·(k+1), V], each session's span and its draft."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch * (k + 1), vocab, generator=g) * 3).to(dtype).to(device)
    top2 = logits.float().topk(2, dim=-1).indices.cpu().tolist()
    rnd = random.Random(seed)
    spans, drafts = [], []
    for i in range(batch):
        start, agree = i * (k + 1), rnd.randint(0, k)
        d = [top2[start + j][0 if j < agree else 1] for j in range(k)]
        spans.append((start, k + 1))
        drafts.append(Draft(d))
    return logits, spans, drafts


def per_session(policy, logits, spans, drafts) -> list:
    out = []
    for (start, n), d in zip(spans, drafts):
        rows = logits[start : start + n].float().cpu()
        out.append(policy(d, rows, Sampling(), torch.Generator()))
    return out


def batched(policy, logits, spans, drafts) -> list:
    top_k = policy.gate.top_k if isinstance(policy, CalibratedGreedy) else 0
    reads = read_greedy(logits, spans, [d.token_ids for d in drafts], [top_k] * len(spans))
    walk = rows_policy(policy)
    assert walk is not None
    return [walk(d, r) for d, r in zip(drafts, reads)]


def timed(fn, policy, case, device: str) -> tuple[float, list]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    verdicts = fn(policy, *case)
    return (time.perf_counter() - t0) * 1e6, verdicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vocab", default="8192,49152", help="the bundled target's and SmolLM2's")
    ap.add_argument("--batch", default="1,8,32,64,128")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    memory = LocalCorrectionMemory()
    memory.record([(x, y) for x in range(64) for y in range(64) for _ in range(4)])
    policies = {"exact": exact_greedy, "csd": CalibratedGreedy(GateConfig(min_count=0, tau=0.05), memory)}
    cells = [(v, b, p) for v in map(int, a.vocab.split(",")) for b in map(int, a.batch.split(",")) for p in policies]
    cases = {(v, b): step(b, a.k, v, getattr(torch, a.dtype), a.device, v + b) for v, b, _ in cells}
    times: dict[tuple, list[float]] = {(*c, path): [] for c in cells for path in PATHS}
    bar = Progress(a.rounds, "step_reads", "rounds")
    for r in range(a.rounds):  # interleaved: every cell and path once a round, the paths' order alternating
        for v, b, p in cells:
            got = {}
            for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                us, got[path] = timed(
                    per_session if path == PATHS[0] else batched, policies[p], cases[(v, b)], a.device
                )
                times[(v, b, p, path)].append(us)
            assert got[PATHS[0]] == got[PATHS[1]], f"verdicts differ at vocab {v}, batch {b}, {p}"
        bar.advance()
    bar.close()
    rows = [
        {
            "vocab": v,
            "batch": b,
            "policy": p,
            **{f"{path}_us": statistics.median(times[(v, b, p, path)]) for path in PATHS},
        }
        for v, b, p in cells
    ]
    for row in rows:
        row["speedup"] = row["per session_us"] / row["batched_us"]
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    result = {"command": command("bench.step_reads", argv), "device": name, "args": vars(a) | {"out": str(a.out)}}
    report(result | {"rows": rows}, a.out, markdown, plot)
    return 0


def markdown(r: dict) -> str:
    args = r["args"]
    return table_markdown(
        f"# A step's greedy verdicts: per session vs batched ({r['device']}, {args['dtype']}, k = {args['k']})",
        ["vocab", "sessions", "policy", "per session µs", "batched µs", "speedup"],
        [
            [
                x["vocab"],
                x["batch"],
                x["policy"],
                f"{x['per session_us']:.0f}",
                f"{x['batched_us']:.0f}",
                f"{x['speedup']:.2f}x",
            ]
            for x in r["rows"]
        ],
        r["command"],
        (f"Medians of {args['rounds']} interleaved rounds; both paths give the same verdicts (checked every round).",),
    )


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    vocabs = sorted({x["vocab"] for x in r["rows"]})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(5 * len(vocabs), 3.4), squeeze=False)
    for ax, v in zip(axes[0], vocabs):
        rows = {(x["batch"], x["policy"]): x["speedup"] for x in r["rows"] if x["vocab"] == v}
        batches = sorted({b for b, _ in rows})
        grouped_bars(ax, batches, sorted({p for _, p in rows}), lambda p, b, rows=rows: rows[(b, p)])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=f"vocabulary {v:,}", xlabel="sessions in the step", ylabel="per session / batched")
    write_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
