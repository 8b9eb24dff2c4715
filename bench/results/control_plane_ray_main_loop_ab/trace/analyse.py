"""Medians of a Serve step call's parts: ``python analyse.py DIR`` over the stamps
``sitecustomize.py`` wrote (one step in flight per replica: ``--micro-batches 1``)."""

import glob
import statistics
import sys


def main(d: str) -> None:
    events = sorted((float(t), n) for f in glob.glob(f"{d}/h-*.txt") for n, t in (line.split() for line in open(f)))
    names = [n for _, n in events]
    parts: dict[str, list[float]] = {}
    last_r1 = None
    for k in range(len(events) - 3):
        if names[k : k + 4] != ["r0", "v0", "v1", "r1"]:
            continue
        r0, v0, v1, r1 = (events[k + j][0] for j in range(4))
        for key, x in (
            ("router's call to the replica's step", v0 - r0),
            ("inside the replica's step (the modelled step included)", v1 - v0),
            ("the replica's return to the router's outcomes handed on", r1 - v1),
            ("the call's round trip", r1 - r0),
        ):
            parts.setdefault(key, []).append(x * 1e3)
        if last_r1 is not None:
            parts.setdefault("router: outcomes handed on to its next call", []).append((r0 - last_r1) * 1e3)
        last_r1 = r1
    print(f"{len(parts.get('the call' + chr(39) + 's round trip', []))} steps\n\n| part | median ms | p90 ms |\n|---|---|---|")
    for k, v in parts.items():
        v = sorted(v)
        print(f"| {k} | {statistics.median(v):.2f} | {v[int(len(v) * 0.9)]:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
