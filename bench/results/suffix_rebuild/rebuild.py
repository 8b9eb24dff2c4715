"""How long the call that triggers the shared suffix tree's rebuild holds its caller (the router's
scheduler thread, when a finished session's output enters the tree), with the rebuild inline and
on a thread of its own (``GlobalSuffixCache(background=True)``, the serving default).

    python bench/results/suffix_rebuild/rebuild.py   # (from the project root, traces recorded)

The cache holds its capacity of 1,000 outputs of the control-plane traces (the bundled models'
greedy answers, .cache/control_plane_traces.json from ``bench.control_plane``); 500 more then
finish, evicting as many: a rebuild every 250. Prints per mode the slowest and median insert.
"""

import json
import statistics
import time
from pathlib import Path

from services.drafter.suffix import GlobalSuffixCache

traces = json.loads((Path(__file__).resolve().parents[3] / ".cache/control_plane_traces.json").read_text())["traces"]
outputs = [t["greedy"] for t in traces]
assert len(outputs) >= 1024, "record 1,024 traces first (bench.control_plane --count 1024)"
rows = {}
for background in (False, True, False, True):
    cache = GlobalSuffixCache(64, 1000, background=background)
    for out in outputs[:1000]:
        cache.insert(out)
    times = []
    for i in range(500):
        t0 = time.perf_counter()
        cache.insert(outputs[(1000 + i) % len(outputs)])
        times.append(time.perf_counter() - t0)
    while cache._building is not None:  # (a background rebuild finishing)
        time.sleep(0.01)
    rows.setdefault(background, []).append((max(times), statistics.median(times), cache.version))
for background, runs in rows.items():
    mode = "background" if background else "inline"
    worst = ", ".join(f"{w * 1000:.1f}" for w, _, _ in runs)
    med = ", ".join(f"{m * 1e6:.0f}" for _, m, _ in runs)
    print(f"{mode}: slowest insert {worst} ms; median {med} µs (two runs each)")
