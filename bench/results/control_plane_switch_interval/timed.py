"""Time pieces of the scheduler's turn in a live control-plane run (monkeypatched wrappers)."""
import sys, time, collections, atexit
from services.router import scheduler as S, engine as E
from services.drafter import suffix as SU
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); c = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t; cnt[key] += 1; acc[key+"_cpu"] += time.thread_time() - c
    setattr(obj, name, w)
wrap(S.Publisher, "hand", "hand")
wrap(S.Publisher, "drain", "drain")
wrap(S.Scheduler, "_settle", "settle")
wrap(S.Scheduler, "_prepare", "prepare")
wrap(S.Scheduler, "_send", "send")
wrap(SU.SuffixDrafter, "propose_batch", "propose_batch")
wrap(SU.SuffixDrafter, "_step_batch", "step_batch")
wrap(S.Scheduler, "_turn", "turn")
@atexit.register
def show():
    n = cnt["send"] or 1
    for k in sorted(acc):
        if k.endswith("_cpu"): cnt[k] = cnt[k[:-4]]
        print(f"{k:14s} calls {cnt[k]:7d}  per send-step {1e3*acc[k]/n:7.3f} ms", file=sys.stderr)
from bench.control_plane import main
sys.argv = ["control_plane"] + sys.argv[1:]
main()
