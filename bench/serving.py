"""Serving benchmark: per-cycle overhead and aggregate throughput, embedded vs distributed.

- ms per cycle of single-stream requests through the public gRPC API (median over prompts),
  and the part of it outside model work (drafting and verification steps, as the stream's
  final stats report them): distributed − embedded of that part is what the hop adds;
- aggregate tokens/s at each concurrency (threads streaming Generate at once, the same
  prompts for every topology), reported with the ratio to concurrency 1. It is measured in
  steady state: each thread starts its next request as soon as its last one ends, and only the
  tokens streamed in a ``--window-s`` window after ``--warmup-s`` count, so every counted token
  was made with that many streams in flight. (Running each thread's share of the prompts once
  and dividing by the whole run counts the ramp-down too, where the streams that finished
  early leave fewer in flight: with 32 prompts at 16 streams, two requests per stream.)
Both topologies run as ``specmesh serve`` processes started side by side (distributed: a
router process plus verifier processes on loopback); every round measures every cell on
both, interleaved, and medians over the rounds are reported. The load generator (the gRPC
clients) runs in its own process, as real clients do.

    python -m bench.serving --methods sd --concurrency 1,4,8,16 --out bench/results/serving.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import grpc

from bench.workloads import load
from services.common.config import EngineConfig, models_dir
from services.common.runtime import free_port, stop_processes
from specmesh.v1 import generate_pb2 as gpb
from specmesh.v1 import generate_pb2_grpc as ggrpc

# OpenMP workers that spin after a forward would hold a core the router and clients need.
SERVER_ENV = {"OMP_WAIT_POLICY": os.environ.get("SPECMESH_BENCH_OMP_WAIT", "PASSIVE")}


def start_server(topology: str, args, spec_disable_batch: int = 0) -> tuple[subprocess.Popen, str]:
    """``specmesh serve`` as users run it: embedded (one process) or distributed (router +
    verifier processes on the ports after the router's)."""
    port = free_port()
    pool = topology.endswith("-pool")  # e.g. embedded-pool: the same with --kv-pool
    topology, _, link = topology.removesuffix("-pool").partition("-")  # distributed-stream: per-session streams
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--topology",
        topology,
        "--replicas",
        str(args.replicas),
        "--verifier-link",
        link or "multiplex",
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--response-stats",  # each final message's speculation stats: the bench reads them
        "--target",
        str(args.target),
        "--draft",
        str(args.draft),
        "--eagle3",
        "none",
        "--max-sessions",
        "64",
        "--batch-window-ms",
        str(args.batch_window_ms),
        "--max-batch",
        str(args.max_batch),
        "--threads",
        str(args.server_threads),
        "--spec-disable-batch",
        str(spec_disable_batch),
        "--prefix-cache-mb",
        str(args.prefix_cache_mb),
        "--kv-pool" if pool else "--no-kv-pool",
    ]
    log = tempfile.TemporaryFile()  # a file, not a pipe: a long run's logs would fill a pipe and stall the server
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **SERVER_ENV})
    addr = f"127.0.0.1:{port}"
    with grpc.insecure_channel(addr) as ch:
        ready = grpc.channel_ready_future(ch)
        for _ in range(300):  # up to 5 minutes, unless the server has exited
            try:
                ready.result(timeout=1)
                break
            except grpc.FutureTimeoutError:
                if proc.poll() is not None:
                    log.seek(0)
                    err = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"specmesh serve exited ({proc.returncode}) before serving: {err}") from None
        else:
            raise RuntimeError(f"specmesh serve did not answer on {addr} within 300 s")
    return proc, addr


def one(stub, prompt: str, n: int, method: str) -> tuple[int, float, dict]:
    t0 = time.perf_counter()
    msgs = list(stub.Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=n, method=method), timeout=600))
    wall = time.perf_counter() - t0
    final = msgs[-1]
    st = final.stats
    return final.usage.completion_tokens, wall, {"cycles": st.cycles, "model_s": st.draft_s + st.verify_s}


def aggregate(
    stub, prompts: list[str], n: int, method: str, conc: int, window_s: float = 0.0, warmup_s: float = 0.0
) -> float:
    """Tokens/s with ``conc`` streams in flight. With ``window_s``, steady state: each thread
    walks its share of the prompts round and round, starting a new request as soon as its
    last ends, until the window has passed; only tokens streamed between ``warmup_s`` and
    ``warmup_s + window_s`` count, so every one of them was made with ``conc`` streams in
    flight. Without it (the warm-up), each thread runs its share once."""
    total = [0]
    lock = threading.Lock()
    t0 = time.perf_counter()
    lo, hi = t0 + warmup_s, t0 + warmup_s + window_s

    def worker(k):
        mine = prompts[k::conc] or prompts[k % len(prompts) :][:1]
        i = 0
        while True:
            for msg in stub.Generate(
                gpb.GenerateRequest(prompt=mine[i % len(mine)], max_new_tokens=n, method=method), timeout=600
            ):
                now = time.perf_counter()
                if not window_s or lo <= now <= hi:
                    with lock:
                        total[0] += len(msg.token_ids)
            i += 1
            if not window_s and i == len(mine) or window_s and time.perf_counter() > hi:
                return

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total[0] / (window_s or time.perf_counter() - t0)


