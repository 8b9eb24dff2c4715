"""1,000 streams through a router and two verifier processes, a third of them cancelled by the
client after a random number of messages and a third given deadlines that may pass mid-stream:
every stream ends OK, CANCELLED or DEADLINE_EXCEEDED, no session is left on the router or a
replica, and no process's memory grows past its warm-up."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from specmesh.v1 import generate_pb2 as gpb
from tests.fleet import active, router, start_verifier, stop

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    pass\n", "x = [1, 2", "for i in range(10):"]
ENDINGS = {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def one_stream(stub, i: int) -> grpc.StatusCode:
    rng = random.Random(i)
    kind = i % 3  # 0: to the end, 1: cancelled by the client, 2: a deadline
    req = gpb.GenerateRequest(
        prompt=rng.choice(PROMPTS),
        max_new_tokens=rng.randint(4, 32),
        method=rng.choice(["sd", "vanilla", "suffix", "hybrid"]),
        temperature=rng.choice([0.0, 0.0, 0.8]),
    )
    call = stub.Generate(req, timeout=rng.uniform(0.02, 0.5) if kind == 2 else 60)
    try:
        stop_after = rng.randint(0, 3) if kind == 1 else None
        for n, _ in enumerate(call):
            if stop_after is not None and n >= stop_after:
                call.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_a_thousand_streams_with_cancels_and_deadlines_leave_nothing_behind(tiny_dirs):
    import os

    procs, addrs = zip(*[start_verifier(tiny_dirs) for _ in range(2)])
    engine, server, servicer, stub = router(tiny_dirs, list(addrs))
    pids = {"router": os.getpid(), **{f"verifier{i}": p.pid for i, p in enumerate(procs)}}
    seen: dict[grpc.StatusCode, int] = {}
    lock = threading.Lock()

    def run(batch: range) -> None:
        with ThreadPoolExecutor(16) as pool:
            for code in pool.map(lambda i: one_stream(stub, i), batch):
                with lock:
                    seen[code] = seen.get(code, 0) + 1

    try:
        run(range(0, 200))  # warm-up: caches, pools and allocators reach their working size
        time.sleep(1.0)
        warm = {name: rss_mb(pid) for name, pid in pids.items()}
        run(range(200, 1000))
        time.sleep(1.0)
        after = {name: rss_mb(pid) for name, pid in pids.items()}
        print("streams by ending:", {c.name: n for c, n in seen.items()}, "RSS MB warm", warm, "after", after)
        assert set(seen) <= ENDINGS and sum(seen.values()) == 1000
        assert all(seen.get(c, 0) > 50 for c in ENDINGS), seen  # each ending was exercised
        deadline = time.monotonic() + 30
        while (
            servicer.admission.running or len(servicer.active) or any(map(active, addrs))
        ) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert servicer.admission.running == 0 and len(servicer.active) == 0
        assert [active(a) for a in addrs] == [0, 0]
        for name in pids:  # flat: 800 more streams after the warm-up grew no process by more than 8 %
            assert after[name] < warm[name] * 1.08, (name, warm[name], after[name])
    finally:
        server.stop(0)
        engine.close()
        stop(list(procs))
