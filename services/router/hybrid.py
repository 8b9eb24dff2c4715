"""Hybrid Verified Decoding (arXiv 2606.01019): per cycle, verify the suffix-cache draft only
when its predicted yield is worth a verification; otherwise draft with the model drafter.

``HybridDrafter`` is itself a Drafter, so the decode loop is unchanged. Decision rules:
``PredictorRule`` (g_θ(φ_t) > τ, the paper) and ``ScoreRule`` (suffix score ≥ threshold,
ArcticInference's hybrid, the baseline).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.metrics import HYBRID_DECISIONS, PREDICTED_VS_ACTUAL
from services.common.types import Draft, SamplingParams
from services.predictor.features import TokenFlags, YieldTracker, featurize
from services.predictor.mlp import YieldMLP


HIGH_YIELD = 6  # the paper's "high-yield draft": accepted length ≥ 6


class DecisionRule(Protocol):
    name: str

    def verify_cache(self, draft: Draft, tracker: YieldTracker, budget: int) -> bool: ...


class PredictorRule:
    name = "predictor"

    def __init__(self, mlp: YieldMLP, flags: TokenFlags, tau: float):
        self.mlp, self.flags, self.tau = mlp, flags, tau

    def verify_cache(self, draft: Draft, tracker: YieldTracker, budget: int) -> bool:
        y_hat = float(self.mlp.predict(featurize(draft, tracker, self.flags, budget))[0])
        draft.features["predicted_yield"] = y_hat
        return y_hat > self.tau


class ScoreRule:
    name = "score"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def verify_cache(self, draft: Draft, tracker: YieldTracker, budget: int) -> bool:
        return draft.score >= self.threshold


@dataclass(frozen=True)
class Delegate:
    """The hybrid's answer when the cache draft is not worth verifying: draft with ``drafter``
    (beside the verifier) instead, at most ``budget`` tokens."""

    drafter: str
    budget: int


@dataclass
class _State:
    tracker: YieldTracker
    cache_draft: list[int]
    chose_cache: bool = False
    predicted: bool | None = None


class HybridDrafter:
    """Router-side: drafts from the suffix cache, returns that draft or a ``Delegate`` to the
    verifier's model drafter (which observes every cycle there, with the target's states)."""

    def __init__(self, name: str, cache, model: str, rule: DecisionRule, max_cache: int, max_model: int):
        self.name, self.cache, self.model, self.rule = name, cache, model, rule
        self.max_cache, self.max_model = max_cache, max_model
        self.states: dict[str, _State] = {}

    def start(self, req_id: str, prompt: list[int], sp: SamplingParams, rng: torch.Generator | None,
              max_new_tokens: int = 0) -> None:
        self.cache.start(req_id, prompt, sp, rng)
        self.states[req_id] = _State(YieldTracker(len(prompt), max_new_tokens), [])

    def propose(self, req_id: str, budget: int) -> Draft | Delegate:
        st = self.states[req_id]
        draft = self.cache.propose(req_id, min(budget, self.max_cache))
        st.cache_draft = draft.token_ids
        st.chose_cache = bool(draft.token_ids) and self.rule.verify_cache(draft, st.tracker, budget)
        y_hat = draft.features.get("predicted_yield")
        st.predicted = None if y_hat is None else y_hat >= HIGH_YIELD
        HYBRID_DECISIONS.labels(self.name, "cache" if st.chose_cache else "model").inc()
        return draft if st.chose_cache else Delegate(self.model, min(budget, self.max_model))

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        st = self.states[req_id]
        self.cache.observe(req_id, tokens)
        st.tracker.update(st.cache_draft, st.chose_cache, tokens)
        if st.predicted is not None:  # predicted vs observed high yield, for precision / recall
            actual = st.tracker.yields[0] >= HIGH_YIELD
            PREDICTED_VS_ACTUAL.labels(self.name, str(st.predicted).lower(), str(actual).lower()).inc()

    def stop(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self.cache.stop(req_id)
