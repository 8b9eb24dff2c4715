"""One table over the committed `specmesh bench` results: per method and workload, the speedup
over `vanilla` of the same run and the tokens per cycle (τ); for transformers' loops (`hf-*`)
and our `vanilla`, also the speedup over `hf-vanilla`, transformers' own baseline, so no peer's
ratio rests on our engine's GEMM packing alone. It is the README's benchmark table.

    python -m bench.summary bench/results/humaneval.json bench/results/stdlib-heldout.json bench/results/edit.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cell(row: dict | None) -> str:
    if row is None:
        return "—"
    notes = []
    if isinstance(row.get("tau"), (int, float)):
        notes.append(f"τ {row['tau']:.2f}")
    hf = row.get("speedup_vs_hf_vanilla")
    if hf is not None and (row["method"] == "vanilla" or row["method"] in ("hf-assisted", "hf-pld")):
        notes.append(f"{hf:.2f}× hf-vanilla")
    return f"{row['speedup_vs_vanilla']:.2f}×" + (f" ({', '.join(notes)})" if notes else "")


def summary(results: list[dict]) -> str:
    methods: list[str] = []
    for res in results:
        methods += [r["method"] for r in res["rows"] if r["method"] not in methods]
    by = [{r["method"]: r for r in res["rows"]} for res in results]
    head = [f"{res['workload']} ({res['limit']} prompts, {res['max_new_tokens']} tokens)" for res in results]
    lines = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(results)]
    lines += [f"| `{m}` | " + " | ".join(cell(b.get(m)) for b in by) + " |" for m in methods]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args()
    print(summary([json.loads(p.read_text()) for p in args.results]))


if __name__ == "__main__":
    main()
