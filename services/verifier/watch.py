"""Which verifier replicas the router may use now (pure: no gRPC).

A replica is *hung* when a cycle takes longer than its budget: ``max(floor_s, factor x`` the
slowest cycle it answered lately``)``, the slowest decaying by ``decay`` per cycle so that one slow
step does not widen the budget for good, plus ``prefill_s_per_token`` for each prompt token a
session's first cycle prefills (a 100,000-token prompt: 100 s more; first cycles are not counted
in the pace). A hung or unreachable replica is left out of placement
(quarantined) for a while that doubles on each failure in a row, up to ``max_quarantine_s``. When
its quarantine ends it is let back in, unless a health probe finds it still not answering; a cycle
it answers ends the run of failures, one it fails puts it back out for twice as long."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class _State:
    slowest_s: float = 0.0  # decayed maximum of answered cycles' seconds
    out_until: float = 0.0  # left out of placement until this monotonic time
    quarantine_s: float = 0.0  # the last quarantine's length (doubles on failures in a row)


@dataclass
class ReplicaWatch:
    floor_s: float = 10.0
    factor: float = 10.0
    prefill_s_per_token: float = 0.001  # generous: a long prompt's prefill is not a hang
    decay: float = 0.99
    first_quarantine_s: float = 1.0
    max_quarantine_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _states: dict[str, _State] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.floor_s <= 0:
            raise ValueError(f"verifier timeout: expected seconds > 0, got {self.floor_s}")

    def _s(self, addr: str) -> _State:
        return self._states.setdefault(addr, _State())

    def budget(self, addr: str, prefill: int = 0) -> float:
        """Seconds a cycle on ``addr`` may take before the replica counts as hung; a cycle that
        prefills ``prefill`` tokens (a session's first) gets ``prefill_s_per_token`` more each."""
        return max(self.floor_s, self.factor * self._s(addr).slowest_s) + prefill * self.prefill_s_per_token

    def answered(self, addr: str, seconds: float) -> None:
        """A cycle on ``addr`` took ``seconds``: it is alive, and its budget follows its pace."""
        s = self._s(addr)
        s.slowest_s = max(seconds, s.slowest_s * self.decay)
        s.quarantine_s = 0.0

    def failed(self, addr: str) -> float:
        """``addr`` hung or could not be reached: left out for the next quarantine (returned)."""
        s = self._s(addr)
        s.quarantine_s = min(self.max_quarantine_s, max(self.first_quarantine_s, 2 * s.quarantine_s))
        s.out_until = self.clock() + s.quarantine_s
        return s.quarantine_s

    def probed(self, addr: str, answers: bool) -> None:
        """A health probe of ``addr``: one that does not answer once its quarantine is over is
        left out again (for twice as long), so only a replica that answers comes back in."""
        if not answers and self.usable(addr):
            self.failed(addr)

    def usable(self, addr: str) -> bool:
        return self.clock() >= self._s(addr).out_until

    def out(self, addrs: Iterable[str]) -> set[str]:
        """Those of ``addrs`` left out of placement now."""
        return {a for a in addrs if not self.usable(a)}
