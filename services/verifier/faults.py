"""Fault injection for failure tests only, read from the environment when a verifier starts
(a server, a Ray replica). Unset, every delay is 0 and nothing changes."""

from __future__ import annotations

import os


def _ms(name: str) -> float:
    return float(os.environ.get(name, "0")) / 1000


def cycle_delay_s() -> float:
    """SPECMESH_FAULT_CYCLE_DELAY_MS: every cycle the gRPC servicer takes waits this long first
    (a hung or slow replica)."""
    return _ms("SPECMESH_FAULT_CYCLE_DELAY_MS")


def chunk_delay_s() -> float:
    """SPECMESH_FAULT_CHUNK_DELAY_MS: every step that feeds a prompt's next chunk waits this long
    first, so a test can cancel a prefill in flight whatever the host's speed."""
    return _ms("SPECMESH_FAULT_CHUNK_DELAY_MS")
