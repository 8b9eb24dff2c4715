"""Hybrid Verified Decoding (arXiv 2606.01019): per cycle, verify the suffix-cache draft only
when its predicted yield is worth a verification; otherwise draft with the model drafter.

``HybridDrafter`` is itself a Drafter, so the decode loop is unchanged. Decision rules:
``PredictorRule`` (g_θ(φ_t) > τ, the paper) and ``ScoreRule`` (suffix score ≥ threshold,
ArcticInference's hybrid, the baseline).

Cost-aware variant (``CycleCosts``): τ compares a yield with a constant, but what a cycle is
worth depends on what it costs here. With measured costs, a cache draft of n tokens is
verified when (1 + ŷ) / s(n, 1 + ŷ) ≥ the best fallback's tokens / seconds, where
s(n, k) = a + b·n + c·k is a cache cycle's cost fitted online against its draft length and
the tokens it commits (verifying a short draft costs about a plain step; a long one more;
each committed token its share of bookkeeping). The fallback is the model drafter or a
plain step (no draft, one token), whichever yields more per second. When even ŷ = 0 would
pass, the predictor is not consulted; nor is it where its answers have not been worth their
cost (``PredictionValue``: what its declines gained, once shadow verification tells the
declined drafts' true yields). Where the model drafter's cycle costs more than its extra
tokens are worth (a CPU, where the EAGLE-3 head's steps are not cheap next to the target),
the hybrid stops calling it.

A model cycle's seconds include the head's catch-up over the tokens committed since it last
drafted (``on_demand`` sessions absorb them when asked to draft). That catch-up is owed
whichever cycle asks next, so it is no cost of choosing the model now: the model is judged
at its steady cost, s(g) = a + b·g fitted over the catch-up gap g and evaluated at the gap of
back-to-back model cycles (its tokens per cycle). Judged at its sporadic cost instead, a model
drafter tried rarely looks slow, so it is tried more rarely still. The fit needs back-to-back
samples, so when none came in the last ``steady_every`` model cycles, a model cycle after a
longer gap is followed by another.

ŷ is calibrated online (``YieldCalibration``): per draft-length bucket, the predictor's
running bias against the true yields that verification and shadow verification reveal is
added to it before it is compared with what the draft needs.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from services.common.metrics import HYBRID_DECISIONS, PREDICTED_VS_ACTUAL
from services.common.types import Delegate, Draft, Sampling
from services.drafter.base import Drafter
from services.predictor.features import HIGH_YIELD, TokenFlags, YieldTracker, featurize_all

CACHE, MODEL, PLAIN = "cache", "model", "plain"  # a hybrid's choices per cycle


class _Means:
    """Running means of named values: the plain mean of the first 1/``alpha`` samples, then an
    EMA with factor ``alpha`` (so no single early sample, such as a cold first cycle, outweighs
    the next twenty)."""

    def __init__(self):
        self.mean: dict[str, float] = {}
        self.n = 0

    def add(self, alpha: float, **values: float) -> None:
        a = max(alpha, 1.0 / (self.n + 1))
        for k, v in values.items():
            m = self.mean.get(k, 0.0)
            self.mean[k] = m + a * (v - m)
        self.n += 1


class _Ema(_Means):
    """Tokens and seconds per cycle of one choice."""

    @property
    def tokens(self) -> float:
        return self.mean.get("tokens", 0.0)

    @property
    def seconds(self) -> float:
        return self.mean.get("seconds", 0.0)

    def rate(self, tokens: float | None = None) -> float:
        return (self.tokens if tokens is None else tokens) / max(self.seconds, 1e-9)


class _CycleCost(_Means):
    """Seconds of a cache cycle as a + b·n + c·k over its draft length n and the tokens k it
    commits, least squares on running means. Verification grows with n; the work per committed
    token (commit, observing drafters, detokenizing, streaming) grows with k, and every choice
    pays it. Long drafts are accepted more, so a fit on n alone charges them for the tokens
    they commit and asks long drafts for yields they need not reach. While n and k do not
    vary apart, c is 0 (the fit on n alone); a slope measured negative (noise) counts as 0."""

    def add_cycle(self, length: int, tokens: int, seconds: float, alpha: float) -> None:
        n, k = length, tokens
        self.add(alpha, n=n, k=k, s=seconds, nn=n * n, kk=k * k, nk=n * k, ns=n * seconds, ks=k * seconds)

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c); (1e-9, 0, 0) before any cycle."""
        m = self.mean
        if not m:
            return 1e-9, 0.0, 0.0
        vn, vk = m["nn"] - m["n"] ** 2, m["kk"] - m["k"] ** 2
        cnk, cns, cks = m["nk"] - m["n"] * m["k"], m["ns"] - m["n"] * m["s"], m["ks"] - m["k"] * m["s"]
        det = vn * vk - cnk * cnk
        b = c = 0.0
        if vn > 0.25 and vk > 0.25 and det > 0.05 * vn * vk:  # both vary, and not in lockstep
            b, c = (cns * vk - cks * cnk) / det, (cks * vn - cns * cnk) / det
            if b < 0 or c < 0:  # refit on the other alone
                b, c = (0.0, max(0.0, cks / vk)) if b < 0 else (max(0.0, cns / vn), 0.0)
        elif vn > 0.25:
            b = max(0.0, cns / vn)
        return m["s"] - b * m["n"] - c * m["k"], b, c

    def seconds(self, length: float, tokens: float | None = None) -> float:
        """Fitted cost of a cycle at ``length`` (a cache draft's tokens; a model cycle's catch-up
        gap) that commits ``tokens`` (default: the mean)."""
        a, b, c = self.coefficients()
        k = self.mean.get("k", 0.0) if tokens is None else tokens
        return max(1e-9, a + b * length + c * k)


