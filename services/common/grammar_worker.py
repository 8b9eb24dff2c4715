"""The process that compiles structured-output patterns (outlines-core ``Index``), so a
pattern whose automaton explodes costs a killed worker, not a stalled server.

Rule: a compilation gets ``timeout_s`` seconds and an address-space cap; past either the
worker is killed (and respawned for the next pattern) and the pattern is refused as too
complex. The child imports only outlines-core.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path


def _serve(conn: Connection, memory_bytes: int) -> None:
    import resource

    from outlines_core import Index

    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    vocabulary = pickle.loads(conn.recv_bytes())
    while True:
        try:
            pattern = conn.recv()
        except EOFError:  # the server went away
            return
        if pattern is None:
            return
        try:
            conn.send((True, pickle.dumps(Index(pattern, vocabulary))))
        except (ValueError, TypeError, MemoryError) as e:
            conn.send((False, f"{type(e).__name__}: {e}"))


class CompileTimeout(RuntimeError):
    """The pattern's automaton did not build within the time or memory allowed."""


class IndexWorker:
    """One compile process per vocabulary, started on first use; one pattern at a time."""

    def __init__(self, vocabulary, timeout_s: float = 10.0, memory_bytes: int = 4 << 30):
        self.blob = pickle.dumps(vocabulary)
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def compile(self, pattern: str):
        """The pattern's ``Index``; ValueError for a bad pattern, CompileTimeout past the limits."""
        with self._lock:
            conn = self._connection()
            conn.send(pattern)
            if not conn.poll(self.timeout_s):
                self._kill()
                raise CompileTimeout(f"its automaton did not build within {self.timeout_s:g} s")
            try:
                ok, payload = conn.recv()
            except EOFError:  # the worker died (the address-space cap)
                self._kill()
                raise CompileTimeout("its automaton outgrew the compile worker's memory") from None
        if not ok:
            raise ValueError(payload)
        return pickle.loads(payload)

    def _connection(self) -> Connection:
        """The worker's end of a socket pair; a fresh interpreter running this module (not a
        fork of a threaded server, and independent of the caller's ``__main__``)."""
        if self._proc is None or self._proc.poll() is not None:
            ours, theirs = socket.socketpair()
            root = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "services.common.grammar_worker", str(theirs.fileno()), str(self.memory_bytes)],
                pass_fds=[theirs.fileno()],
                env=env,
            )
            theirs.close()
            self._conn = Connection(ours.detach())
            self._conn.send_bytes(self.blob)
        assert self._conn is not None  # made with the process above
        return self._conn

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
            self._kill()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
