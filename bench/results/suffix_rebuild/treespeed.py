"""The compiled suffix tree's speed on the control-plane traces: building a tree of all 1,024
outputs, and a match plus a speculation (16 tokens, paths) every 8 tokens of 400 of them;
medians of 5 rounds. Run it with each build on PYTHONPATH to compare them:

    PYTHONPATH=<checkout> python bench/results/suffix_rebuild/treespeed.py <label>
"""

import json
import statistics
import sys
import time
from pathlib import Path

from services.drafter.suffix_tree import CompiledSuffixTree

ROOT = Path(__file__).resolve().parents[3]
outs = [t["greedy"] for t in json.loads((ROOT / ".cache/control_plane_traces.json").read_text())["traces"]]
build, spec = [], []
for _ in range(5):
    t0 = time.perf_counter()
    tree = CompiledSuffixTree(64)
    for o in outs:
        tree.add(o)
    build.append(time.perf_counter() - t0)
    t0, n = time.perf_counter(), 0
    for o in outs[:400]:
        for i in range(8, len(o), 8):
            tree.speculate_matches(tree.match(o[max(0, i - 64) : i]), 16, 16, 1.0, 0.0, 0.1, False)
            n += 1
    spec.append((time.perf_counter() - t0) / n)
label = sys.argv[1] if len(sys.argv) > 1 else ""
print(f"{label}: build {statistics.median(build) * 1000:.1f} ms, match+speculate {statistics.median(spec) * 1e6:.1f} µs")