def length_bucket(n: int) -> int:
    """Draft lengths 1, 2, 3, 4 on their own, then 5-8, 9-16, 17-32, ..."""
    return n if n <= 4 else 2 + (n - 1).bit_length()


class PredictionValue:
    """Whether a yield prediction is worth its cost, per draft-length bucket, judged by what
    its declines actually gained.

    A prediction can only change a decision into a decline. Declining an n-token draft gains
    need − y tokens of the fallback's, ``need`` being the least yield that pays for the cache
    cycle and y the draft's true yield, known later by shadow verification (``YieldTracker``):
    negative when the draft would have paid. A pass gains nothing. A prediction costs its
    seconds × the fallback's rate, in tokens too. The predictor is consulted where the mean
    realized gain per consultation covers that cost; elsewhere the draft is verified
    unpredicted, except every ``explore_every``-th time, which keeps the gain measured. A
    bucket is always consulted until ``warmup`` gains are known."""

    def __init__(self, warmup: int = 16, explore_every: int = 16, alpha: float = 0.05):
        self.warmup, self.explore_every, self.alpha = warmup, explore_every, alpha
        self.gain: dict[int, _Means] = {}
        self.cost = _Means()  # seconds per prediction
        self._skipped: dict[int, int] = {}

    def worth(self, length: int, rate: float) -> bool:
        """Consult the predictor for an n-token draft, the fallback yielding ``rate`` tokens/s."""
        b = length_bucket(length)
        g = self.gain.get(b)
        if g is None or g.n < self.warmup or self.cost.n == 0:
            return True
        if g.mean["gain"] >= self.cost.mean["s"] * rate:
            return True
        self._skipped[b] = self._skipped.get(b, 0) + 1
        if self._skipped[b] >= self.explore_every:
            self._skipped[b] = 0
            return True
        return False

    def record_cost(self, seconds: float) -> None:
        self.cost.add(self.alpha, s=seconds)

    def realize(self, length: int, need: float, declined: bool, y: int) -> None:
        """A consulted draft's true yield ``y`` is known: book what the prediction gained."""
        self.gain.setdefault(length_bucket(length), _Means()).add(self.alpha, gain=need - y if declined else 0.0)


