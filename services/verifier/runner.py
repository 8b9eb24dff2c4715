"""Target runner: owns the target model, each session's KV cache and its rollback.

Invariant per session: ``cache_len`` tokens of ``tokens`` have K/V in the cache; at least
the newest committed token is still pending. A verification pass feeds the pending tokens
plus the draft in one forward; committing a verdict keeps the K/V of the accepted draft
prefix and drops the rest (rollback = not advancing ``cache_len``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from services.common.llama import KVCache, Llama
from services.common.metrics import VERIFY_BATCH
from services.common.types import Verdict


@dataclass
class TargetSession:
    tokens: list[int]
    cache: KVCache
    cache_len: int = 0

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cache_len:]


@dataclass
class _Pending:
    session: TargetSession
    tokens: list[int]
    n_pending: int
    result: tuple | None = None
    error: BaseException | None = None
    done: bool = False


class TargetRunner:
    """Verification forwards for all sessions of a replica.

    Batching rule (leader/follower): a session submitting a verification joins the pending
    list; if no batch is running it leads — waits up to ``batch_window_s`` for the other open
    sessions to submit, runs one ragged forward for up to ``max_batch`` of them (shared
    weight reads, per-session attention and KV cache), hands out the results — else it
    waits to be served. A lone session never waits.
    """

    def __init__(self, model: Llama, capture_layers: tuple[int, ...] = (), max_batch: int = 16,
                 batch_window_s: float = 0.002):
        self.model = model
        self.capture_layers = capture_layers
        self.device = next(model.parameters()).device
        self.max_batch, self.batch_window_s = max_batch, batch_window_s
        self.open_sessions = 0
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._running = False

    @property
    def max_positions(self) -> int:
        return self.model.s.max_positions

    def open(self, prompt: list[int], capacity: int) -> TargetSession:
        with self._cond:
            self.open_sessions += 1
        return TargetSession(tokens=list(prompt), cache=self.model.new_cache(1, min(capacity, self.max_positions)))

    def close(self, st: TargetSession) -> None:
        with self._cond:
            self.open_sessions -= 1
            self._cond.notify_all()

    def verify(self, st: TargetSession, draft: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Target logits [k+1, V] for the draft positions (row k = bonus) and the captured
        hidden states [len(pending) + k, H] of the fed positions, one per capture layer."""
        item = _Pending(st, st.pending + draft, len(st.pending))
        with self._cond:
            self._queue.append(item)
            self._cond.notify_all()
            while not item.done:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                end = time.perf_counter() + self.batch_window_s
                while len(self._queue) < min(self.open_sessions, self.max_batch) and time.perf_counter() < end:
                    self._cond.wait(end - time.perf_counter())
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                self._cond.release()
                try:
                    self._run(batch)
                finally:
                    self._cond.acquire()
                    self._running = False
                    for b in batch:
                        b.done = True
                    self._cond.notify_all()
        if item.error is not None:
            raise item.error
        return item.result

    @torch.inference_mode()
    def _run(self, batch: list[_Pending]) -> None:
        VERIFY_BATCH.observe(len(batch))
        try:
            logits, hidden = self.model.forward_ragged(
                [b.tokens for b in batch], [b.session.cache_len for b in batch],
                [b.session.cache for b in batch], self.capture_layers)
        except BaseException as e:  # every waiter sees the failure
            for b in batch:
                b.error = e
            return
        for b, lg, hs in zip(batch, logits, hidden):
            b.result = (lg[b.n_pending - 1:].float().cpu(), [h[None] for h in hs])

    @staticmethod
    def commit(st: TargetSession, verdict: Verdict) -> None:
        st.cache_len += len(st.pending) + verdict.accepted
        st.tokens.extend(verdict.tokens)
