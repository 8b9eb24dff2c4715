"""Child processes that serve for their parent: started and waited for until they serve (or the
start fails, loudly), restarted with backoff when one dies later, stopped together. Each child
exits by itself when its parent dies (``exit_with_parent``), so a router killed with SIGKILL leaves
no orphan holding a port."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.common.metrics import VERIFIER_RESTARTS
from services.common.runtime import stop_processes

log = logging.getLogger("specmesh.supervisor")

PARENT_ENV = "SPECMESH_PARENT_PID"  # a supervised child exits when this process is gone


class StartFailed(RuntimeError):
    """A child exited, or did not serve in time, while starting."""


@dataclass
class Child:
    name: str  # what it serves, for messages (its address)
    command: Sequence[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0  # monotonic time of the latest start
    restarts: int = 0  # deaths in a row (reset once it has served for a minute)
    restart_at: float | None = None  # dead: restarted at this monotonic time


class Supervisor:
    """Keeps ``children`` running. ``ready(name, timeout_s)`` says whether a child serves now."""

    def __init__(
        self,
        children: list[Child],
        env: Mapping[str, str],
        ready: Callable[[str, float], bool],
        start_timeout_s: float = 600.0,
        backoff_s: tuple[float, float] = (1.0, 30.0),
    ):
        self.children, self.ready = children, ready
        self.env = {**env, PARENT_ENV: str(os.getpid())}
        self.start_timeout_s, self.backoff_s = start_timeout_s, backoff_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start every child and wait until each serves; ``StartFailed`` (all stopped) if one
        exits first or does not serve within ``start_timeout_s``. Then keep them running."""
        for c in self.children:
            c.proc, c.started = subprocess.Popen(c.command, env=self.env), time.monotonic()
        try:
            for c in self.children:
                self._await_serving(c)
        except StartFailed:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._keep, name="supervisor", daemon=True)
        self._thread.start()

    def _await_serving(self, c: Child) -> None:
        end = time.monotonic() + self.start_timeout_s
        assert c.proc is not None
        while not self.ready(c.name, 1.0):
            if (rc := c.proc.poll()) is not None:
                raise StartFailed(f"{c.name}: exited with status {rc} while starting (its log is above)")
            if time.monotonic() > end:
                raise StartFailed(f"{c.name}: not serving {self.start_timeout_s:.0f} s after its start")
            time.sleep(0.2)

    def _keep(self) -> None:
        """Restart a child that died, after a backoff that doubles with each death in a row
        (reset once it has served for a minute)."""
        while not self._stopping.wait(0.5):
            for c in self.children:
                self._tend(c)

    def _tend(self, c: Child) -> None:
        assert c.proc is not None
        now = time.monotonic()
        if (rc := c.proc.poll()) is None:
            if c.restarts and now - c.started > 60:
                c.restarts = 0
        elif c.restart_at is None:
            delay = min(self.backoff_s[1], self.backoff_s[0] * 2**c.restarts)
            c.restart_at = now + delay
            log.error("%s exited with status %s; restarting it in %.0f s", c.name, rc, delay)
        elif now >= c.restart_at and not self._stopping.is_set():
            c.restarts, c.restart_at, c.started = c.restarts + 1, None, now
            VERIFIER_RESTARTS.inc()
            c.proc = subprocess.Popen(c.command, env=self.env)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop restarting, then ask every child to exit (SIGTERM: they drain) and wait."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        stop_processes([c.proc for c in self.children if c.proc is not None], timeout_s)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """When ``SPECMESH_PARENT_PID`` names this process's parent, send ourselves SIGTERM (a graceful
    drain) once that parent is gone: a supervised child does not outlive the process serving
    through it. Checked by polling the parent id, which changes when the parent dies."""
    parent = os.environ.pop(PARENT_ENV, "")  # not inherited by processes this one starts
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_s)
        log.warning("parent process %s is gone; shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
