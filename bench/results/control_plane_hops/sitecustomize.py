"""Hop timing of the distributed round trip (a measuring probe, not product code).

With SPECMESH_HOPS=DIR and this folder on PYTHONPATH, every Python process started (the router's
bench and its stand-in verifier) stamps the hops of each step into DIR/hops-PID.txt (name,
perf_counter seconds, thread): the router's drafting (prep0/prep1), the step handed to the
backend (send0/send1), the Link message leaving (yield: built by gRPC's request iterator), the
stand-in taking it (s_take0/s_take1), its modelled step (s_step0/s_step1), its reply message
(s_yield), each reply the router's reader delivers (deliver) and each outcome the scheduler
settles (settle). The clock is the host's monotonic one, shared by both processes.
``analyse.py DIR`` gives the medians per hop.
"""

import os

_dir = os.environ.get("SPECMESH_HOPS")
if _dir:
    import atexit
    import builtins
    import sys
    import threading
    import time

    EVENTS: list = []

    def stamp(name: str) -> None:
        EVENTS.append((name, time.perf_counter(), threading.current_thread().name))

    def dump() -> None:
        with open(f"{_dir}/hops-{os.getpid()}.txt", "a") as f:
            taken = EVENTS[:]
            del EVENTS[: len(taken)]
            f.writelines(f"{n} {t:.6f} {th}\n" for n, t, th in taken)

    def flusher() -> None:  # the stand-in ends by SIGTERM (os._exit): written as it goes
        while True:
            time.sleep(0.5)
            dump()

    threading.Thread(target=flusher, daemon=True).start()
    atexit.register(dump)

    def wrap(cls, name: str, before: str, after: str | None = None) -> None:
        f = getattr(cls, name)

        def stamped(*a, **k):
            stamp(before)
            try:
                return f(*a, **k)
            finally:
                if after:
                    stamp(after)

        setattr(cls, name, stamped)

    class Stamping:
        """A module's attributes, with ``name`` (a message class) stamped when built."""

        def __init__(self, mod, name: str, tag: str):
            self._mod, self._name, self._tag = mod, name, tag

        def __getattr__(self, a):
            v = getattr(self._mod, a)
            if a != self._name:
                return v

            def build(*x, **k):
                stamp(self._tag)
                return v(*x, **k)

            return build

    def patch(m, name: str) -> bool:
        if name == "services.router.scheduler" and hasattr(m, "Scheduler"):
            wrap(m.Scheduler, "_prepare", "prep0", "prep1")
            wrap(m.Scheduler, "_settle", "settle")
        elif name == "services.verifier.client" and hasattr(m, "ReplicaLink"):
            wrap(m.RemoteVerifier, "step", "send0", "send1")
            if hasattr(m.ReplicaLink, "_deliver_all"):  # a message's replies at once (e6dc02d on)
                wrap(m.ReplicaLink, "_deliver_all", "deliver", "deliver")
            else:
                wrap(m.ReplicaLink, "_deliver", "deliver")
            m.pb = Stamping(m.pb, "LinkRequest", "yield")
        elif name == "services.verifier.grpc_server" and hasattr(m, "LinkServer"):
            wrap(m.LinkServer, "_take", "s_take0", "s_take1")
            m.pb = Stamping(m.pb, "LinkResponse", "s_yield")
        elif name in ("bench.control_plane", "__main__") and hasattr(m, "StandInCore"):
            wrap(m.StandInCore, "_step", "s_step0", "s_step1")
        else:
            return False
        return True

    NAMES = ["services.router.scheduler", "services.verifier.client", "services.verifier.grpc_server"]
    NAMES += ["bench.control_plane", "__main__"]
    patched: set[str] = set()
    busy: list[int] = []
    _import = builtins.__import__

    def importing(name, *a, **k):
        r = _import(name, *a, **k)
        if not busy:  # (patching imports nothing, but guard anyway)
            busy.append(1)
            try:
                for n in NAMES:
                    if n not in patched and (m := sys.modules.get(n)) is not None and patch(m, n):
                        patched.add(n)
            finally:
                busy.pop()
        return r

    builtins.__import__ = importing
