"""Wall time per scheduler phase on the scheduler thread, per step (embedded)."""
import atexit, os, sys, time, threading
from collections import Counter
import services.router.scheduler as S
import services.router.engine as E

acc, calls = Counter(), Counter()

def wrap(cls, name, key=None):
    f = getattr(cls, name)
    key = key or name
    def g(*a, **k):
        if threading.current_thread().name != "scheduler":
            return f(*a, **k)
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
            calls[key] += 1
    setattr(cls, name, g)

wrap(S.Publisher, "drain")
wrap(S.Scheduler, "_settle")
wrap(S.Scheduler, "_take")
wrap(S.Scheduler, "_step")
wrap(S.Scheduler, "_send")
wrap(S.Scheduler, "_turn")
wrap(E.Generation, "apply")
wrap(S.Scheduler, "_prepare")
import services.drafter.suffix as SX
wrap(SX.SuffixDrafter, "propose_batch")
wrap(SX.SuffixDrafter, "_step_cache")
wrap(SX.SuffixDrafter, "_draft")
wrap(SX.SuffixDrafter, "observe")
_sb = SX.step_batch
def sb(*a, **k):
    calls["mode2"] += sum(1 for m in a[7] if m == 2); calls["mode1"] += sum(1 for m in a[7] if m == 1); calls["mode0"] += sum(1 for m in a[7] if m == 0)
    calls["pending_tokens"] += sum(len(x) for x in a[3]); calls["carries_tokens"] += sum(len(x) for x in a[5])
    if os.environ.get("WORKERS"): a = a[:-1] + (int(os.environ["WORKERS"]),)
    t = time.perf_counter(); r = _sb(*a, **k); acc["step_batch(C)"] += time.perf_counter() - t; calls["step_batch(C)"] += 1; return r
SX.step_batch = sb
wrap(E.Generation, "_request")
wrap(E.Generation, "_budget")
wrap(E.Generation, "_take")
import bench.control_plane as cp
orig_step = cp.StandInCore._step
last = {}
def st(self, batch):
    t, c = time.perf_counter(), time.thread_time()
    if last:
        acc["gap_wall"] += t - last["t"]; acc["gap_cpu"] += c - last["c"]; calls["gap_wall"] += 1; calls["gap_cpu"] += 1
    orig_step(self, batch); acc["standin"] += time.perf_counter() - t; calls["standin"] += 1
    acc["overshoot"] += (time.perf_counter() - t) - self.log[-1][1]; calls["overshoot"] += 1
    last["t"], last["c"] = time.perf_counter(), time.thread_time()
cp.StandInCore._step = st

@atexit.register
def report():
    n = calls["_send"] or 1
    print(f"steps {n}", file=sys.stderr)
    from services.drafter import _suffix_tree as C
    print("tok act new mat local_ns global_ns per step", [x / n for x in C.stats()], file=sys.stderr)
    print("compute us/step", C.compute_ns() / 1000 / n, "phase1", C.p1_ns() / 1000 / n, file=sys.stderr)
    print({k: round(v / n, 1) for k, v in calls.items() if k.startswith(("mode", "pend", "carr"))}, file=sys.stderr)
    for k, v in sorted(acc.items(), key=lambda x: -x[1]):
        print(f"  {k:10s} {v / n * 1e6:9.0f} us/step  calls/step {calls[k] / n:6.1f}", file=sys.stderr)

import os
if os.environ.get("SWI"): sys.setswitchinterval(float(os.environ["SWI"]))
sys.argv = ["control_plane"] + sys.argv[1:]
sys.exit(cp.main())
