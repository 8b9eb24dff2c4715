"""Features φ_t of a cache draft, computed the same way in replay training and at inference.

Order (FEATURES) is part of the checkpoint contract. History comes from a per-request
``YieldTracker`` updated after every cycle, whatever source was verified: the cache
draft's *observed* yield is its common prefix with the tokens the cycle committed.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from services.common.types import Draft
from services.drafter.base import common_prefix

FEATURES = (
    "score", "match_len", "draft_len", "mean_token_prob", "last_token_prob", "from_global_tree",
    "log_prompt_len", "log_generated_len", "relative_position", "cache_selection_rate",
    "yield_1", "yield_2", "yield_3", "accepted_1", "accepted_2", "accepted_3", "yield_ema",
    "frac_whitespace", "frac_punctuation", "frac_brackets", "frac_delimiters", "frac_newline",
    "first_has_newline", "budget",
)
FLAG_NAMES = ("whitespace", "punctuation", "brackets", "delimiters", "newline")


class TokenFlags:
    """Per-vocabulary structure flags [V, 5]: whitespace-only, punctuation-only, has a bracket,
    has a delimiter (, ; :), has a newline."""

    def __init__(self, tokenizer):
        rows = []
        for i in range(len(tokenizer)):
            s = tokenizer.decode([i])
            t = s.strip()
            rows.append((not t, bool(t) and all(not c.isalnum() and c != "_" for c in t),
                         any(c in "()[]{}" for c in s), any(c in ",;:" for c in s), "\n" in s))
        self.table = np.asarray(rows, dtype=np.float32)

    def of(self, tokens: list[int]) -> np.ndarray:
        return self.table[tokens].mean(0) if tokens else np.zeros(len(FLAG_NAMES), np.float32)


@dataclass
class YieldTracker:
    """Per-request history for φ_t (three most recent cycles, EMAs with factor 0.8)."""

    prompt_len: int
    max_new_tokens: int
    generated: int = 0
    yields: deque = field(default_factory=lambda: deque([0, 0, 0], maxlen=3))
    accepted: deque = field(default_factory=lambda: deque([0, 0, 0], maxlen=3))
    selection_rate: float = 0.5
    yield_ema: float = 0.0

    def update(self, cache_draft: list[int], chose_cache: bool, committed: list[int]) -> None:
        y = common_prefix(cache_draft, committed)
        self.yields.appendleft(y)
        self.accepted.appendleft(max(0, len(committed) - 1))
        self.selection_rate = 0.8 * self.selection_rate + 0.2 * float(chose_cache)
        self.yield_ema = 0.8 * self.yield_ema + 0.2 * y
        self.generated += len(committed)


def featurize(draft: Draft, tracker: YieldTracker, flags: TokenFlags, budget: int) -> np.ndarray:
    probs = draft.token_probs or [0.0]
    f = flags.of(draft.token_ids)
    t = tracker
    return np.asarray([
        draft.score, draft.match_len, len(draft), sum(probs) / len(probs), probs[-1],
        float(draft.features.get("tree") == "global"),
        math.log1p(t.prompt_len), math.log1p(t.generated), t.generated / max(1, t.max_new_tokens),
        t.selection_rate, *t.yields, *t.accepted, t.yield_ema,
        *f, float(bool(draft.token_ids) and flags.table[draft.token_ids[0], 4] > 0), budget,
    ], dtype=np.float32)
