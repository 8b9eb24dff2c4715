"""Process-wide runtime settings applied by every `specmesh` entry point."""

from __future__ import annotations

import gc
import socket


def tune_gc() -> None:
    """Raise the cyclic collector's thresholds.

    Suffix trees are millions of small long-lived linked objects; at the default gen-0
    threshold (700) the collector rescans them constantly and a tree update costs ~5×
    more (measured: 27 → 5.6 µs per update token). Nothing here relies on prompt cycle
    collection, so collect far less often.
    """
    gc.set_threshold(50_000, 20, 20)


def freeze_startup_heap() -> None:
    """Move every object alive once start-up is done into the collector's permanent generation.

    Imported modules (torch, transformers, grpc) and loaded models leave a few hundred thousand
    long-lived objects; each full collection walks all of them, and on the serving path those
    pauses land inside decoding cycles. Frozen objects are never scanned again; what serving
    creates (suffix-tree nodes, sessions) is still collected as usual. Call it once, right
    before serving. ``SPECMESH_GC_FREEZE=0`` turns it off (for A/B measurements).
    Measured (``bench/results/gc_freeze.md``): a full collection of a loaded engine process
    takes ~222 ms unfrozen, ~0 ms frozen.
    """
    import os

    if os.environ.get("SPECMESH_GC_FREEZE", "1") == "0":
        return
    gc.collect()
    gc.freeze()


def stop_processes(procs, timeout_s: float = 60.0) -> None:
    """Ask child processes (``subprocess.Popen``) to exit (SIGTERM: serving processes drain),
    all at once; kill any still running ``timeout_s`` later."""
    import subprocess

    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (tests, benchmarks, local multi-process topologies)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
