"""Features φ_t of a cache draft, computed the same way in replay training and at inference.

Order (FEATURES) is part of the checkpoint contract. History comes from a per-request
``YieldTracker`` updated after every cycle, whatever source was verified, and it must not
depend on that choice: replay training verifies every cache draft, so a router that
declined one must still record the draft's true yield. A declined draft's common prefix
with the committed tokens is exact when it stops short of them; when every committed token
matched, the draft is *shadow-verified* against the next cycles' tokens until it misses or
runs out. Recording the censored prefix instead (≤ 1 after a plain step) would bias the
history low, and the predictor would decline ever more drafts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from services.common.types import Draft
from services.drafter.base import common_prefix

FEATURES = (
    "score",
    "match_len",
    "draft_len",
    "mean_token_prob",
    "last_token_prob",
    "from_global_tree",
    "log_prompt_len",
    "log_generated_len",
    "relative_position",
    "cache_selection_rate",
    "yield_1",
    "yield_2",
    "yield_3",
    "accepted_1",
    "accepted_2",
    "accepted_3",
    "yield_ema",
    "frac_whitespace",
    "frac_punctuation",
    "frac_brackets",
    "frac_delimiters",
    "frac_newline",
    "first_has_newline",
    "budget",
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
            rows.append(
                (
                    not t,
                    bool(t) and all(not c.isalnum() and c != "_" for c in t),
                    any(c in "()[]{}" for c in s),
                    any(c in ",;:" for c in s),
                    "\n" in s,
                )
            )
        self.table = np.asarray(rows, dtype=np.float32)
        self.rows = [tuple(map(float, r)) for r in rows]  # per-cycle lookups stay in Python (below)

    def of(self, tokens: list[int]) -> list[float]:
        """Mean flags of ``tokens``. Plain Python: the router calls this once per cycle, right
        after a target forward has evicted numpy's code and data from the CPU caches, where
        numpy's fancy indexing measured 5× slower than this loop (42 against 8 µs)."""
        if not tokens:
            return [0.0] * len(FLAG_NAMES)
        rows = [self.rows[t] for t in tokens]
        return [sum(col) / len(rows) for col in zip(*rows)]


HIGH_YIELD = 6  # the paper's "high-yield draft": accepted length ≥ 6


@dataclass
class _Shadow:
    """A declined cache draft still being compared with committed tokens."""

    rest: list[int]
    matched: int
    tag: object


@dataclass
class YieldTracker:
    """Per-request history for φ_t (three most recent yields, EMAs with factor 0.8).

    ``accepted_*`` and the selection rate are the cache draft's own, as replay (which verifies
    every draft) records them: its yield, and whether it beat HIGH_YIELD."""

    prompt_len: int
    max_new_tokens: int
    generated: int = 0
    yields: deque = field(default_factory=lambda: deque([0, 0, 0], maxlen=3))
    accepted: deque = field(default_factory=lambda: deque([0, 0, 0], maxlen=3))
    selection_rate: float = 0.5
    yield_ema: float = 0.0
    shadows: list[_Shadow] = field(default_factory=list)

    def update(
        self, cache_draft: list[int], committed: list[int], verified: bool = True, tag: object = None
    ) -> list[tuple[object, int]]:
        """Record a cycle; returns (tag, yield) of every draft whose yield became known."""
        known = [(sh.tag, sh.matched) for sh in self.shadows if not self._advance(sh, committed)]
        self.shadows = [sh for sh in self.shadows if sh.rest]
        y = common_prefix(cache_draft, committed)
        if not verified and y == len(committed) < len(cache_draft):  # censored: yield ≥ y
            self.shadows.append(_Shadow(cache_draft[y:], y, tag))
        else:
            known.append((tag, y))
        for _, k in known:
            self._record(k)
        self.generated += len(committed)
        return known

    @staticmethod
    def _advance(sh: _Shadow, committed: list[int]) -> bool:
        """Compare more committed tokens; False once the yield is known (then rest = [])."""
        k = common_prefix(sh.rest, committed)
        sh.matched += k
        if k == len(committed) and k < len(sh.rest):
            sh.rest = sh.rest[k:]
            return True
        sh.rest = []
        return False

    def _record(self, y: int) -> None:
        self.yields.appendleft(y)
        self.accepted.appendleft(y)
        self.selection_rate = 0.8 * self.selection_rate + 0.2 * float(y > HIGH_YIELD)
        self.yield_ema = 0.8 * self.yield_ema + 0.2 * y


def featurize(draft: Draft, tracker: YieldTracker, flags: TokenFlags, budget: int) -> np.ndarray:
    return np.asarray(feature_row(draft, tracker, flags, budget), dtype=np.float32)


def featurize_all(asks: list[tuple[Draft, YieldTracker, int]], flags: TokenFlags) -> np.ndarray:
    """[N, F]: ``featurize`` of each (draft, tracker, budget), made as one array (a step's)."""
    return np.array([feature_row(d, t, flags, b) for d, t, b in asks], dtype=np.float32)


def feature_row(draft: Draft, tracker: YieldTracker, flags: TokenFlags, budget: int) -> list[float]:
    """φ_t of a cache draft (``FEATURES`` names them)."""
    probs = draft.token_probs or [0.0]
    f = flags.of(draft.token_ids)
    t = tracker
    return [
        draft.score,
        draft.match_len,
        len(draft),
        sum(probs) / len(probs),
        probs[-1],
        float(draft.features.get("tree") == "global"),
        math.log1p(t.prompt_len),
        math.log1p(t.generated),
        t.generated / max(1, t.max_new_tokens),
        t.selection_rate,
        *t.yields,
        *t.accepted,
        t.yield_ema,
        *f,
        float(bool(draft.token_ids) and flags.rows[draft.token_ids[0]][4] > 0),
        budget,
    ]
