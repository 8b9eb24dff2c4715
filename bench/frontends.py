"""Front-end benchmark: the same server answering through gRPC (``Generate``) and through the
OpenAI-compatible HTTP API (``/v1/completions``, server-sent events), side by side.

One ``specmesh serve`` process (embedded) serves both ports; this process is the client. For
every prompt, method and round, both front ends stream the same greedy request, in alternating
order; the outputs must be identical. Reported per method and front end: median request time,
time to first token, and ms per cycle outside model work (the stream's own draft + verify
seconds subtracted), and HTTP − gRPC of each, which is what the HTTP edge costs.

    python -m bench.frontends --methods vanilla,hybrid --limit 20 --out bench/results/frontends.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench.harness import command, pyplot, save, table_markdown, write_figure
from bench.serving import SERVER_ENV
from bench.workloads import load
from services.common.config import models_dir
from services.common.runtime import free_port, stop_processes
from specmesh.v1 import generate_pb2 as gpb
from specmesh.v1 import generate_pb2_grpc as ggrpc

FRONTS = ("grpc", "http")


def start(args) -> tuple[subprocess.Popen, int, int]:
    port, hport = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        str(hport),
        "--metrics-port",
        "0",
        "--target",
        str(args.target),
        "--threads",
        "1",
        "--prefix-cache-mb",
        "0",
        "--response-stats",  # each answer's speculation stats: the bench reads its cycles and model time
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**__import__("os").environ, **SERVER_ENV}
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=300)
    return proc, port, hport


def via_grpc(stub, prompt: str, n: int, method: str) -> dict:
    t0 = time.perf_counter()
    first, text, final = None, [], None
    for m in stub.Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=n, method=method), timeout=600):
        if m.text and first is None:
            first = time.perf_counter()
        text.append(m.text)
        final = m
    st = final.stats
    return {
        "wall": time.perf_counter() - t0,
        "ttft": (first or time.perf_counter()) - t0,
        "text": "".join(text),
        "cycles": st.cycles,
        "model_s": st.draft_s + st.verify_s,
    }


def via_http(conn: http.client.HTTPConnection, prompt: str, n: int, method: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "method": method, "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    first, text, spec = None, [], None
    for line in resp:  # keep-alive connection, as an HTTP client pool holds one
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        if choice["text"] and first is None:
            first = time.perf_counter()
        text.append(choice["text"])
        spec = choice.get("speculation", spec)
    return {
        "wall": time.perf_counter() - t0,
        "ttft": (first or time.perf_counter()) - t0,
        "text": "".join(text),
        "cycles": spec["cycles"],
        "model_s": spec["draft_s"] + spec["verify_s"],
    }


def measure(args, prompts: list[str], methods: list[str]) -> dict:
    proc, port, hport = start(args)
    try:
        stub = ggrpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        conn = http.client.HTTPConnection("127.0.0.1", hport, timeout=600)
        calls = {
            "grpc": lambda p, m: via_grpc(stub, p, args.max_new_tokens, m),
            "http": lambda p, m: via_http(conn, p, args.max_new_tokens, m),
        }
        for m in methods:  # warm-up: first requests pay lazy initialisation
            for f in FRONTS:
                calls[f](prompts[0], m)
        samples = {(m, f): [] for m in methods for f in FRONTS}
        total, done, t0 = args.repeats * len(prompts) * len(methods), 0, time.time()
        for r in range(args.repeats):
            for i, p in enumerate(prompts):
                for m in methods:
                    order = FRONTS if (r + i) % 2 == 0 else FRONTS[::-1]
                    got = {f: calls[f](p, m) for f in order}
                    if got["grpc"]["text"] != got["http"]["text"]:
                        raise AssertionError(f"prompt {i} {m}: gRPC and HTTP outputs differ")
                    for f in FRONTS:
                        samples[(m, f)].append(got[f])
                    done += 1
                    rate = done / (time.time() - t0)
                    print(
                        f"[frontends] {done}/{total} requests pairs, {rate:.2f}/s, eta {(total - done) / rate:.0f}s",
                        flush=True,
                    )
        return samples
    finally:
        stop_processes([proc])


def rows(samples: dict, methods: list[str]) -> list[dict]:
    out = []
    for m in methods:
        row = {"method": m}
        for f in FRONTS:
            s = samples[(m, f)]
            row[f] = {
                "ms_per_request": round(1000 * statistics.median(x["wall"] for x in s), 3),
                "ttft_ms": round(1000 * statistics.median(x["ttft"] for x in s), 3),
                "ms_per_cycle": round(1000 * statistics.median(x["wall"] / x["cycles"] for x in s), 3),
                "outside_model_ms_per_cycle": round(
                    1000 * statistics.median((x["wall"] - x["model_s"]) / x["cycles"] for x in s), 3
                ),
            }
        row["http_minus_grpc"] = {k: round(row["http"][k] - row["grpc"][k], 3) for k in row["grpc"]}
        row["http_vs_grpc_time"] = round(row["http"]["ms_per_request"] / row["grpc"]["ms_per_request"], 4)
        out.append(row)
    return out


def markdown(result: dict) -> str:
    cols = ["method", "front end", "ms / request", "TTFT ms", "ms / cycle", "outside model, ms / cycle"]
    table = []
    for r in result["rows"]:
        for f in FRONTS:
            table.append(
                [
                    r["method"],
                    f,
                    r[f]["ms_per_request"],
                    r[f]["ttft_ms"],
                    r[f]["ms_per_cycle"],
                    r[f]["outside_model_ms_per_cycle"],
                ]
            )
        d = r["http_minus_grpc"]
        table.append(
            [
                r["method"],
                "**http − grpc**",
                f"{d['ms_per_request']:+}",
                f"{d['ttft_ms']:+}",
                f"{d['ms_per_cycle']:+}",
                f"{d['outside_model_ms_per_cycle']:+}",
            ]
        )
    title = (
        f"### Front ends — {result['workload']}, {result['prompts']} prompts × {result['repeats']} rounds, "
        f"{result['max_new_tokens']} new tokens, greedy, one embedded server (medians)"
    )
    return table_markdown(
        title,
        cols,
        table,
        result["command"],
        (
            "Every HTTP output equals its gRPC output (checked per request). Outside model work = wall time minus "
            "the stream's own draft and verify seconds, per cycle; a front end whose threads contend with the model "
            "for the interpreter also slows the model's steps, which only the ms / cycle column shows.",
        ),
    )


def plot(result: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    ms = [r["method"] for r in result["rows"]]
    for j, f in enumerate(FRONTS):
        ax.bar(
            [i + 0.38 * j for i in range(len(ms))], [r[f]["ms_per_cycle"] for r in result["rows"]], width=0.38, label=f
        )
    ax.set_xticks([i + 0.19 for i in range(len(ms))], ms)
    ax.set_ylabel("ms per cycle (median)")
    ax.legend()
    ax.set_title("gRPC vs OpenAI-compatible HTTP (SSE)")
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=models_dir() / "target")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--methods", default="vanilla,hybrid")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    prompts = [p.text for p in load(args.workload, args.limit)]
    samples = measure(args, prompts, methods)
    result = {
        "command": command("bench.frontends", argv),
        "workload": args.workload,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows(samples, methods),
    }
    print(markdown(result))
    if args.out:
        save(args.out, result, markdown, plot)
    return result


if __name__ == "__main__":
    main()
