"""Micro-measures quoted in docs/decisions.md for a step's per-session work, one run on this
machine: ``PYTHONPATH=. python bench/results/step_micro_link/micro.py`` writes micro.{json,md} here.

- a hybrid step's cost plans: 64 drafts each planned alone (``CycleCosts.plan``) and at once
  (``plan_all``);
- a step's deadlines: 64 added and cancelled one by one, and at once (``Deadlines.add_all``,
  ``cancel_all``);
- the Link's protobuf work per session: a cycle item built and read, a plain result's reply built
  and read, and a 64-reply message parsed (what a columnar message could save at most)."""

import json
import random
import timeit
from pathlib import Path

from services.common.types import CycleRequest, CycleResult
from services.drafter.hybrid import CACHE, MODEL, PLAIN, CycleCosts
from services.verifier import wire
from services.verifier.backend import Deadlines
from specmesh.v1 import verifier_pb2 as pb

HERE = Path(__file__).parent


def us(fn, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def costs() -> CycleCosts:
    rng = random.Random(5)
    c = CycleCosts(warmup=4)
    for _ in range(40):
        n = rng.randint(1, 16)
        c.record(CACHE, rng.randint(1, n + 1), 0.008 + 0.001 * n, n)
        c.record(MODEL, 2, 0.007, gap=2)
        c.record(PLAIN, 1, 0.006)
    return c


def main() -> None:
    out: dict = {"command": "PYTHONPATH=. python bench/results/step_micro_link/micro.py"}
    c, rng = costs(), random.Random(6)
    asks = [(rng.randint(1, 16), MODEL) for _ in range(64)]
    out["plan_64_alone_us"] = us(lambda: [c.plan(n, f) for n, f in asks], 500)
    out["plan_64_at_once_us"] = us(lambda: c.plan_all(asks), 500)
    d = Deadlines()
    fns = [lambda: None] * 64
    out["deadlines_64_one_by_one_us"] = us(lambda: [d.cancel(e) for e in [d.add(30.0, f) for f in fns]], 200)
    out["deadlines_64_at_once_us"] = us(lambda: d.cancel_all(d.add_all([(30.0, f) for f in fns])), 200)
    d.close()
    req = CycleRequest(draft_ids=(1, 2, 3, 4, 5, 6, 7, 8), draft_source="suffix", budget=8)
    item = pb.LinkItem(session_id="s-123", cycle=wire.cycle_to_pb(req))
    res = CycleResult(committed=[1, 2, 3], drafted=8, accepted=2, source="suffix", verify_s=0.01, server_s=0.02, batch_size=64)
    reply = pb.LinkReply(session_id="s-123", result=wire.result_to_pb(res))
    out["cycle_item_built_us"] = us(lambda: pb.LinkItem(session_id="s-123", cycle=wire.cycle_to_pb(req)), 5000)
    out["cycle_item_read_us"] = us(lambda: (item.WhichOneof("kind"), wire.cycle_from_pb(item.cycle)), 5000)
    out["reply_built_us"] = us(lambda: pb.LinkReply(session_id="s-123", result=wire.result_to_pb(res)), 5000)
    out["reply_read_us"] = us(lambda: wire.result_from_pb(reply.result), 5000)
    out["cycle_result_init_us"] = us(lambda: CycleResult(committed=[1, 2, 3], drafted=8, accepted=2, source="suffix"), 5000)
    raw = pb.LinkResponse(replies=[reply] * 64).SerializeToString()
    out["reply_message_64_parsed_us"] = us(lambda: list(pb.LinkResponse.FromString(raw).replies), 500)
    (HERE / "micro.json").write_text(json.dumps(out, indent=1) + "\n")
    md = "\n".join(
        [f"Command: `{out['command']}`", "", "| measure | µs |", "|---|---|"]
        + [f"| {k[:-3].replace('_', ' ')} | {v:.1f} |" for k, v in out.items() if k.endswith("_us")]
    )
    (HERE / "micro.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