def single_stream(addr: str, prompts: list[str], n: int, method: str) -> dict:
    """Median ms per cycle of one stream at a time, and its part outside model work."""
    stub = ggrpc.GenerationStub(grpc.insecure_channel(addr))
    rows = [one(stub, p, n, method) for p in prompts]
    return {
        "ms_per_cycle": 1000 * statistics.median(w / s["cycles"] for _, w, s in rows),
        "overhead_ms_per_cycle": 1000 * statistics.median((w - s["model_s"]) / s["cycles"] for _, w, s in rows),
    }


def concurrent(
    addr: str, prompts: list[str], n: int, method: str, conc: int, window_s: float = 0.0, warmup_s: float = 0.0
) -> float:
    return aggregate(ggrpc.GenerationStub(grpc.insecure_channel(addr)), prompts, n, method, conc, window_s, warmup_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=models_dir() / "target")
    ap.add_argument("--draft", type=Path, default=models_dir() / "draft")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--methods", default="vanilla,sd")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--overhead-prompts", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--batch-window-ms", type=float, default=5.0)
    ap.add_argument(
        "--max-batch", type=int, default=EngineConfig.max_batch, help="sessions a verifier step batches (serve's flag)"
    )
    ap.add_argument(
        "--topologies",
        default="embedded,distributed",
        help="embedded, distributed (router↔verifier over the multiplexed Link), distributed-stream "
        "(one Session stream per request); a -pool suffix (embedded-pool) adds --kv-pool",
    )
    ap.add_argument(
        "--spec-disable-batch",
        default="0",
        help="comma-separated settings of the servers' --spec-disable-batch; each gets its own servers",
    )
    ap.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="torch intra-op threads per server process (0 = torch's default). With two servers and the "
        "clients sharing the cores, intra-op threads must not spin (OMP_WAIT_POLICY=PASSIVE), and "
        "then waking them for every small decode GEMM costs more than they gain: on 2 cores, 1 "
        "thread served vanilla at 120 tok/s and 2 threads at 56 (one stream)",
    )
    ap.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=0,
        help="the servers' prefix cache; off by default: every cell repeats the same prompts, which "
        "would then skip their prefill after the first round (bench.prefix_cache measures it)",
    )
    ap.add_argument(
        "--window-s",
        type=float,
        default=10.0,
        help="seconds of steady state measured per cell: every stream stays in flight through it "
        "(0: each stream runs its share of the prompts once, ramp-down included)",
    )
    ap.add_argument("--warmup-s", type=float, default=2.0, help="seconds of each cell before its window")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    prompts = [p.text for p in load(args.workload, args.limit)]
    result = {
        "command": " ".join(["python -m bench.serving"] + sys.argv[1:]),
        "workload": args.workload,
        "max_new_tokens": args.max_new_tokens,
        "replicas": args.replicas,
        "repeats": args.repeats,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "server_env": SERVER_ENV,
        "machine": _machine(),
        "rows": [],
    }
    settings = [int(x) for x in args.spec_disable_batch.split(",")]
    topologies = tuple((t, sdb) for sdb in settings for t in args.topologies.split(","))
    servers: dict[tuple, tuple[subprocess.Popen, str]] = {}
    samples: dict[tuple, list] = {}
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for t in topologies:
            servers[t] = start_server(t[0], args, t[1])
            for m in methods:  # warm-up, not measured: first batched steps, allocator, caches
                clients.submit(concurrent, servers[t][1], prompts[: max(concs)], 16, m, max(concs)).result()
        total = args.repeats * len(methods) * (1 + len(concs)) * len(topologies)
        done, t0 = 0, time.perf_counter()
        for rnd in range(args.repeats):  # every round runs every cell once, topologies side by side
            for m in methods:
                for conc in [0] + concs:  # 0 = the single-stream overhead measurement
                    for t in topologies:
                        addr = servers[t][1]
                        if conc == 0:
                            job = clients.submit(
                                single_stream, addr, prompts[: args.overhead_prompts], args.max_new_tokens, m
                            )
                        else:
                            job = clients.submit(
                                concurrent, addr, prompts, args.max_new_tokens, m, conc, args.window_s, args.warmup_s
                            )
                        samples.setdefault((t, m, conc), []).append(job.result())
                        done += 1
                        eta = (time.perf_counter() - t0) / done * (total - done)
                        print(
                            f"[serving] round {rnd + 1}/{args.repeats} {t[0]} spec-off>{t[1]} {m} conc {conc or 1}"
                            f"{' (overhead)' if conc == 0 else f': {samples[(t, m, conc)][-1]:.1f} tok/s'}"
                            f" — {done}/{total}, ETA {eta / 60:.1f} min",
                            flush=True,
                        )
    finally:
        clients.shutdown()
        stop_processes([proc for proc, _ in servers.values()])
    for t in topologies:
        for m in methods:
            single = samples[(t, m, 0)]
            row = {
                "topology": t[0],
                "spec_disable_batch": t[1],
                "method": m,
                "median_ms_per_cycle": round(statistics.median(x["ms_per_cycle"] for x in single), 3),
                "median_overhead_ms_per_cycle": round(statistics.median(x["overhead_ms_per_cycle"] for x in single), 3),
                "tokens_per_s": {str(c): round(statistics.median(samples[(t, m, c)]), 2) for c in concs},
                "tokens_per_s_samples": {str(c): [round(x, 2) for x in samples[(t, m, c)]] for c in concs},
            }
            base = row["tokens_per_s"][str(concs[0])]
            row["scaling_vs_first"] = {k: round(v / base, 3) for k, v in row["tokens_per_s"].items()}
            result["rows"].append(row)
    result.update(overhead_vs_embedded(result["rows"]))
    print(json.dumps(result, indent=2))
    if args.out:
        write(result, args.out)