class CycleCosts:
    """Tokens and seconds per cycle of each choice, EMAs over all requests of one hybrid; the
    model drafter's rate at its steady cost (module docstring).

    A fallback seen fewer than ``warmup`` times is tried first, and every ``explore_every``-th
    fallback re-measures the one not taken, so the estimates follow load and hardware."""

    def __init__(self, warmup: int = 4, explore_every: int = 32, alpha: float = 0.05, steady_every: int = 16):
        self.warmup, self.explore_every, self.alpha, self.steady_every = warmup, explore_every, alpha, steady_every
        self.ema = {c: _Ema() for c in (CACHE, MODEL, PLAIN)}
        self.cache_cost = _CycleCost()
        self.model_cost = _CycleCost()  # seconds over (catch-up gap, tokens committed)
        self._since_steady = steady_every  # model cycles since the last back-to-back one
        self.prediction = PredictionValue()
        self._fallbacks = 0
        self._lock = threading.Lock()

    def record(
        self,
        choice: str,
        tokens: int,
        seconds: float,
        drafted: int = 0,
        gap: int | None = None,
        back_to_back: bool = False,
    ) -> None:
        """One finished cycle: tokens committed, its seconds, (cache cycles) the draft length and
        (model cycles) the catch-up gap, tokens committed since the model drafter last drafted,
        and whether the cycle before was the model's too."""
        with self._lock:
            self.ema[choice].add(self.alpha, tokens=tokens, seconds=seconds)
            if choice == CACHE:
                self.cache_cost.add_cycle(drafted, tokens, seconds, self.alpha)
            elif choice == MODEL and gap is not None:
                self.model_cost.add_cycle(gap, tokens, seconds, self.alpha)
                self._since_steady = 0 if back_to_back else self._since_steady + 1

    def follow_up(self) -> bool:
        """Whether the model cycle just recorded should be followed by another, to measure the
        model back to back: none was in the last ``steady_every`` model cycles."""
        with self._lock:
            return self._since_steady >= self.steady_every

    def _rate(self, choice: str) -> float:
        """Tokens per second; the model drafter's at its steady catch-up gap once that is fitted."""
        e = self.ema[choice]
        if choice != MODEL or self.model_cost.n < self.warmup:
            return e.rate()
        return e.tokens / self.model_cost.seconds(e.tokens, e.tokens)  # back to back, the gap is a cycle's tokens

    def fallback(self) -> str:
        """The model drafter or a plain step: whichever yields more tokens per second."""
        with self._lock:
            m, p = self.ema[MODEL], self.ema[PLAIN]
            if min(m.n, p.n) < self.warmup:
                return MODEL if m.n <= p.n else PLAIN
            return MODEL if self._rate(MODEL) >= p.rate() else PLAIN

    def take(self, fallback: str) -> str:
        """The fallback to run: every ``explore_every``-th one taken is the other, to re-measure it."""
        with self._lock:
            self._fallbacks += 1
            if self._fallbacks % self.explore_every:
                return fallback
            return PLAIN if fallback == MODEL else MODEL

    def yield_needed(self, length: int, fallback: str) -> float | None:
        """The least ŷ for which verifying an n-token cache draft beats the fallback:
        (1 + ŷ) / s(n, 1 + ŷ) ≥ the fallback's rate. None until both are measured."""
        with self._lock:
            return self._need(length, fallback)

    def _need(self, length: int, fallback: str) -> float | None:
        fit = self._fit(fallback)
        return None if fit is None else _need_at(fit, length)

    def _fit(self, fallback: str) -> tuple[float, float, float, float] | None:
        """The cache cycle's cost fit (a, b, c) and the fallback's rate; None until both are measured."""
        if min(self.cache_cost.n, self.ema[fallback].n) < self.warmup:
            return None
        return (*self.cache_cost.coefficients(), self._rate(fallback))

    def plan(self, length: int, fallback: str) -> tuple[float | None, bool]:
        """(the least ŷ the draft needs, whether predicting it repays its cost), under one lock:
        a draft that needs no yield is never predicted."""
        return self.plan_all([(length, fallback)])[0]

    def plan_all(self, asks: list[tuple[int, str]]) -> list[tuple[float | None, bool]]:
        """``plan`` for each ``(length, fallback)`` of a step, in order, under one lock. Rule:
        the cost fit and each fallback's rate are read once (a step records nothing), and
        ``_need``'s arithmetic is kept, so each answer is the one ``plan`` alone would give."""
        fits: dict[str, tuple[float, float, float, float] | None] = {}
        out: list[tuple[float | None, bool]] = []
        with self._lock:
            for length, fallback in asks:
                if fallback not in fits:
                    fits[fallback] = self._fit(fallback)
                fit = fits[fallback]
                if fit is None:
                    out.append((None, True))
                    continue
                need = _need_at(fit, length)
                out.append((need, need > 0.0 and self.prediction.worth(length, fit[3])))
        return out

    def record_prediction_cost(self, seconds: float) -> None:
        with self._lock:
            self.prediction.record_cost(seconds)

    def realize_prediction(self, length: int, need: float, declined: bool, y: int) -> None:
        with self._lock:
            self.prediction.realize(length, need, declined, y)

    def cache_pays(self, y_hat: float, fallback: str, tau: float, length: int = 0) -> bool:
        """(1 + ŷ) tokens per second of an n-token cache cycle beat the fallback's measured
        rate; until both are measured, the paper's rule ŷ > τ decides."""
        return passes(y_hat, self.yield_needed(length, fallback), tau)


