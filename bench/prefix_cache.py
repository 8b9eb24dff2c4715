"""Prefix cache: what reusing a shared prompt prefix's verified state saves.

In one process on the embedded engine, requests arrive one after another, each a HumanEval
prompt after the same few solved HumanEval problems (``humaneval-fewshot``: few-shot
prompting, whose examples every request shares). Per method, the same requests run with the
verifier's prefix cache off, on, and on but emptied before every request ("cold": what
storing blocks costs when nothing is reused); "on" starts each pass empty, so its first
request prefills everything and later ones reuse the examples' blocks. Methods and settings
run interleaved, in rotated order, ``--repeats`` times.

Reported per method and setting: time to first token and request latency (medians over the
requests of a pass, then over passes), the share of prompt tokens the cache gave, and whether
every output equals the cache-off output of the same request.

    python -m bench.prefix_cache --methods vanilla,sd,eagle3,hybrid --limit 16 --repeats 3 \
        --out bench/results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.harness import bench_engine, command, machine, past_outputs, pyplot, report, table_markdown, write_figure
from bench.workloads import humaneval_fewshot

SETTINGS = ("off", "cold", "on")


def one_pass(engine, method: str, encoded: list[list[int]], max_new: int, cold: bool) -> dict:
    """Every request in order, from an empty prefix cache (before each request when ``cold``);
    no output enters the suffix cache."""
    from services.router.engine import GenerationRequest

    engine.verifier.clear_prefix_cache()
    ttft, wall, cached, outputs = [], [], 0, []
    with past_outputs(engine, keep=False):
        for ids in encoded:
            if cold:
                engine.verifier.clear_prefix_cache()
            r = engine.generate(GenerationRequest(ids, max_new, method=method)).result()
            ttft.append(r["stats"]["ttft_s"])
            wall.append(r["stats"]["wall_s"])
            cached += r["cached_prompt_tokens"]
            outputs.append(r["token_ids"])
    return {
        "ttft": statistics.median(ttft),
        "wall": statistics.median(wall),
        "cached_share": cached / sum(map(len, encoded)),
        "outputs": outputs,
    }


def run(engine, args) -> list[dict]:
    core = engine.verifier
    caches = {o: o.prefix for o in (core.runner, *core.drafters.values()) if getattr(o, "prefix", None) is not None}
    if core.runner not in caches:
        raise SystemExit("bench.prefix_cache needs the prefix cache: --prefix-cache-mb > 0")
    encoded = [engine.encode_fit(p.text, args.max_new_tokens) for p in humaneval_fewshot(args.limit, args.shots)]
    methods = args.methods.split(",")
    cells = [(m, s) for m in methods for s in SETTINGS]
    per: dict[tuple[str, str], list[dict]] = {c: [] for c in cells}
    t0, total = time.time(), args.repeats * len(cells)
    for rep in range(args.repeats):
        for m, s in cells[rep % len(cells) :] + cells[: rep % len(cells)]:
            for owner, cache in caches.items():
                owner.prefix = None if s == "off" else cache
            per[(m, s)].append(one_pass(engine, m, encoded, args.max_new_tokens, cold=s == "cold"))
            done = sum(map(len, per.values()))
            rate = (time.time() - t0) / done
            print(
                f"[prefix-cache] {done}/{total} passes  {rate:.1f} s/pass  eta {rate * (total - done):.0f} s",
                file=sys.stderr,
                flush=True,
            )
    for owner, cache in caches.items():
        owner.prefix = cache
    med = statistics.median
    rows = []
    for m in methods:
        ref = per[(m, "off")][0]["outputs"]
        for s in SETTINGS:
            runs = per[(m, s)]
            rows.append(
                {
                    "method": m,
                    "prefix_cache": s,
                    "ttft_ms": round(1e3 * med(r["ttft"] for r in runs), 1),
                    "latency_ms": round(1e3 * med(r["wall"] for r in runs), 1),
                    "cached_share": round(med(r["cached_share"] for r in runs), 3),
                    "identical_outputs": all(r["outputs"] == ref for r in runs),
                }
            )
            if s != "off":
                off = rows[-1 - SETTINGS.index(s)]
                rows[-1]["ttft_ratio"] = round(rows[-1]["ttft_ms"] / off["ttft_ms"], 3)
                rows[-1]["latency_ratio"] = round(rows[-1]["latency_ms"] / off["latency_ms"], 3)
    return rows


def markdown(result: dict) -> str:
    a = result["args"]
    cols = [
        "method",
        "prefix cache",
        "TTFT ms",
        "/ off",
        "latency ms",
        "/ off",
        "prompt tokens cached",
        "outputs = cache off",
    ]
    rows = [
        [
            r["method"],
            r["prefix_cache"],
            r["ttft_ms"],
            r.get("ttft_ratio", ""),
            r["latency_ms"],
            r.get("latency_ratio", ""),
            f"{100 * r['cached_share']:.0f} %",
            "yes" if r["identical_outputs"] else "NO",
        ]
        for r in result["rows"]
    ]
    title = (
        f"### Prefix cache — {a['limit']} `humaneval-fewshot` requests one after another ({a['shots']} shared "
        f"solved problems, ~{result['prompt_tokens']} prompt tokens), {a['max_new_tokens']} new tokens "
        f"(medians over requests, then over {a['repeats']} passes)"
    )
    return table_markdown(title, cols, rows, result["command"], (f"Machine: {result['machine']}",))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(methods))
    for ax, key, label in ((a, "ttft_ms", "time to first token, ms"), (b, "latency_ms", "request latency, ms")):
        for j, setting in enumerate(SETTINGS):
            ax.bar(
                [i + (j - 1) * 0.27 for i in x],
                [next(r[key] for r in rows if r["method"] == m and r["prefix_cache"] == setting) for m in methods],
                0.27,
                label=f"prefix cache {setting}",
            )
        ax.set_xticks(list(x), methods)
        ax.set(ylabel=label)
        ax.legend()
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from services.cli import add_engine_args

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(p)
    p.add_argument("--methods", default="vanilla,sd,eagle3,hybrid")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--shots", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    engine = bench_engine(args)
    rows = run(engine, args)
    prompts = [engine.encode_fit(q.text, args.max_new_tokens) for q in humaneval_fewshot(args.limit, args.shots)]
    keys = ("methods", "limit", "shots", "max_new_tokens", "repeats")
    result = {
        "args": {k: getattr(args, k) for k in keys},
        "prompt_tokens": int(statistics.median(map(len, prompts))),
        "machine": machine(),
        "command": command("bench.prefix_cache", argv),
        "rows": rows,
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
