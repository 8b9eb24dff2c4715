"""A verifier's target on one process against the same target split over N (``--tensor-parallel``),
in one run: per prompt, each (size, method) cell in rotated order, through the engine as users
call it. Reported: the target's step time per cycle (``verify_s`` over cycles: the forward and
its collectives), tokens/s, and whether every split run gave the one-process run's tokens.

On this 2-core machine the split cannot be faster: N processes share two cores and each all-reduce
crosses processes through gloo, so the figures show the collectives' cost and that the split is
exact, not a GPU's speedup (there each rank has a device of its own and NCCL links them).

    python -m bench.tensor_parallel --target build/models/smollm2 --tensor-parallel 3 --chat \
        --out bench/results/tensor_parallel_smollm2.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from bench.harness import (
    Run,
    command,
    grouped_bars,
    machine,
    past_outputs,
    pyplot,
    report,
    run_ours,
    table_markdown,
    workload_args,
    write_figure,
)
from bench.workloads import load, through_chat


def _probe_rank(rank: int, world: int, port: int, hidden: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.randn(8, hidden)  # a step's rows: 8 sessions' verifications
    for _ in range(20):
        dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(PROBE_CALLS):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t0) / PROBE_CALLS)
    dist.destroy_process_group()


PROBE_CALLS = 300


def all_reduce_us(world: int, hidden: int) -> float:
    """One gloo all-reduce of a step's [8, hidden] rows among ``world`` processes, alone (µs)."""
    import torch.multiprocessing as mp

    from services.common.runtime import free_port

    out = mp.get_context("spawn").Queue()
    mp.start_processes(_probe_rank, (world, free_port(), hidden, out), nprocs=world, start_method="spawn")
    return round(1e6 * out.get(timeout=60), 1)


def cells_run(engines: dict[int, object], methods: list[str], prompts: list[list[int]], max_new: int):
    """(size, method) → per-prompt runs, the cells of each prompt in rotated order."""
    cells = [(n, m) for n in engines for m in methods]
    for n, m in cells:  # warm-up (its outputs would leak into prompt 0's suffix drafts)
        with past_outputs(engines[n], keep=False):
            run_ours(engines[n], m, prompts[0], 16)
    runs: dict[tuple[int, str], list[Run]] = {c: [] for c in cells}
    t0 = time.time()
    for i, ids in enumerate(prompts):
        for n, m in cells[i % len(cells) :] + cells[: i % len(cells)]:
            with past_outputs(engines[n]):
                runs[(n, m)].append(run_ours(engines[n], m, ids, max_new))
        rate = (time.time() - t0) / (i + 1)
        print(f"[tp] {i + 1}/{len(prompts)} prompts  {rate:.1f} s/prompt  eta {rate * (len(prompts) - i - 1):.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    return runs


def rows(runs: dict[tuple[int, str], list[Run]]) -> list[dict]:
    out = []
    for (n, m), rs in runs.items():
        one = runs[(1, m)]
        out.append(
            {
                "tensor_parallel": n,
                "method": m,
                "step_ms": round(
                    1e3 * statistics.median(r.stats["verify_s"] / max(1, r.stats["cycles"]) for r in rs), 2
                ),
                "tokens_per_s": round(statistics.median(len(r.ids) / r.wall for r in rs), 1),
                "tokens_per_cycle": round(statistics.median(len(r.ids) / max(1, r.stats["cycles"]) for r in rs), 2),
                "same_tokens_as_one_process": sum(r.ids == o.ids for r, o in zip(rs, one)),
                "prompts": len(rs),
            }
        )
    for r in out:
        base = next(b for b in out if b["method"] == r["method"] and b["tensor_parallel"] == 1)
        r["step_vs_one_process"] = round(r["step_ms"] / base["step_ms"], 2)
    return out


def markdown(result: dict) -> str:
    cols = ["tensor parallel", "method", "step ms", "vs one process", "tokens/s", "tokens/cycle", "same tokens"]
    table = [
        [r["tensor_parallel"], r["method"], r["step_ms"], f"{r['step_vs_one_process']:.2f}x", r["tokens_per_s"],
         r["tokens_per_cycle"], f"{r['same_tokens_as_one_process']}/{r['prompts']}"]
        for r in result["rows"]
    ]  # fmt: skip
    notes = (
        f"Target `{result['target']}`, {result['workload']} ({result['limit']} prompts"
        f"{', through the chat template' if result['chat'] else ''}), {result['max_new_tokens']} new tokens, "
        f"greedy; {result['threads']} torch thread(s) per process; {result['machine']}.",
        "step ms: the target's forward per cycle (the verifier's `verify_s` over cycles), medians over prompts. "
        "On this 2-core CPU the ranks share the cores and talk through gloo: the split shows its exactness and its "
        "collectives' cost, not a GPU's speedup.",
        f"One gloo all-reduce of a step's rows among {max(r['tensor_parallel'] for r in result['rows'])} processes, "
        f"measured alone in this run: {result['all_reduce_us']:.0f} µs; a step makes "
        f"{result['collectives_per_step']} collectives (two per layer, and the logits' gather).",
    )
    return table_markdown("# One process against a tensor-parallel target", cols, table, result["command"], notes)


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    sizes = sorted({r["tensor_parallel"] for r in result["rows"]})
    step = {(r["tensor_parallel"], r["method"]): r["step_ms"] for r in result["rows"]}
    grouped_bars(ax, methods, sizes, lambda n, m: step[(n, m)], lambda n: f"TP {n}")
    ax.set(ylabel="target step, ms per cycle")
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from services.cli import add_engine_args, engine_config
    from services.router.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(p)
    workload_args(p, limit=8, max_new_tokens=64, threads=False)
    p.add_argument("--methods", default="vanilla,suffix")
    p.add_argument("--chat", action="store_true", help="prompts through the chat template (an instruct target)")
    args = p.parse_args(argv)
    size = args.tensor_parallel
    if size < 2:
        raise SystemExit("--tensor-parallel N (N >= 2): the split to compare with one process")
    args.tensor_parallel, args.threads = 1, args.threads or 1
    cfg = engine_config(args)
    engines = {1: Engine(cfg), size: Engine(replace(cfg, tensor_parallel=size))}
    try:
        prompts = load(args.workload, args.limit)
        tok = engines[1].tokenizer
        texts = [through_chat(tok, q.text) if args.chat else q.text for q in prompts]
        encoded = [engines[1].encode_fit(t, args.max_new_tokens) for t in texts]
        runs = cells_run(engines, args.methods.split(","), encoded, args.max_new_tokens)
        shape = engines[1].verifier.runner.model.s
    finally:
        for e in engines.values():
            e.close()
    import torch

    result = {
        "target": str(cfg.target),
        "workload": args.workload,
        "limit": len(encoded),
        "max_new_tokens": args.max_new_tokens,
        "chat": args.chat,
        "threads": torch.get_num_threads(),
        "machine": machine(),
        "command": command("bench.tensor_parallel", argv),
        "rows": rows(runs),
        "all_reduce_us": all_reduce_us(size, shape.hidden),  # after the engines closed: the cores are free
        "collectives_per_step": 2 * shape.layers + 1,
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
