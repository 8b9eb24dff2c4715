"""The hybrid decision counter over each configuration of a bench.control_plane run:
python decisions.py OUT (the command of README.md at 64 sessions)."""

import sys

from prometheus_client import REGISTRY

import bench.control_plane as cp

sys.argv = [
    "x",
    "--sessions",
    "64",
    "--topologies",
    "embedded,distributed",
    "--methods",
    "suffix,hybrid",
    "--count",
    "1024",
    "--out",
    sys.argv[1],
]


def dump(tag):
    for m in REGISTRY.collect():
        if "hybrid_decisions" in m.name:
            print(tag, {s.labels.get("source"): s.value for s in m.samples if s.name.endswith("_total")})


orig = cp.measure


def measure(engine, place, traces, n, method, topology, load):
    dump(f"before {topology} {method}")
    r = orig(engine, place, traces, n, method, topology, load)
    dump(f"after {topology} {method} tau {r['tau']:.2f}")
    return r


cp.measure = measure
cp.main()
