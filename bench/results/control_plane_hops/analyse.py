"""Medians of the distributed round trip's hops, per step: ``python analyse.py DIR`` over the
stamps ``sitecustomize.py`` wrote (one step in flight at a time: 64 sessions, one micro-batch)."""

import glob
import statistics
import sys

HOPS = ["send0", "yield", "s_take0", "s_step0", "s_step1", "s_yield", "deliver_first", "deliver_last"]
HOPS += ["settle_last", "next_prep0", "next_send0"]
WHAT = {
    "send0": "router: the step's cycles posted, the Link message built",
    "yield": "gRPC: to the stand-in's reader",
    "s_take0": "stand-in: the message's items handled, the step begun",
    "s_step0": "stand-in: the modelled step",
    "s_step1": "stand-in: its replies built",
    "s_yield": "gRPC: to the router's reader",
    "deliver_first": "router: the replies delivered to their sessions (settling may interleave)",
    "deliver_last": "router: the outcomes left settled",
    "settle_last": "router: to the next step's drafting",
    "next_prep0": "router: the next step drafted",
}


def main(d: str) -> None:
    events = sorted(
        (float(t), n) for f in glob.glob(f"{d}/hops-*.txt") for n, t, _ in (line.split(" ", 2) for line in open(f))
    )
    sends = [i for i, (_, n) in enumerate(events) if n == "send0"]
    gaps: dict[str, list[float]] = {}
    for a, b in zip(sends, sends[1:]):
        t = timeline(events[a:b], events[b][0])
        if t is None:
            continue
        for k1, k2 in zip(HOPS, HOPS[1:]):
            gaps.setdefault(k1, []).append((t[k2] - t[k1]) * 1e3)
        gaps.setdefault("cycle", []).append((t["next_send0"] - t["send0"]) * 1e3)
        gaps.setdefault("exposed", []).append((t["next_send0"] - t["send0"] - t["s_step1"] + t["s_step0"]) * 1e3)
    print(
        f"{len(gaps.get('cycle', []))} steps\n\n| hop (from its stamp to the next) | median ms | p90 ms |\n|---|---|---|"
    )
    for k, v in gaps.items():
        v = sorted(v)
        print(f"| {WHAT.get(k, k)} | {statistics.median(v):.3f} | {v[int(len(v) * 0.9)]:.3f} |")


def timeline(seg: list, next_send: float) -> dict | None:
    """One step's stamps, each the first of its kind after the one before (None: incomplete)."""
    t = {"send0": seg[0][0]}
    last = t["send0"]
    for name in ("yield", "s_take0", "s_step0", "s_step1", "s_yield"):
        t[name] = next((x for x, n in seg if n == name and x >= last), None)
        if t[name] is None:
            return None
        last = t[name]
    delivered = [x for x, n in seg if n == "deliver" and x >= last]
    settled = [x for x, n in seg if n == "settle"]
    drafted = [x for x, n in seg if n == "prep0"]
    if not delivered or not settled or not drafted:
        return None
    t.update(deliver_first=delivered[0], deliver_last=delivered[-1], settle_last=settled[-1])
    t.update(next_prep0=drafted[-1], next_send0=next_send)
    return t


if __name__ == "__main__":
    main(sys.argv[1])
