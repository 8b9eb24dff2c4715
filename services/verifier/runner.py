"""Target runner: owns the target model, each session's KV cache and its rollback.

Invariant per session: ``cache_len`` tokens of ``tokens`` have K/V in the cache; at least
the newest committed token is still pending. A verification pass feeds the pending tokens
plus the draft in one forward; committing a verdict keeps the K/V of the accepted draft
prefix and drops the rest (rollback = not advancing ``cache_len``).

The runner is not thread-safe: one caller at a time (the verifier's ``CycleBatcher``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.llama import KVCache, Llama
from services.common.metrics import PREFILL_CHUNKS, VERIFY_BATCH
from services.common.types import Verdict


@dataclass
class TargetSession:
    tokens: list[int]
    cache: KVCache
    cache_len: int = 0

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cache_len:]


class TargetRunner:
    """Verification forwards: many sessions' drafts in one ragged pass (shared weight reads,
    per-session attention and KV cache)."""

    def __init__(self, model: Llama, capture_layers: tuple[int, ...] = ()):
        self.model = model
        self.capture_layers = capture_layers
        self.device = next(model.parameters()).device

    @property
    def max_positions(self) -> int:
        return self.model.s.max_positions

    def open(self, prompt: list[int], capacity: int) -> TargetSession:
        return TargetSession(tokens=list(prompt), cache=self.model.new_cache(1, min(capacity, self.max_positions)))

    def verify(self, st: TargetSession, draft: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Target logits [k+1, V] for the draft positions (row k = bonus) and the captured
        hidden states [1, len(pending) + k, H] of the fed positions, one per capture layer."""
        return self.verify_batch([(st, draft)])[0]

    def verify_batch(self, items: list[tuple[TargetSession, list[int]]]
                     ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        return self.step(items, [])[0]

    @torch.inference_mode()
    def step(self, verify: list[tuple[TargetSession, list[int]]], prefill: list[tuple[TargetSession, int]]
             ) -> tuple[list[tuple[torch.Tensor, list[torch.Tensor]]], list[list[torch.Tensor]]]:
        """One ragged forward over every session. ``verify`` sessions feed their pending tokens
        plus a draft → per session target logits [k+1, V] (the draft positions and the bonus)
        and captured states [1, len(pending) + k, H] per capture layer. ``prefill`` sessions feed
        the next n of their pending (prompt) tokens only and keep them (chunked prefill: no
        logits, no verdict) → their captured states [n, H] per capture layer."""
        VERIFY_BATCH.observe(len(verify) + len(prefill))
        seqs = [st.pending + draft for st, draft in verify] + [st.pending[:n] for st, n in prefill]
        sessions = [st for st, _ in verify] + [st for st, _ in prefill]
        logits, hidden = self.model.forward_ragged(
            seqs, [st.cache_len for st in sessions], [st.cache for st in sessions], self.capture_layers,
            tails=[len(draft) + 1 for _, draft in verify] + [0] * len(prefill))
        if prefill:
            for st, n in prefill:
                st.cache_len += n
            PREFILL_CHUNKS.inc(len(prefill))
        v = len(verify)
        return [(lg.float().cpu(), [h[None] for h in hs]) for lg, hs in zip(logits[:v], hidden[:v])], hidden[v:]

    @staticmethod
    def commit(st: TargetSession, verdict: Verdict) -> None:
        st.cache_len += len(st.pending) + verdict.accepted
        st.tokens.extend(verdict.tokens)