def _machine() -> str:
    """The harness's host line, probed here in one thread as the servers run (``--threads 1``)."""
    import torch

    from bench.harness import machine  # lazily: the harness imports torch, which clients need not

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return machine()
    finally:
        torch.set_num_threads(threads)


def overhead_vs_embedded(rows: list[dict]) -> dict:
    """Per distributed variant and method: its ms per cycle outside model work minus embedded's
    (same method and spec-disable setting)."""
    emb = {(r["method"], r["spec_disable_batch"]): r for r in rows if r["topology"] == "embedded"}
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        e = emb.get((r["method"], r["spec_disable_batch"]))
        if r["topology"] != "embedded" and e is not None and not r["spec_disable_batch"]:
            out.setdefault(r["topology"], {})[r["method"]] = round(
                r["median_overhead_ms_per_cycle"] - e["median_overhead_ms_per_cycle"], 3
            )
    return {"overhead_vs_embedded_ms_per_cycle": out} if out else {}


def write(result: dict, out: Path) -> None:
    """JSON, a markdown table and a PNG of tokens/s by concurrency, side by side."""
    out.write_text(json.dumps(result, indent=2) + "\n")
    concs = list(result["rows"][0]["tokens_per_s"])
    key = "8" if "8" in concs else concs[-1]
    lines = [
        f"### Serving — {result['workload']}, {result['max_new_tokens']} new tokens, {result['replicas']} verifier replica(s)",
        "",
        "| topology | no drafts above batch | method | ms / cycle (1 stream) | outside model, ms / cycle | "
        + " | ".join(f"tok/s @{c}" for c in concs)
        + f" | ×{key} vs ×{concs[0]} |",
        "|" + "---|" * (5 + len(concs) + 1),
    ]
    for r in result["rows"]:
        sdb = r.get("spec_disable_batch") or "—"
        lines.append(
            f"| {r['topology']} | {sdb} | {r['method']} | {r['median_ms_per_cycle']} | {r['median_overhead_ms_per_cycle']} | "
            + " | ".join(str(r["tokens_per_s"][c]) for c in concs)
            + f" | {r['scaling_vs_first'][key]} |"
        )
    for topology, by_method in result.get("overhead_vs_embedded_ms_per_cycle", {}).items():
        lines += [
            "",
            f"{topology} − embedded, ms per cycle outside model work: "
            + ", ".join(f"{m} {v:+}" for m, v in by_method.items()),
        ]
    if result.get("window_s"):
        lines += [
            "",
            f"Aggregate tokens/s in steady state: tokens streamed in a {result['window_s']:g} s window after "
            f"{result['warmup_s']:g} s, every stream in flight throughout (medians over {result['repeats']} rounds).",
        ]
    lines += ["", f"Command: `{result['command']}`", f"Machine: {result.get('machine', 'not recorded')}", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    from bench.harness import pyplot, write_figure  # lazily: the harness imports torch, which clients need not

    fig, ax = pyplot().subplots(figsize=(6.5, 4))
    for r in result["rows"]:
        ax.plot(
            [int(c) for c in concs],
            [r["tokens_per_s"][c] for c in concs],
            marker="o",
            label=f"{r['topology']} {r['method']}"
            + (f" (no drafts > {r['spec_disable_batch']})" if r.get("spec_disable_batch") else ""),
        )
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.set_title("specmesh serving throughput")
    write_figure(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
