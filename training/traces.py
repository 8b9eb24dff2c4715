"""``python -m training trace|calibrate``: the target's greedy generations of a workload as replay
traces (what the EAGLE-3 head, the draft's distillation and the yield predictor train on), and the
correction memory's calibration prior. From a checkout: the workloads are ``bench.workloads``."""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.cli import add_engine_args, engine_config
from services.common.progress import run_concurrently
from services.common.security import redacted


def record_traces(
    engine,
    prompts,
    max_new: int,
    progress: bool = True,
    method: str = "vanilla",
    concurrency: int = 1,
    chat: bool = False,
    done: Callable[[Any], None] = lambda trace: None,
) -> list:
    """Greedy target generations of ``prompts`` as replayable traces, each also passed to
    ``done`` as it finishes. ``method`` must be lossless (vanilla, sd, suffix, eagle3, hybrid):
    their greedy tokens are the target's. ``chat``: each prompt given through the tokenizer's
    chat template (``bench.workloads.as_asked``), as an instruct target is asked."""
    from bench.workloads import as_asked
    from services.drafter.replay import Trace
    from services.router.engine import GenerationRequest

    def trace(p):
        ids = engine.encode_fit(as_asked(p, engine.tokenizer if chat else None), max_new)
        r = engine.generate(GenerationRequest(ids, max_new, method=method)).result()
        t = Trace(p.id, ids, r["token_ids"], max_new, engine.eos_id if r["finish_reason"] == "eos" else None)
        done(t)
        return t

    return run_concurrently(trace, list(prompts), concurrency, "trace", progress=progress)


def cmd_trace(args: argparse.Namespace) -> None:
    from bench.workloads import load
    from services.drafter.replay import load_traces, save_traces
    from services.router.engine import Engine

    if args.method not in ("vanilla", "sd", "suffix", "eagle3", "hybrid"):
        sys.exit(f"error: --method {args.method!r} is not lossless; traces must be the target's own tokens")
    engine = Engine(engine_config(args))
    # Resumable: each trace is appended as it finishes; a rerun skips the prompts already there.
    have = {t.id for t in load_traces(args.out)} if args.out.exists() else set()
    todo = [p for p in load(args.workload, args.limit) if p.id not in have]
    lock = threading.Lock()

    def append(trace) -> None:
        with lock:
            save_traces(args.out, [trace], append=True)

    traces = record_traces(
        engine,
        todo,
        args.max_new_tokens,
        method=args.method,
        concurrency=args.concurrency,
        chat=args.chat,
        done=append,
    )
    print(f"wrote {len(traces)} traces to {args.out} ({len(have)} were there)")


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Run `sd` over a calibration workload, record first-rejection pairs, write a snapshot."""
    from bench.workloads import EVALUATION, load
    from services.memory.snapshot import save_snapshot
    from services.router.engine import Engine, GenerationRequest

    if args.workload in EVALUATION:
        sys.exit(f"error: --workload {args.workload!r} is an evaluation set; calibrate on stdlib-train or edit-train")
    cfg = engine_config(args)
    # no shared store and no prior: the engine's memory starts empty and in-process
    engine = Engine(replace(cfg, redis_url=None, ocm_snapshot=None, memory_addr=None))
    prompts = load(args.workload, args.limit)
    run_concurrently(
        lambda p: engine.generate(
            GenerationRequest(engine.encode_fit(p.text, args.max_new_tokens), args.max_new_tokens, method="sd")
        ).result(),
        prompts,
        args.concurrency,
        "calibrate",
        status=lambda: f", {len(engine.verifier.memory)} pairs",
    )
    counts = engine.verifier.memory.snapshot()
    save_snapshot(
        args.out,
        counts,
        {
            "workload": args.workload,
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "target": str(cfg.target),
            "draft": str(cfg.draft),
        },
    )
    print(f"wrote {len(counts)} pairs ({int(sum(counts.values()))} rejections) to {args.out}")
    if args.redis_url:
        from services.memory.redis_link import RedisLink
        from services.memory.redis_memory import RedisCorrectionMemory

        shared = RedisCorrectionMemory(RedisLink(args.redis_url, "ocm"))
        shared.restore(counts)
        shared.close()
        print(f"loaded the snapshot as the shared prior into {redacted(args.redis_url)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("trace", help="record greedy target generations of a workload as replay traces")
    add_engine_args(p)
    p.add_argument("--workload", required=True)
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--method", default="vanilla", help="a lossless method; suffix is fastest on edits")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (verified in one batch)")
    p.add_argument("--chat", action="store_true", help="give each prompt through the chat template (instruct targets)")
    p.add_argument("--out", type=Path, required=True, help="JSONL, appended as traces finish; a rerun resumes")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("calibrate", help="fill the correction memory from sd runs on a calibration set")
    add_engine_args(p)
    p.add_argument("--workload", default="stdlib-train")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (verified in one batch)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_calibrate)
    args = ap.parse_args(argv)
    args.func(args)
