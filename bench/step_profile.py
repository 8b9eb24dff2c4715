"""Where a batched verifier step's time goes: drafting, the ragged target forward, and inside
each the attention calls, at each batch size.

Runs in one process on the verifier core (no servers): ``B`` sessions on humaneval prompts,
each cycle drafts with the draft LM for all of them (one batched ``propose_batch``), verifies
all drafts in one ``verify_batch`` and applies the lossless policy. Medians over cycles.
Each session attends over its own batch-1 K/V cache (``attend_rows``: one call per session and
layer); drafting's attention and the target's are timed apart. ``--repeats`` rounds add their
cycles to the medians. A single session takes the plain path, whose attention is not timed apart.
``--kv-pools off,on`` profiles an engine per setting, interleaved per round: with pooled K/V slots
(``--kv-pool``) the sessions of a segment attend in one call per layer (``kv_pool.Group``),
timed as the target's attention too.

    python -m bench.step_profile --batches 1,4,8 --repeats 4 --out bench/results/step_profile.json
    python -m bench.step_profile --batches 1,8,16 --kv-pools off,on --repeats 4 --out bench/results/kv_pool.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from bench.harness import pyplot, report, table_markdown, write_figure
from bench.workloads import load

PARTS = ("draft", "draft_attention", "verify", "verify_attention", "finish")


@contextmanager
def timed_attention(sink: list[float]):
    """Adds the seconds of every ``attend_rows`` call (the ragged forward's per-session
    attention, one per session and layer) and every pooled group's call to ``sink[-1]`` while
    active. On CUDA each call is synchronized, so its kernels are counted."""
    import torch

    import services.common.llama as llama
    from services.common.kv_pool import Group

    originals = (llama.attend_rows, Group.attend)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timing(fn):
        def timed(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            sink[-1] += time.perf_counter() - t0
            return out

        return timed

    llama.attend_rows, Group.attend = timing(originals[0]), timing(originals[1])
    try:
        yield
    finally:
        llama.attend_rows, Group.attend = originals


def profile(core, prompts: list[list[int]], batch: int, cycles: int) -> dict[str, list[float]]:
    """Seconds per step of each part, per cycle, with ``batch`` sessions cycling together."""
    from services.common.types import Sampling, Verdict

    runner, drafter, policy = core.runner, core.drafters["draft-lm"], core.policies["lossless"]
    greedy = Sampling()
    ids = [f"b{batch}-{i}" for i in range(batch)]
    sessions = []
    for sid, p in zip(ids, prompts):
        st = runner.open(p, len(p) + 8 * cycles)
        runner.verify(st, [])  # prefill
        runner.commit(st, Verdict(accepted=0, tokens=[p[-1]]))
        drafter.start(sid, p + [p[-1]], greedy, None, 8 * cycles)
        sessions.append(st)
    times = {k: [] for k in PARTS}
    attention: list[float] = []
    with timed_attention(attention):
        for _ in range(cycles):
            attention.append(0.0)
            t0 = time.perf_counter()
            drafts = drafter.propose_batch([(sid, 4) for sid in ids])
            attention.append(0.0)
            t1 = time.perf_counter()
            outs = runner.verify_batch([(st, d.token_ids) for st, d in zip(sessions, drafts)])
            t2 = time.perf_counter()
            for sid, st, d, (logits, _) in zip(ids, sessions, drafts, outs):
                verdict = policy(d, logits, greedy, None)
                runner.commit(st, verdict)
                drafter.observe(sid, verdict.tokens)
            t3 = time.perf_counter()
            for k, v in zip(PARTS, (t1 - t0, attention[-2], t2 - t1, attention[-1], t3 - t2)):
                times[k].append(v)
    for sid in ids:
        drafter.stop(sid)
    return times


def summary(batch: int, times: dict[str, list[float]], pool: str = "off") -> dict:
    """Median ms per step of each part."""
    row = {
        "kv_pool": pool,
        "batch": batch,
        **{f"{k}_ms": round(1e3 * statistics.median(v), 3) for k, v in times.items()},
    }
    row["attend_share_of_verify"] = round(row["verify_attention_ms"] / row["verify_ms"], 3) if row["verify_ms"] else 0.0
    return row


def markdown(result: dict) -> str:
    return table_markdown(
        f"### Verifier step profile — `sd` on {result['workload']}, median ms per step over {result['cycles']} cycles"
        f" × {result.get('repeats', 1)} rounds",
        [
            "kv pool",
            "sessions",
            "draft",
            "of which attention",
            "target forward",
            "of which attention",
            "share",
            "policy + commit",
        ],
        [
            [
                r.get("kv_pool", "off"),
                r["batch"],
                r["draft_ms"],
                r["draft_attention_ms"],
                r["verify_ms"],
                r["verify_attention_ms"],
                f"{r['attend_share_of_verify']:.0%}",
                r["finish_ms"],
            ]
            for r in result["rows"]
        ],
        result["command"],
        ("One session takes the plain path; its attention is not timed apart (0).",),
    )


def plot(result: dict, path) -> None:
    """Stacked ms per step by part, one bar per batch size."""
    rows = result["rows"]
    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    parts = (
        ("draft", [r["draft_ms"] for r in rows]),
        ("target attention", [r["verify_attention_ms"] for r in rows]),
        ("rest of the target forward", [r["verify_ms"] - r["verify_attention_ms"] for r in rows]),
        ("policy + commit", [r["finish_ms"] for r in rows]),
    )
    pools = {r.get("kv_pool", "off") for r in rows}
    labels = [f"{r['batch']}" + (f" {r.get('kv_pool', 'off')}" if len(pools) > 1 else "") for r in rows]
    bottom = [0.0] * len(rows)
    for label, values in parts:
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("sessions in the step" + (" and K/V pool" if len(pools) > 1 else ""))
    ax.set_ylabel("ms per step (median)")
    ax.legend(fontsize=8)
    ax.set_title("Verifier step, sd")
    write_figure(fig, path)


def main() -> None:
    from dataclasses import replace

    from services.cli import add_engine_args, engine_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)  # the engine's flags (--device, --dtype, --threads, ...), as `specmesh serve` takes them
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--out", type=Path, default=None, help="JSON path; .md and .png are written beside it")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=1, help="rounds; each adds its cycles to the medians")
    ap.add_argument("--kv-pools", default="off", help="comma-separated: off, on (an engine each, interleaved)")
    args = ap.parse_args()
    args.threads = args.threads or 1  # one torch thread unless set, as make bench
    from services.router.engine import Engine

    pools = args.kv_pools.split(",")
    cfg = replace(engine_config(args), eagle3=None)  # sd only: no EAGLE-3 head to load
    engines = {pool: Engine(replace(cfg, kv_pool=pool == "on")) for pool in pools}
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [engines[pools[0]].encode_fit(p.text, 8 * args.cycles) for p in load(args.workload, max(batches))]
    rows = []
    for i, b in enumerate(batches):
        times = {pool: {k: [] for k in PARTS} for pool in pools}
        for _ in range(args.repeats):
            for pool in pools:  # interleaved: each round profiles every setting
                for k, v in profile(engines[pool].verifier, prompts[:b], b, args.cycles).items():
                    times[pool][k].extend(v)
        rows += [summary(b, times[pool], pool) for pool in pools]
        print(f"[step-profile] {i + 1}/{len(batches)} batch sizes", file=sys.stderr, flush=True)
    result = {
        "workload": args.workload,
        "cycles": args.cycles,
        "repeats": args.repeats,
        "command": "python -m bench.step_profile " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    report(result, args.out, markdown, plot)


if __name__ == "__main__":
    main()
