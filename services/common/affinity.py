"""Prefix affinity (cache-aware placement, as SGLang's router does it): the router's guess of
which verifier replica holds a prompt's start in its prefix cache, so that a new session can
go where its start is already verified instead of being prefilled again elsewhere.

The guess is the replica each block of a prompt's start was last placed on: block keys chain
the tokens of every block before them, so a replica that was given block j of this prompt's
start was given blocks 0..j-1 with it. It is a guess: a replica may have evicted the blocks
since, and a wrong guess costs a prefill, never an output. Bounded LRU over block keys.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping


class PrefixAffinity:
    def __init__(self, block: int = 32, capacity: int = 1 << 16):
        self.block, self.capacity = block, capacity
        self._where: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def _keys(self, tokens: list[int], salt: str) -> list[int]:
        keys, parent = [], hash(salt)  # blocks are shared only within a cache salt
        for b0 in range(0, len(tokens) - self.block, self.block):  # a prompt's newest token is never cached
            parent = hash((parent, tuple(tokens[b0 : b0 + self.block])))
            keys.append(parent)
        return keys

    def holders(self, tokens: list[int], salt: str = "") -> dict[str, int]:
        """Replica → how many leading blocks of ``tokens`` it was last given."""
        held: dict[str, int] = {}
        with self._lock:
            for j, key in enumerate(self._keys(tokens, salt), 1):
                addr = self._where.get(key)
                if addr is None:
                    break
                held[addr] = j
        return held

    def placed(self, tokens: list[int], addr: str, salt: str = "") -> None:
        """A session with ``tokens`` opened on ``addr``: its blocks will be there."""
        with self._lock:
            for key in self._keys(tokens, salt):
                self._where[key] = addr
                self._where.move_to_end(key)
            while len(self._where) > self.capacity:
                self._where.popitem(last=False)

    def forget(self, addr: str) -> None:
        """A replica is gone (or restarted): nothing is held there any more."""
        with self._lock:
            for key in [k for k, a in self._where.items() if a == addr]:
                del self._where[key]


def choose(live: list[str], load: dict[str, int], held: dict[str, int], slack: int) -> str:
    """Among the replicas within ``slack`` sessions of the least loaded, the one holding the
    longest start of the prompt; with none holding any, the least loaded (first on ties)."""
    lo = min(load[a] for a in live)
    near = [a for a in live if load[a] <= lo + slack]
    return max(near, key=lambda a: (held.get(a, 0), -load[a]))


def unreported(
    placed: Mapping[str, tuple[str, float]], reported: Mapping[str, tuple[float, Iterable[str]]], lag: float
) -> list[str]:
    """Sessions this router placed (session → (replica, when)) that their replica's report
    (replica → (when taken, sessions)) does not list though it was taken more than ``lag``
    after the placement: closed without this router's close (a cancel). A report older than
    that proves nothing: the replica may not have run the open yet, or a busy replica's
    report may be late."""
    listed = {a: (at, set(s)) for a, (at, s) in reported.items()}
    return [s for s, (a, t) in placed.items() if a in listed and listed[a][0] - t > lag and s not in listed[a][1]]


def session_loads(
    live: Iterable[str], reported: Mapping[str, Iterable[str]], placed: Mapping[str, str], closed: Container[str]
) -> dict[str, int]:
    """Open sessions per replica, as one of several routers sees them: those the replica's last
    report lists (every router's), less those this router closed since, plus those it placed
    there since (a report lags by its period)."""
    mine: dict[str, set[str]] = {}
    for sid, addr in placed.items():
        mine.setdefault(addr, set()).add(sid)
    return {a: len({s for s in reported.get(a, ()) if s not in closed} | mine.get(a, set())) for a in live}
