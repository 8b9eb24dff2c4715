"""Medians over alternating A/B rounds of bench.control_plane: python medians.py DIR (DIR holds
before_N.json and after_N.json); prints a markdown table, before -> after per configuration."""

import json
import statistics
import sys
from pathlib import Path

FIELDS = [
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("exposed_us_per_step", "exposed µs/step", "{:.0f}"),
    ("exposed_share", "exposed share of step", "{:.1%}"),
    ("of_full", "of the full-batch bound", "{:.1%}"),
    ("sessions_per_step", "sessions/step", "{:.1f}"),
    ("context_switches_per_session_cycle", "ctx sw", "{:.2f}"),
    ("tau", "τ", "{:.2f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
]


def rows(path: Path) -> dict:
    out = {}
    for r in json.loads(path.read_text())["rows"]:
        r = dict(r)
        r["exposed_share"] = r["exposed_us_per_step"] / (r["mean_step_ms"] * 1000)
        r["of_full"] = r["tokens_per_s"] / r["full_batch_bound_tokens_per_s"]
        out[(r["topology"], r["method"], r["sessions"])] = r
    return out


def main(d: Path) -> None:
    sides = {s: [rows(p) for p in sorted(d.glob(f"{s}_*.json"))] for s in ("before", "after")}
    print(f"Medians of {len(sides['before'])} / {len(sides['after'])} rounds.\n")
    print("| configuration | " + " | ".join(label for _, label, _ in FIELDS) + " |")
    print("|---" * (len(FIELDS) + 1) + "|")
    for key in sides["before"][0]:
        cells = []
        for f, _, fmt in FIELDS:
            b, a = (statistics.median(run[key][f] for run in sides[s] if key in run) for s in ("before", "after"))
            cells.append(f"{fmt.format(b)} → {fmt.format(a)}")
        print(f"| {key[0]} {key[1]} {key[2]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
