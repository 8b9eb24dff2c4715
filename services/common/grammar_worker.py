"""The process that compiles structured-output patterns (outlines-core ``Index``) and expands
JSON schemas into them, so a pattern whose automaton explodes, or a schema whose ``$ref``s fan
out into gigabytes of regex, costs a killed worker, not a stalled server.

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
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary = pickle.loads(conn.recv_bytes())
    while True:
        try:
            ask = conn.recv()
        except EOFError:  # the server went away
            return
        if ask is None:
            return
        try:
            if ask[0] == "schema":  # ("schema", schema, most characters its regex may have)
                regex = build_regex_from_schema(ask[1])
                if len(regex) > ask[2]:
                    raise OverflowError(f"its regex has {len(regex)} characters, at most {ask[2]}")
                conn.send((True, regex))
            else:  # ("index", pattern)
                conn.send((True, pickle.dumps(Index(ask[1], vocabulary))))
        except OverflowError as e:
            conn.send((False, ("long", str(e))))
        except (ValueError, TypeError, MemoryError) as e:
            conn.send((False, ("bad", f"{type(e).__name__}: {e}")))


class CompileTimeout(RuntimeError):
    """The pattern's automaton did not build within the time or memory allowed."""


class RegexTooLong(ValueError):
    """A JSON schema's regex has more characters than the caller allows."""


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
        return pickle.loads(self._ask(("index", pattern), "its automaton"))

    def schema_regex(self, schema: str, max_chars: int) -> str:
        """The regex a JSON schema expands to; ValueError for a schema that cannot be used,
        RegexTooLong for one whose regex has more than ``max_chars`` characters, CompileTimeout
        past the limits."""
        return self._ask(("schema", schema, max_chars), "its regex")

    def _ask(self, ask: tuple, what: str):
        with self._lock:
            conn = self._connection()
            conn.send(ask)
            if not conn.poll(self.timeout_s):
                self._kill()
                raise CompileTimeout(f"{what} did not build within {self.timeout_s:g} s")
            try:
                ok, payload = conn.recv()
            except EOFError:  # the worker died (the address-space cap)
                self._kill()
                raise CompileTimeout(f"{what} outgrew the compile worker's memory") from None
        if not ok:
            kind, message = payload
            raise RegexTooLong(message) if kind == "long" else ValueError(message)
        return payload

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