def _need_at(fit: tuple[float, float, float, float], length: int) -> float:
    """The least yield an n-token cache cycle needs under ``fit`` (a, b, c, the fallback's rate r):
    (1 + y) / (a + b·n + c·(1 + y)) ≥ r  ⟺  1 + y ≥ r·(a + b·n) / (1 − r·c)."""
    a, b, c, r = fit
    return r * max(1e-9, a + b * length) / max(1e-3, 1.0 - r * c) - 1.0


def passes(y_hat: float, need: float | None, tau: float) -> bool:
    """ŷ reaches the yield a cache cycle needs (a negative ŷ counts as none); unmeasured: ŷ > τ."""
    return y_hat > tau if need is None else max(0.0, y_hat) >= need


Ask = tuple[Draft, YieldTracker, int, str]  # a cache draft to judge: its session's tracker, budget and fallback


class DecisionRule(Protocol):
    name: str

    def verify_cache(
        self, draft: Draft, tracker: YieldTracker, budget: int, fallback: str, costs: CycleCosts | None
    ) -> bool: ...

    def verify_batch(self, asks: list[Ask], costs: CycleCosts | None) -> list[bool]:
        """``verify_cache`` for every cache draft of one step, at once."""

    def realize(self, length: int, raw: float, y: int) -> None:
        """A predicted n-token draft's true yield ``y`` is known; ``raw`` was the predictor's ŷ."""


class YieldCalibration:
    """ŷ corrected by its running bias in the draft's length bucket: the mean of y − ŷ over
    drafts whose true yield became known (verified, or shadow-verified once declined), applied
    after ``warmup`` of them. The MLP regresses yields pooled over every draft length, and per
    length it can be off by half a token (1-token drafts on humaneval: ŷ 0.74 against y 0.21,
    bench/results/hybrid_cycles_humaneval.md), the whole margin a short draft is judged by."""

    def __init__(self, warmup: int = 16, alpha: float = 0.05):
        self.warmup, self.alpha = warmup, alpha
        self.bias: dict[int, _Means] = {}
        self._lock = threading.Lock()

    def __call__(self, length: int, y_hat: float) -> float:
        b = self.bias.get(length_bucket(length))
        return y_hat if b is None or b.n < self.warmup else y_hat + b.mean["bias"]

    def realize(self, length: int, y_hat: float, y: int) -> None:
        with self._lock:
            self.bias.setdefault(length_bucket(length), _Means()).add(self.alpha, bias=y - y_hat)


class YieldPredictor(Protocol):
    """ŷ per row of features: the MLP in process (``YieldMLP``) or a remote one."""

    def predict(self, phi: np.ndarray) -> np.ndarray: ...


class PredictorRule:
    name = "predictor"

    def __init__(self, mlp: YieldPredictor, flags: TokenFlags, tau: float):
        self.mlp, self.flags, self.tau = mlp, flags, tau
        self.calibration = YieldCalibration()

    def realize(self, length: int, raw: float, y: int) -> None:
        self.calibration.realize(length, raw, y)

    def verify_cache(
        self, draft: Draft, tracker: YieldTracker, budget: int, fallback: str = MODEL, costs: CycleCosts | None = None
    ) -> bool:
        return self.verify_batch([(draft, tracker, budget, fallback)], costs)[0]

    def verify_batch(self, asks: list[Ask], costs: CycleCosts | None = None) -> list[bool]:
        """One predictor call over the drafts whose ŷ is worth asking for (the rest pass: any
        ŷ ≥ 0 would, or a decline would not repay the prediction); each prediction costs its
        share of the call."""
        plans = (
            costs.plan_all([(len(d.token_ids), fallback) for d, _, _, fallback in asks])
            if costs is not None
            else [(None, True)] * len(asks)
        )
        asked = [i for i, (_, worth) in enumerate(plans) if worth]
        verdicts = [True] * len(asks)
        if not asked:
            return verdicts
        t0 = time.perf_counter()
        phi = featurize_all([(asks[i][0], asks[i][1], asks[i][2]) for i in asked], self.flags)
        raws = self.mlp.predict(phi).tolist()
        share = (time.perf_counter() - t0) / len(asked)
        for i, raw in zip(asked, raws):
            draft, need = asks[i][0], plans[i][0]
            y_hat = self.calibration(len(draft.token_ids), raw)
            if costs is not None and need is not None:
                costs.record_prediction_cost(share)
                draft.features["yield_needed"] = need
            draft.features["predicted_yield"], draft.features["raw_yield"] = y_hat, raw
            verdicts[i] = passes(y_hat, need, self.tau)
        return verdicts


