"""Structured output: how long patterns take to compile over the bundled vocabulary, through
the server's own compiler (a worker process, 10 s limit by default), each pattern in a fresh
compiler so nothing is cached. Past the limit a pattern is refused as too complex.

    python -m bench.grammar_compile --out bench/results/grammar_compile.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness import command, machine, pyplot, report, table_markdown, write_figure
from bench.structured import BODY, SCHEMA
from services.common import structured as so

PATTERNS = {
    "choice (3 strings)": so.StructuredOutput(choice=("yes", "no", "maybe")).pattern(),
    "regex: body lines, unbounded": BODY,
    "regex: [^\\n]{0,40}": r"[^\n]{0,40}",
    "json schema (bench.structured)": so.StructuredOutput(json_schema=json.dumps(SCHEMA)).pattern(),
    "json_object (nesting 1, served)": so._json_object(1),
    "json_object (nesting 2)": so._json_object(2),
    "regex: (    [ -~]{0,100}\\n){1,16}": r"(    [ -~]{0,100}\n){1,16}",
}


def run(tokenizer, vocab_size: int, timeout_s: float) -> list[dict]:
    rows = []
    for name, pattern in PATTERNS.items():
        compiler = so.GrammarCompiler(tokenizer, vocab_size, timeout_s=timeout_s)
        t0 = time.perf_counter()
        try:
            g = compiler.compile(pattern)
            outcome, states = "compiled", len(g.index.get_transitions())
        except so.GrammarError as e:
            outcome, states = str(e).split(":")[1].strip(), None
        finally:
            compiler.worker.close()
        rows.append(
            {
                "pattern": name,
                "regex_chars": len(pattern),
                "seconds": round(time.perf_counter() - t0, 3),
                "outcome": outcome,
                "states": states,
            }
        )
        print(f"[grammar_compile] {name}: {rows[-1]['seconds']} s, {outcome}", flush=True)
    return rows


def markdown(result: dict) -> str:
    table = [
        [r["pattern"], r["regex_chars"], r["states"] if r["states"] is not None else "—", r["seconds"], r["outcome"]]
        for r in result["rows"]
    ]
    return table_markdown(
        f"### Grammar compile time — bundled vocabulary, limit {result['timeout_s']:g} s",
        ["pattern", "regex characters", "automaton states", "seconds", "outcome"],
        table,
        result["command"],
        (f"Machine: {result['machine']}", "Seconds include starting the compile worker (a fresh one per pattern)."),
    )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    rows = result["rows"]
    ax.barh(
        [r["pattern"] for r in rows],
        [r["seconds"] for r in rows],
        color=["tab:blue" if r["outcome"] == "compiled" else "tab:red" for r in rows],
    )
    ax.axvline(result["timeout_s"], color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="seconds to compile (red: refused at the limit)")
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from services.common.config import models_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(str(models_dir() / "target"))
    result = {
        "timeout_s": args.timeout_s,
        "machine": machine(),
        "command": command("bench.grammar_compile", argv),
        "rows": run(tok, len(tok.get_vocab()), args.timeout_s),
    }
    report(result, args.out, markdown, plot)
    return result


if __name__ == "__main__":
    main()
