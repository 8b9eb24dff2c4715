"""Serving benchmark: per-cycle overhead and aggregate throughput, embedded vs distributed.

- ms per cycle of single-stream requests through the public gRPC API (median over prompts);
  the model work is the same in both topologies, so distributed − embedded is the cost the
  network hop adds per cycle;
- aggregate tokens/s at each concurrency (threads streaming Generate at once, the same
  prompts for every topology), reported with the ratio to concurrency 1.
The distributed topology runs verifier replicas as processes on loopback.

    python -m bench.serving --methods sd --concurrency 1,4,8,16 --out bench/results/serving.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from bench.workloads import load
from services.common.grpc_server import free_port
from services.common.config import MODELS_DIR, EngineConfig, ServerConfig
from specmesh.v1 import generate_pb2 as gpb
from specmesh.v1 import generate_pb2_grpc as ggrpc



def start_router(cfg: EngineConfig, verifiers: list[str] | None):
    from services.router.engine import Engine
    from services.router.server import build_server
    from services.verifier.server import RemoteVerifier

    engine = Engine(cfg, verifier=RemoteVerifier(verifiers) if verifiers else None)
    server, _, port = build_server(engine, ServerConfig(port=0, max_sessions=64, workers=64, metrics_port=0))
    server.start()
    return server, ggrpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def start_verifiers(args, n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addrs = [], []
    for _ in range(n):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--role", "verifier",
                                       "--port", str(port), "--metrics-port", "0", "--target", str(args.target),
                                       "--draft", str(args.draft), "--max-sessions", "64"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        addrs.append(f"127.0.0.1:{port}")
    for a in addrs:
        with grpc.insecure_channel(a) as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
    return procs, addrs


def one(stub, prompt: str, n: int, method: str) -> tuple[int, float, dict]:
    t0 = time.perf_counter()
    msgs = list(stub.Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=n, method=method), timeout=600))
    wall = time.perf_counter() - t0
    final = msgs[-1]
    return final.usage.completion_tokens, wall, {"cycles": final.stats.cycles}


def aggregate(stub, prompts: list[str], n: int, method: str, conc: int) -> float:
    """Tokens/s with ``conc`` streams in flight, each thread walking its share of the prompts."""
    total = [0]
    lock = threading.Lock()

    def worker(k):
        for p in prompts[k::conc]:
            toks, _, _ = one(stub, p, n, method)
            with lock:
                total[0] += toks

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total[0] / (time.perf_counter() - t0)


def measure(stub, prompts, args, method) -> dict:
    walls, cycles, toks = [], [], []
    for p in prompts[:args.overhead_prompts]:
        t, w, s = one(stub, p, args.max_new_tokens, method)
        walls.append(w)
        cycles.append(s["cycles"])
        toks.append(t)
    row = {"median_wall_s": round(statistics.median(walls), 4),
           "median_ms_per_cycle": round(1000 * statistics.median(w / c for w, c in zip(walls, cycles)), 3)}
    row["tokens_per_s"] = {}
    for conc in args.concurrency:
        row["tokens_per_s"][str(conc)] = round(aggregate(stub, prompts, args.max_new_tokens, method, conc), 2)
        print(f"[serving] {method} concurrency {conc}: {row['tokens_per_s'][str(conc)]} tok/s", flush=True)
    base = row["tokens_per_s"][str(args.concurrency[0])]
    row["scaling_vs_first"] = {k: round(v / base, 3) for k, v in row["tokens_per_s"].items()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    ap.add_argument("--draft", type=Path, default=MODELS_DIR / "draft")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--methods", default="vanilla,sd")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--overhead-prompts", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    from services.common.runtime import tune_gc

    tune_gc()
    cfg = EngineConfig(target=args.target, draft=args.draft, eagle3=None)
    prompts = [p.text for p in load(args.workload, args.limit)]
    result = {"command": " ".join(["python -m bench.serving"] + sys.argv[1:]), "workload": args.workload,
              "max_new_tokens": args.max_new_tokens, "replicas": args.replicas, "rows": []}
    procs: list[subprocess.Popen] = []
    try:
        for topology in ("embedded", "distributed"):
            verifiers = None
            if topology == "distributed":
                procs, verifiers = start_verifiers(args, args.replicas)
            server, stub = start_router(cfg, verifiers)
            for method in args.methods.split(","):
                one(stub, prompts[0], 8, method)  # warm-up
                result["rows"].append({"topology": topology, "method": method, **measure(stub, prompts, args, method)})
            server.stop(0)
    finally:
        for p in procs:
            p.terminate()
    for m in args.methods.split(","):
        emb = next(r for r in result["rows"] if r["method"] == m and r["topology"] == "embedded")
        dis = next(r for r in result["rows"] if r["method"] == m and r["topology"] == "distributed")
        result.setdefault("distributed_overhead_ms_per_cycle", {})[m] = round(
            dis["median_ms_per_cycle"] - emb["median_ms_per_cycle"], 3)
    print(json.dumps(result, indent=2))
    if args.out:
        write(result, args.out)


def write(result: dict, out: Path) -> None:
    """JSON, a markdown table and a PNG of tokens/s by concurrency, side by side."""
    out.write_text(json.dumps(result, indent=2) + "\n")
    concs = list(result["rows"][0]["tokens_per_s"])
    lines = [f"### Serving — {result['workload']}, {result['max_new_tokens']} new tokens, {result['replicas']} verifier replica(s)",
             "", "| topology | method | ms / cycle (1 stream) | " + " | ".join(f"tok/s @{c}" for c in concs)
             + f" | ×{concs[-2] if len(concs) > 1 else concs[0]} vs ×1 |", "|" + "---|" * (3 + len(concs) + 1)]
    for r in result["rows"]:
        key = concs[-2] if len(concs) > 1 else concs[0]
        lines.append(f"| {r['topology']} | {r['method']} | {r['median_ms_per_cycle']} | "
                     + " | ".join(str(r["tokens_per_s"][c]) for c in concs) + f" | {r['scaling_vs_first'][key]} |")
    lines += ["", "Distributed − embedded, ms per cycle: "
              + ", ".join(f"{m} {v:+}" for m, v in result["distributed_overhead_ms_per_cycle"].items()),
              "", f"Command: `{result['command']}`", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in result["rows"]:
        ax.plot([int(c) for c in concs], [r["tokens_per_s"][c] for c in concs], marker="o",
                label=f"{r['topology']} {r['method']}")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.set_title("specmesh serving throughput")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