class ScoreRule:
    name = "score"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def verify_cache(
        self, draft: Draft, tracker: YieldTracker, budget: int, fallback: str = MODEL, costs: CycleCosts | None = None
    ) -> bool:
        return draft.score >= self.threshold

    def verify_batch(self, asks: list[Ask], costs: CycleCosts | None = None) -> list[bool]:
        return [d.score >= self.threshold for d, _, _, _ in asks]

    def realize(self, length: int, raw: float, y: int) -> None:
        """Scores are not predictions: nothing to calibrate."""


@dataclass(frozen=True)
class _Prediction:
    """What a consulted prediction said of a cache draft, kept until its true yield is known."""

    high: bool  # ŷ ≥ HIGH_YIELD (precision / recall metrics)
    raw: float  # the predictor's own ŷ, before calibration
    length: int
    need: float | None  # None: decided by τ, not by measured costs
    declined: bool  # the draft was not verified


@dataclass
class _State:
    tracker: YieldTracker
    cache_draft: list[int]
    chose_cache: bool = False
    predicted: _Prediction | None = None
    choice: str = CACHE
    started: float = 0.0
    model_used: bool = False  # the model drafter has drafted for this request
    since_model: int = 0  # tokens committed since it last drafted: its catch-up gap
    follow_up: bool = False  # the next cycle is the model's, to measure it back to back
    prev: str = CACHE  # the choice of the cycle before


@functools.cache
def _decisions(name: str, choice: str):
    """The decision counter's child (a label lookup takes a lock: once, not per cycle)."""
    return HYBRID_DECISIONS.labels(name, choice)


@functools.cache
def _predicted_vs_actual(name: str, high: bool, actual_high: bool):
    return PREDICTED_VS_ACTUAL.labels(name, str(high).lower(), str(actual_high).lower())


