"""Chunked prefill: what a new long prompt does to the streams already decoding.

In one process on the embedded engine (the verifier's cycle batcher steps all sessions
together, as served): ``--streams`` requests on humaneval prompts decode ``--stream-tokens``
tokens each; once they are decoding, ``--arrivals`` long stdlib-heldout prompts (about
``--prompt-chars`` characters) arrive one after another, each ``--gap-ms`` after the previous,
and generate ``--arrival-tokens`` tokens. Each ``--chunks`` setting (0 = a prompt prefills whole
in one step) runs the same scenario, in rotated order, ``--repeats`` times.

Reported per setting: the decoding streams' gaps between consecutive outputs (a stream's
inter-token latency as its client sees it; with speculation one output can carry several
tokens) at the median, p99 and max over all gaps; the arrivals' time to first token; the
decoding streams' aggregate tokens per second. Medians over repeats; outputs are checked
against each request's single-request greedy output.

    python -m bench.prefill --method hybrid --chunks 0,256,128,64 --repeats 3 --out bench/results/prefill.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.harness import bench_engine, command, machine, pyplot, report, table_markdown, write_figure
from bench.workloads import humaneval, stdlib_heldout


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stream(engine, ids: list[int], max_new: int, method: str, rec: dict) -> None:
    """Generate, recording in ``rec`` (as it goes) the time of each output that carries tokens."""
    from services.router.engine import GenerationRequest

    rec["t0"] = time.perf_counter()
    for out in engine.generate(GenerationRequest(ids, max_new, method=method)):
        if out.token_ids:
            rec["times"].append(time.perf_counter())
            rec["tokens"] += out.token_ids


def scenario(engine, method: str, streams: list[list[int]], arrivals: list[list[int]], args) -> dict:
    """One run: the streams decode, the arrivals come in while they do."""
    engine.verifier.clear_prefix_cache()  # every run prefills cold
    recs = [{"times": [], "tokens": []} for _ in streams]
    threads = [
        threading.Thread(target=stream, args=(engine, ids, args.stream_tokens, method, r))
        for ids, r in zip(streams, recs)
    ]
    for t in threads:
        t.start()
    end = time.perf_counter() + 60
    while not all(r["times"] for r in recs) and time.perf_counter() < end:  # every stream is decoding
        time.sleep(0.002)
    arec = [{"times": [], "tokens": []} for _ in arrivals]
    athreads = []
    for ids, r in zip(arrivals, arec):
        th = threading.Thread(target=stream, args=(engine, ids, args.arrival_tokens, method, r))
        th.start()
        athreads.append(th)
        time.sleep(args.gap_ms / 1000)
    for t in threads + athreads:
        t.join(600)
    gaps = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:])]
    first, last = min(r["t0"] for r in recs), max(r["times"][-1] for r in recs)
    return {
        "gaps": gaps,
        "ttft": [r["times"][0] - r["t0"] for r in arec],
        "stream_tok_s": sum(len(r["tokens"]) for r in recs) / (last - first),
        "outputs": [r["tokens"] for r in recs + arec],
    }


def run(engine, args) -> list[dict]:
    from services.router.engine import GenerationRequest

    streams = [engine.encode_fit(p.text, args.stream_tokens) for p in humaneval(args.streams)]
    arrivals = [
        engine.encode_fit(p.text, args.arrival_tokens)
        for p in stdlib_heldout(args.arrivals, prompt_chars=args.prompt_chars)
    ]
    refs = [
        engine.generate(GenerationRequest(ids, n, method=args.method)).result()["token_ids"]
        for ids, n in [(s, args.stream_tokens) for s in streams] + [(a, args.arrival_tokens) for a in arrivals]
    ]
    chunks = [int(c) for c in args.chunks.split(",")]
    per: dict[int, list[dict]] = {c: [] for c in chunks}
    t0 = time.time()
    total = args.repeats * len(chunks)
    for rep in range(args.repeats):
        order = chunks[rep % len(chunks) :] + chunks[: rep % len(chunks)]
        for c in order:
            engine.verifier.prefill_chunk = c
            res = scenario(engine, args.method, streams, arrivals, args)
            res["same"] = res.pop("outputs") == refs
            per[c].append(res)
            done = sum(map(len, per.values()))
            rate = (time.time() - t0) / done
            print(
                f"[prefill] {done}/{total} runs  {rate:.1f} s/run  eta {rate * (total - done):.0f} s",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    med = statistics.median
    for c in chunks:
        runs = per[c]
        rows.append(
            {
                "prefill_chunk": c,
                "gap_p50_ms": round(1e3 * med(percentile(r["gaps"], 0.5) for r in runs), 2),
                "gap_p99_ms": round(1e3 * med(percentile(r["gaps"], 0.99) for r in runs), 2),
                "gap_max_ms": round(1e3 * med(max(r["gaps"]) for r in runs), 2),
                "arrival_ttft_ms": round(1e3 * med(med(r["ttft"]) for r in runs), 1),
                "stream_tok_s": round(med(r["stream_tok_s"] for r in runs), 1),
                "identical_outputs": all(r["same"] for r in runs),
            }
        )
    return rows


def markdown(result: dict) -> str:
    a = result["args"]
    cols = [
        "prefill chunk",
        "stream gap p50 ms",
        "p99 ms",
        "max ms",
        "arrival TTFT ms",
        "streams tok/s",
        "outputs = single-request",
    ]
    rows = [
        [
            "whole prompt" if r["prefill_chunk"] == 0 else r["prefill_chunk"],
            r["gap_p50_ms"],
            r["gap_p99_ms"],
            r["gap_max_ms"],
            r["arrival_ttft_ms"],
            r["stream_tok_s"],
            "yes" if r["identical_outputs"] else "NO",
        ]
        for r in result["rows"]
    ]
    title = (
        f"### Chunked prefill — `{a['method']}`: {a['streams']} streams decoding {a['stream_tokens']} tokens; "
        f"{a['arrivals']} arrivals of ~{result['arrival_prompt_tokens']} prompt tokens, {a['gap_ms']} ms apart "
        f"(medians over {a['repeats']} runs)"
    )
    return table_markdown(title, cols, rows, result["command"], (f"Machine: {result['machine']}",))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    labels = ["whole" if r["prefill_chunk"] == 0 else str(r["prefill_chunk"]) for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["gap_p99_ms"] for r in rows], 0.4, label="p99")
    a.bar([i + 0.2 for i in x], [r["gap_max_ms"] for r in rows], 0.4, label="max")
    a.set_xticks(list(x), labels)
    a.set(xlabel="prefill chunk (tokens per step)", ylabel="decoding streams' gap between outputs, ms")
    a.legend()
    b.bar(list(x), [r["arrival_ttft_ms"] for r in rows], 0.5, color="C2")
    b.set_xticks(list(x), labels)
    b.set(xlabel="prefill chunk (tokens per step)", ylabel="arrivals' time to first token, ms")
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from services.cli import add_engine_args

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(p)
    p.add_argument("--method", default="hybrid")
    p.add_argument("--chunks", default="0,256,128,64")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=512)
    p.add_argument("--arrivals", type=int, default=3)
    p.add_argument("--arrival-tokens", type=int, default=16)
    p.add_argument("--prompt-chars", type=int, default=2400)
    p.add_argument("--gap-ms", type=float, default=300.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    engine = bench_engine(args)
    rows = run(engine, args)
    arrivals = [
        engine.encode_fit(q.text, args.arrival_tokens)
        for q in stdlib_heldout(args.arrivals, prompt_chars=args.prompt_chars)
    ]
    keys = (
        "method",
        "chunks",
        "streams",
        "stream_tokens",
        "arrivals",
        "arrival_tokens",
        "prompt_chars",
        "gap_ms",
        "repeats",
    )
    result = {
        "args": {k: getattr(args, k) for k in keys},
        "arrival_prompt_tokens": int(statistics.median(map(len, arrivals))),
        "machine": machine(),
        "command": command("bench.prefill", argv),
        "rows": rows,
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
