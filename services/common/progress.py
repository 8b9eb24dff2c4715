"""Long offline work (traces, calibration, batch inference, batch files): items run with a
bounded number in flight, and their progress: items done of a total, with a rate and an ETA,
as tqdm's bar where asked and installed, else a line on stderr (every ``every_s`` seconds and
at the end). Safe to advance from several threads."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


class Progress:
    def __init__(
        self,
        total: int,
        label: str,
        unit: str,
        bar: bool = False,
        every_s: float = 5.0,
        status: Callable[[], str] = lambda: "",
    ):
        """``status``: appended to each line (e.g. the correction memory's size)."""
        self.total, self.label, self.unit, self.every_s, self.status = total, label, unit, every_s, status
        self.done = self.failed = self.tokens = 0
        self.start = self.last = time.perf_counter()
        self._lock = threading.Lock()
        self.bar = None
        if bar:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=label, unit=unit, dynamic_ncols=True)
            except ImportError:
                pass

    def advance(self, tokens: int = 0, failed: bool = False) -> None:
        with self._lock:
            self.done, self.tokens, self.failed = self.done + 1, self.tokens + tokens, self.failed + failed
            now = time.perf_counter()
            el = max(1e-9, now - self.start)
            if self.bar is not None:
                self.bar.set_postfix_str(f"output {self.tokens / el:.0f} tok/s", refresh=False)
                self.bar.update(1)
            elif now - self.last >= self.every_s or self.done == self.total:
                self.last = now
                failed_part = f" ({self.failed} failed)" if self.failed else ""
                tokens_part = f", {self.tokens / el:.0f} output tok/s" if self.tokens else ""
                print(
                    f"[{self.label}] {self.done}/{self.total} {self.unit}{failed_part}{self.status()}, "
                    f"{self.done / el:.2f}/s"
                    f"{tokens_part}, ETA {(self.total - self.done) * el / self.done:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_concurrently(
    fn,
    items,
    concurrency: int,
    label: str,
    unit: str = "prompts",
    progress: bool = True,
    bar: bool = False,
    every_s: float = 0.0,
    status: Callable[[], str] = lambda: "",
    tokens: Callable = lambda out: 0,
    failed: Callable = lambda out: False,
) -> list:
    """``[fn(x) for x in items]`` with ``concurrency`` in flight (the verifier batches their
    cycles), in order; ``tokens(out)`` and ``failed(out)`` feed the progress line."""
    items = list(items)
    prog = Progress(len(items), label, unit, bar, every_s, status) if progress else None

    def one(x):
        out = fn(x)
        if prog is not None:
            prog.advance(tokens(out), failed(out))
        return out

    try:
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            return list(pool.map(one, items))
    finally:
        if prog is not None:
            prog.close()