class HybridDrafter(Drafter):
    """Router-side: drafts from the suffix cache, returns that draft, a ``Delegate`` to the
    verifier's model drafter (which observes every cycle there, with the target's states) or,
    with ``costs``, an empty draft when a plain step is the cheaper fallback. With ``both``,
    a delegated cycle also carries the declined cache draft, verified beside the model's
    (``Delegate.also``)."""

    def __init__(
        self,
        name: str,
        cache,
        model: str,
        rule: DecisionRule,
        max_cache: int,
        max_model: int,
        costs: CycleCosts | None = None,
        both: bool = False,
    ):
        self.name, self.cache, self.model, self.rule = name, cache, model, rule
        self.max_cache, self.max_model = max_cache, max_model
        self.costs, self.both = costs, both
        self.states: dict[str, _State] = {}

    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: Sampling,
        rng: torch.Generator | None,
        max_new_tokens: int = 0,
        *,
        scope: str | None = None,
    ) -> None:
        self.cache.start(req_id, prompt, sp, rng, scope=scope)
        self.states[req_id] = _State(YieldTracker(len(prompt), max_new_tokens), [])

    def propose(self, req_id: str, budget: int) -> Draft | Delegate:  # type: ignore[override]  # the router checks for Delegate
        return self.propose_batch([(req_id, budget)])[0]

    def propose_batch(self, asks: list[tuple[str, int]]) -> list[Draft | Delegate]:  # type: ignore[override]
        """One step's choices: the cache drafts in one call, then the rule over all of them in
        one (the predictor's ŷ for every draft that needs one), then each session's choice."""
        states = [self.states[req_id] for req_id, _ in asks]
        now = time.perf_counter()
        for st in states:
            st.started, st.prev = now, st.choice
        # a follow-up is the model again, to measure it back to back (CycleCosts.follow_up)
        drafting = [i for i, st in enumerate(states) if not st.follow_up]
        drafts = self.cache.propose_batch([(asks[i][0], min(asks[i][1], self.max_cache)) for i in drafting])
        fallback = self.costs.fallback() if self.costs else MODEL  # nothing is recorded within a step
        fallbacks = dict.fromkeys(drafting, fallback)
        chains = {i: d.chain() for i, d in zip(drafting, drafts)}  # what the rule reads (trained on paths)
        judged = [i for i in drafting if chains[i].token_ids]
        verdicts = self.rule.verify_batch(
            [(chains[i], states[i].tracker, asks[i][1], fallbacks[i]) for i in judged], self.costs
        )
        chose = dict(zip(judged, verdicts))
        out: list[Draft | Delegate] = []
        cache_drafts = dict(zip(drafting, drafts))
        for i, (st, (_, budget)) in enumerate(zip(states, asks)):
            if st.follow_up:
                st.follow_up, st.cache_draft, st.chose_cache, st.predicted = False, [], False, None
                out.append(self._chosen(st, MODEL, Draft.empty(), budget))
                continue
            out.append(self._decide(st, chains[i], cache_drafts[i], chose.get(i, False), fallbacks[i], budget))
        return out

    def _decide(self, st: _State, chain: Draft, draft: Draft, chose: bool, fallback: str, budget: int):
        """A session's choice once the rule has judged its cache draft (a tree goes out whole)."""
        st.cache_draft, st.chose_cache = chain.token_ids, chose
        y_hat = chain.features.get("predicted_yield")
        st.predicted = (
            None
            if y_hat is None
            else _Prediction(
                y_hat >= HIGH_YIELD,
                chain.features["raw_yield"],
                len(chain.token_ids),
                chain.features.get("yield_needed"),
                not chose,
            )
        )
        choice = CACHE if chose else self.costs.take(fallback) if self.costs else MODEL
        return self._chosen(st, choice, draft, budget)

    def _chosen(self, st: _State, choice: str, draft: Draft, budget: int) -> Draft | Delegate:
        st.choice = choice
        _decisions(self.name, choice).inc()
        if choice == CACHE:
            return draft
        if choice == PLAIN:
            return Draft.empty()
        return Delegate(self.model, min(budget, self.max_model), tuple(st.cache_draft) if self.both else ())

    def after_step(self) -> None:
        self.cache.after_step()

    def verified(self, req_id: str, n: int) -> None:
        """The router verifies only the first ``n`` tokens of the cache draft (a grammar forbids
        the next): the cycle is costed at that length. Its yield is unchanged, since a forbidden
        token is never the committed one."""
        st = self.states[req_id]
        st.cache_draft = st.cache_draft[:n]
        self.cache.verified(req_id, n)

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        st = self.states[req_id]
        self._book(st, tokens)
        self.cache.observe(req_id, tokens)
        # once a predicted draft's yield is known: precision / recall, and what the prediction gained
        for p, y in st.tracker.update(st.cache_draft, tokens, st.chose_cache, st.predicted):
            if not isinstance(p, _Prediction):  # an unpredicted draft's tag is None
                continue
            _predicted_vs_actual(self.name, p.high, y >= HIGH_YIELD).inc()
            self.rule.realize(p.length, p.raw, y)
            if p.need is not None and self.costs:
                self.costs.realize_prediction(p.length, p.need, p.declined, y)

    def _book(self, st: _State, tokens: list[int]) -> None:
        """Costs the cycle just verified (with ``costs``). Not booked: a budget-0 cycle (not the
        hybrid's choice), a request's first, whose seconds include the target's prefill, and its
        first model cycle, whose seconds include the model drafter's prefill over the prompt: no
        later cycle pays either."""
        model = bool(st.started) and st.choice == MODEL
        first_model, gap = model and not st.model_used, st.since_model
        st.model_used |= model
        st.since_model = len(tokens) + (0 if model else st.since_model)
        if self.costs and st.started and st.tracker.generated > 0 and not first_model:
            seconds = time.perf_counter() - st.started
            if model:
                self.costs.record(MODEL, len(tokens), seconds, gap=gap, back_to_back=st.prev == MODEL)
                st.follow_up = st.prev != MODEL and self.costs.follow_up()
            else:
                self.costs.record(st.choice, len(tokens), seconds, len(st.cache_draft) if st.choice == CACHE else 0)
        st.started = 0.0

    def stop(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self.cache.stop(req_id)
