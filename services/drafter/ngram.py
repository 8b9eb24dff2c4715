"""Prompt-lookup (n-gram) drafter, as vLLM's `ngram` speculative method: match the context's
last n tokens (the longest n in [min_n, max_n]) at their earliest earlier occurrence in the
prompt and output, and draft the k tokens that followed it. Parameter-free and per request:
the baseline that serving systems ship, beside the suffix cache, which also matches past
requests' outputs and drafts by frequency.

Each request keeps, per n, the end of each n-gram's first occurrence, updated as tokens
arrive (O(max_n − min_n + 1) per token), so a proposal is a few dictionary reads.

Pure Python: no torch, gRPC, Redis or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import NgramConfig
from services.common.types import Draft, Sampling
from services.drafter.base import Drafter, register


@dataclass
class _Req:
    tokens: list[int] = field(default_factory=list)
    first_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram → end of its first occurrence


@register("ngram")
class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, cfg: NgramConfig = NgramConfig()):
        if not 1 <= cfg.min_n <= cfg.max_n or cfg.k < 1:
            raise ValueError(f"ngram: need 1 <= min_n <= max_n and k >= 1, got {cfg}")
        self.cfg = cfg
        self.states: dict[str, _Req] = {}

    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: Sampling | None = None,
        rng=None,
        max_new_tokens: int = 0,
        *,
        scope: str | None = None,
    ) -> None:
        self.states[req_id] = st = _Req()
        self._extend(st, prompt)

    def _extend(self, st: _Req, tokens: list[int]) -> None:
        for t in tokens:
            st.tokens.append(t)
            end = len(st.tokens)
            for n in range(self.cfg.min_n, min(self.cfg.max_n, end) + 1):
                st.first_end.setdefault(tuple(st.tokens[end - n :]), end)

    def propose(self, req_id: str, budget: int) -> Draft:
        """The tokens after the earliest earlier occurrence of the longest matching suffix."""
        st = self.states[req_id]
        toks, end = st.tokens, len(st.tokens)
        for n in range(min(self.cfg.max_n, end - 1), self.cfg.min_n - 1, -1):
            first = st.first_end.get(tuple(toks[end - n :]))
            if first is not None and first < end:
                return Draft(token_ids=toks[first : first + min(budget, self.cfg.k)], source=self.name, match_len=n)
        return Draft.empty()

    def verified(self, req_id: str, n: int) -> None:
        """It keeps no per-draft state."""

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        self._extend(self.states[req_id], tokens)

    def stop(self, req_id: str) -> None:
        self.states.pop(req_id, None)
