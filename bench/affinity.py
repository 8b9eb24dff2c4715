"""Prefix affinity across verifier replicas: multi-turn conversations, distributed topology.

Verifier replicas run as ``specmesh serve --role verifier`` processes on loopback; the router
(an ``Engine`` over ``RemoteVerifier``) runs in this process. ``--conversations`` conversations
run at once, each ``--turns`` turns one after another: a turn's prompt is the whole
conversation so far (earlier prompts and answers) plus a new HumanEval prompt, so each turn
shares its start with the turn before, and only the replica that served that turn holds it in
its prefix cache. Placement with prefix affinity (``--affinity-slack``) is compared with plain
least-loaded placement (affinity off); each pass starts fresh verifier processes (empty
caches), the settings alternate, ``--repeats`` passes each.

Reported per setting: time to first token of the later turns (median over turns, then over
passes), the share of their prompt tokens the prefix cache gave, the pass's wall time, and
whether every answer equals the other setting's.

    python -m bench.affinity --replicas 2 --conversations 4 --turns 4 --repeats 3 --out bench/results/affinity.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from bench.harness import command, machine, pyplot, report, table_markdown, write_figure
from bench.workloads import humaneval
from services.assembly import verifier_command
from services.common.runtime import free_port, stop_processes


def start_verifiers(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addrs = [], []
    for _ in range(n):
        port = free_port()
        procs.append(
            subprocess.Popen(
                verifier_command(port, {"threads": 1}),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
            )
        )
        addrs.append(f"127.0.0.1:{port}")
    for a in addrs:
        with grpc.insecure_channel(a) as ch:
            grpc.channel_ready_future(ch).result(timeout=300)
    return procs, addrs


def conversation(engine, turns: list[str], args, rec: list[dict]) -> None:
    from services.router.engine import GenerationRequest

    history: list[int] = []
    for t, text in enumerate(turns):
        ids = history + engine.encode(("\n\n" if history else "") + text)
        r = engine.generate(GenerationRequest(ids, args.max_new_tokens, method=args.method)).result()
        rec.append(
            {
                "turn": t,
                "ttft": r["stats"]["ttft_s"],
                "prompt": len(ids),
                "cached": r["cached_prompt_tokens"],
                "answer": r["token_ids"],
            }
        )
        history = ids + r["token_ids"]


def one_pass(cfg, args, slack: int | None, texts: list[list[str]]) -> dict:
    from services.router.engine import Engine
    from services.verifier.client import RemoteVerifier

    procs, addrs = start_verifiers(args.replicas)
    try:
        pool = RemoteVerifier(addrs, affinity_slack=slack)
        engine = Engine(cfg, verifier=pool)
        recs: list[list[dict]] = [[] for _ in texts]
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=conversation, args=(engine, turns, args, r)) for turns, r in zip(texts, recs)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(900)
        wall = time.perf_counter() - t0
        pool.close()
    finally:
        stop_processes(procs)
    later = [x for r in recs for x in r if x["turn"] > 0]
    return {
        "ttft": statistics.median(x["ttft"] for x in later),
        "cached_share": sum(x["cached"] for x in later) / sum(x["prompt"] for x in later),
        "wall": wall,
        "answers": [[x["answer"] for x in r] for r in recs],
    }


def run(args) -> list[dict]:
    from services.common.config import EngineConfig

    prompts = [p.text for p in humaneval(args.conversations * args.turns)]
    texts = [prompts[c * args.turns : (c + 1) * args.turns] for c in range(args.conversations)]
    cfg = EngineConfig(threads=1)
    settings = [("least loaded", None), (f"prefix affinity (slack {args.affinity_slack})", args.affinity_slack)]
    per: dict[str, list[dict]] = {name: [] for name, _ in settings}
    t0, total = time.time(), args.repeats * len(settings)
    for rep in range(args.repeats):
        for name, slack in settings[rep % 2 :] + settings[: rep % 2]:
            per[name].append(one_pass(cfg, args, slack, texts))
            done = sum(map(len, per.values()))
            rate = (time.time() - t0) / done
            print(
                f"[affinity] {done}/{total} passes  {rate:.1f} s/pass  eta {rate * (total - done):.0f} s",
                file=sys.stderr,
                flush=True,
            )
    ref = per[settings[0][0]][0]["answers"]
    med = statistics.median
    return [
        {
            "placement": name,
            "ttft_ms": round(1e3 * med(r["ttft"] for r in per[name]), 1),
            "cached_share": round(med(r["cached_share"] for r in per[name]), 3),
            "wall_s": round(med(r["wall"] for r in per[name]), 2),
            "identical_outputs": all(r["answers"] == ref for r in per[name]),
        }
        for name, _ in settings
    ]


def markdown(result: dict) -> str:
    a = result["args"]
    cols = ["placement", "later turns' TTFT ms", "their prompt tokens cached", "pass wall s", "answers equal"]
    rows = [
        [
            r["placement"],
            r["ttft_ms"],
            f"{100 * r['cached_share']:.0f} %",
            r["wall_s"],
            "yes" if r["identical_outputs"] else "NO",
        ]
        for r in result["rows"]
    ]
    title = (
        f"### Prefix affinity — {a['conversations']} conversations at once × {a['turns']} turns "
        f"(HumanEval prompts, {a['max_new_tokens']} new tokens a turn, `{a['method']}`), {a['replicas']} verifier "
        f"replicas (medians over {a['repeats']} passes, fresh replicas each)"
    )
    return table_markdown(title, cols, rows, result["command"], (f"Machine: {result['machine']}",))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.4))
    names = [r["placement"] for r in rows]
    a.bar(names, [r["ttft_ms"] for r in rows], color=["C0", "C2"])
    a.set(ylabel="later turns' time to first token, ms")
    b.bar(names, [100 * r["cached_share"] for r in rows], color=["C0", "C2"])
    b.set(ylabel="their prompt tokens from the prefix cache, %")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="hybrid")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--affinity-slack", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(args)
    keys = ("method", "replicas", "conversations", "turns", "max_new_tokens", "affinity_slack", "repeats")
    result = {
        "args": {k: getattr(args, k) for k in keys},
        "machine": machine(),
        "command": command("bench.affinity", argv),
        "rows": rows,
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
