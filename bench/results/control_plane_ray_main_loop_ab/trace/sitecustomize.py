"""Timing of a Serve step call (a measuring probe, not product code).

With RAYHOPS=DIR and this folder on PYTHONPATH, the router stamps each step call to a verifier
replica (r0 before ``RayVerifier._on_replica``'s call, r1 once its outcomes are handed on) and the
replica stamps ``VerifierDeployment.step`` (v0 on entry, v1 on return) into DIR/h-PID.txt
(name, perf_counter seconds; the host's monotonic clock, shared by the processes).
``analyse.py DIR`` gives the medians per step."""

import os

_dir = os.environ.get("RAYHOPS")
if _dir:
    import atexit
    import builtins
    import sys
    import threading
    import time

    EVENTS: list = []

    def stamp(name: str) -> None:
        EVENTS.append((name, time.perf_counter()))

    def dump() -> None:
        with open(f"{_dir}/h-{os.getpid()}.txt", "a") as f:
            taken = EVENTS[:]
            del EVENTS[: len(taken)]
            f.writelines(f"{n} {t:.6f}\n" for n, t in taken)

    def flusher() -> None:  # Ray's workers end without atexit: written as it goes
        while True:
            time.sleep(0.5)
            dump()

    threading.Thread(target=flusher, daemon=True).start()
    atexit.register(dump)
    patched: set[str] = set()

    def patch() -> None:
        m = sys.modules.get("services.ray_app")
        if m is None or not hasattr(m, "RayVerifier"):
            return
        patched.add("ray_app")
        on_replica = m.RayVerifier._on_replica

        def stamped_on_replica(self, cycles, dones):
            stamp("r0")
            try:
                return on_replica(self, cycles, dones)
            finally:
                stamp("r1")

        m.RayVerifier._on_replica = stamped_on_replica
        cls = getattr(m.VerifierDeployment, "func_or_class", m.VerifierDeployment)
        step = cls.step

        async def stamped_step(self, items, home=""):
            stamp("v0")
            try:
                return await step(self, items, home)
            finally:
                stamp("v1")

        cls.step = stamped_step

    _import = builtins.__import__

    def importing(name, *a, **k):
        mod = _import(name, *a, **k)
        if "ray_app" not in patched:
            patch()
        return mod

    builtins.__import__ = importing
