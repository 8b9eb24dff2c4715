"""Cost-aware hybrid decisions (services/drafter/hybrid.py CycleCosts)."""

import pytest

from services.drafter.base import Drafter
from services.drafter.hybrid import CACHE, MODEL, PLAIN, CycleCosts


def measured(model=(2.0, 0.016), plain=(1.0, 0.008), cache=(6.0, 0.010), n=8) -> CycleCosts:
    """Costs with ``n`` cycles of each choice at (tokens, seconds)."""
    c = CycleCosts(warmup=4, explore_every=16)
    for _ in range(n):
        c.record(MODEL, *model)
        c.record(PLAIN, *plain)
        c.record(CACHE, *cache)
    return c


def test_unmeasured_fallbacks_are_tried_first():
    c = CycleCosts(warmup=2)
    assert c.fallback() == MODEL
    c.record(MODEL, 2, 0.01)
    assert c.fallback() == PLAIN
    c.record(PLAIN, 1, 0.01)
    assert c.fallback() == MODEL  # both seen once, warm-up asks for two


def test_fallback_is_the_faster_one_with_periodic_exploration():
    slow_model = measured(model=(2.0, 0.030))  # 67 tok/s vs plain's 125
    picks = [slow_model.take(slow_model.fallback()) for _ in range(32)]
    assert picks.count(PLAIN) == 30 and picks.count(MODEL) == 2
    fast_model = measured(model=(3.0, 0.012))  # 250 tok/s
    assert [fast_model.take(fast_model.fallback()) for _ in range(15)] == [MODEL] * 15


def test_cache_draft_verified_when_its_predicted_rate_beats_the_fallback():
    c = measured(cache=(6.0, 0.010), plain=(1.0, 0.008))  # plain: 125 tok/s
    assert c.cache_pays(1.0, PLAIN, tau=6)  # (1 + 1) / 0.010 = 200 tok/s
    assert not c.cache_pays(0.0, PLAIN, tau=-1)  # 100 tok/s
    assert not c.cache_pays(-3.0, PLAIN, tau=-9)  # a negative prediction counts as no yield


def test_paper_rule_decides_until_cache_and_fallback_are_measured():
    c = CycleCosts(warmup=4)
    assert c.cache_pays(2.5, MODEL, tau=2) and not c.cache_pays(1.5, MODEL, tau=2)
    for _ in range(4):
        c.record(CACHE, 1, 0.001)
    assert not c.cache_pays(1.5, MODEL, tau=2)  # the model drafter is not measured yet


def test_ema_follows_a_change_in_cost():
    c = measured(model=(2.0, 0.010))  # 200 tok/s: the model drafter wins
    assert c.fallback() == MODEL
    for _ in range(200):  # the machine gets busy: model cycles slow down
        c.record(MODEL, 2.0, 0.040)
    assert c.fallback() == PLAIN


def test_cache_cost_grows_with_draft_length():
    c = measured(plain=(1.0, 0.008), n=0)
    for _ in range(8):
        c.record(PLAIN, 1, 0.008)
        c.record(CACHE, 2, 0.008, drafted=2)
        c.record(CACHE, 6, 0.016, drafted=16)
    assert abs(c.cache_cost.seconds(2) - 0.008) < 1e-4 and abs(c.cache_cost.seconds(16) - 0.016) < 1e-4
    assert abs(c.yield_needed(2, PLAIN)) < 0.02  # a short draft costs a plain step: any yield pays
    assert c.cache_pays(0.0, PLAIN, tau=6, length=2)
    assert abs(c.yield_needed(16, PLAIN) - 1.0) < 0.02  # a long one costs two: it must yield one more token
    assert not c.cache_pays(0.5, PLAIN, tau=0, length=16) and c.cache_pays(1.5, PLAIN, tau=9, length=16)


def test_cost_slope_is_flat_until_lengths_vary_and_never_negative():
    c = CycleCosts()
    for _ in range(5):
        c.record(CACHE, 3, 0.010, drafted=4)
    assert c.cache_cost.seconds(1) == c.cache_cost.seconds(30) == 0.010
    for n, s in [(2, 0.020), (20, 0.010)] * 10:  # longer drafts measured cheaper (noise)
        c.record(CACHE, 3, s, drafted=n)
    assert c.cache_cost.seconds(30) == c.cache_cost.seconds(1)


def test_cost_per_committed_token_is_not_charged_to_draft_length():
    """A cycle costs 4 ms plus 1 ms per committed token whatever its draft length; long drafts
    commit more. The fit finds no cost per draft token, so a 16-token draft needs no more
    yield than a 2-token one (a fit on length alone asks it for one more token)."""
    c = CycleCosts()
    for _ in range(8):
        c.record(PLAIN, 1, 0.005)
        for n, k in [(2, 1), (2, 3), (16, 3), (16, 9)]:
            c.record(CACHE, k, 0.004 + 0.001 * k, drafted=n)
    a, b, per_token = c.cache_cost.coefficients()
    assert abs(a - 0.004) < 1e-6 and abs(b) < 1e-6 and abs(per_token - 0.001) < 1e-6
    assert abs(c.yield_needed(2, PLAIN)) < 1e-6 and abs(c.yield_needed(16, PLAIN)) < 1e-6
    assert abs(c.cache_cost.seconds(16, 3) - 0.007) < 1e-6


class CountingMLP:
    """A predictor that answers ``y`` and counts its calls."""

    def __init__(self, y: float = 0.0):
        self.y, self.calls = y, 0

    def predict(self, phi):
        import numpy as np

        self.calls += 1
        return np.full(np.atleast_2d(phi).shape[0], self.y)


class NoFlags:
    rows = [(0.0,) * 5] * 8

    def of(self, ids):
        import numpy as np

        return np.zeros(5, np.float32)


def test_predictor_is_not_asked_when_any_yield_would_pass():
    from services.common.types import Draft
    from services.drafter.hybrid import PredictorRule
    from services.predictor.features import YieldTracker

    mlp = CountingMLP()
    rule = PredictorRule(mlp, NoFlags(), tau=6)
    c = measured(plain=(1.0, 0.010), cache=(3.0, 0.008))  # a cache cycle is cheaper than a plain one
    draft = Draft(token_ids=[1, 2, 3], source="suffix")
    assert rule.verify_cache(draft, YieldTracker(10, 100), 8, PLAIN, c) and mlp.calls == 0
    slow = measured(plain=(1.0, 0.004), cache=(3.0, 0.008))  # here ŷ must reach 1
    assert not rule.verify_cache(draft, YieldTracker(10, 100), 8, PLAIN, slow) and mlp.calls == 1


def test_length_buckets():
    from services.drafter.hybrid import length_bucket

    assert [length_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 3, 4, 5, 5, 6, 6, 7, 7]


def test_prediction_skipped_where_declines_do_not_repay_it():
    """Consult the predictor only where the mean realized gain of its declines (tokens, from
    the declined drafts' true yields) covers its cost (seconds × the fallback's tokens/s);
    elsewhere verify, re-consulting now and then."""
    from services.drafter.hybrid import PredictionValue

    v = PredictionValue(warmup=4, explore_every=8)
    rate = 100.0  # fallback tokens/s: a 1 ms prediction costs 0.1 token
    assert v.worth(3, rate)  # unmeasured: consult
    v.record_cost(0.001)
    for _ in range(4):
        v.realize(3, need=0.5, declined=False, y=2)  # short drafts pass: no gain
        v.realize(16, need=3.0, declined=True, y=0)  # long ones are declined, rightly: 3 tokens each
    assert v.worth(16, rate)
    consulted = [v.worth(3, rate) for _ in range(16)]
    assert consulted.count(True) == 2 and consulted[7] and consulted[15]  # every 8th re-measures
    for _ in range(60):  # short drafts start failing: declines gain again
        v.realize(3, need=0.5, declined=True, y=0)
    assert v.worth(3, rate)


def test_wrong_declines_turn_the_predictor_off():
    """Declines of drafts that would have yielded more than they needed lose tokens: however
    confident ŷ was, the predictor is then skipped there (and such drafts verified)."""
    from services.drafter.hybrid import PredictionValue

    v = PredictionValue(warmup=4, explore_every=100)
    v.record_cost(1e-6)  # nearly free
    for _ in range(20):
        v.realize(8, need=2.0, declined=True, y=6)  # declined, but it would have yielded 6
    assert not v.worth(8, 100.0)
    assert v.worth(3, 100.0)  # another bucket is not judged by this one


def test_rule_skips_the_predictor_where_it_does_not_pay():
    from services.common.types import Draft
    from services.drafter.hybrid import PredictorRule
    from services.predictor.features import YieldTracker

    mlp = CountingMLP(y=5.0)  # always passes: a decline never happens
    rule = PredictorRule(mlp, NoFlags(), tau=6)
    c = measured(plain=(1.0, 0.004), cache=(3.0, 0.008))  # ŷ must reach 1: the predictor is asked
    c.prediction.record_cost(0.001)  # at 250 tok/s, a prediction costs 0.25 token
    verdicts = []
    for _ in range(64):
        draft = Draft(token_ids=[1, 2, 3], source="suffix")
        verdicts.append(rule.verify_cache(draft, YieldTracker(10, 100), 8, PLAIN, c))
        if "yield_needed" in draft.features:  # the draft's true yield, as the hybrid books it
            c.realize_prediction(3, draft.features["yield_needed"], not verdicts[-1], 3)
    assert all(verdicts)
    assert 16 <= mlp.calls < 24  # warm-up (16), then one in 16


def test_a_cache_cycle_is_costed_at_the_length_the_router_verified():
    """Under a grammar the router cuts a cache draft at its first forbidden token: the cycle's
    seconds are fitted against the tokens verified, not the tokens the cache proposed."""
    from services.common.types import Draft, Sampling
    from services.drafter.hybrid import HybridDrafter, ScoreRule

    class Cache(Drafter):
        def start(self, *a, **k): ...
        def propose(self, req_id, budget):
            return Draft(token_ids=[1, 2, 3, 4, 5], score=5.0)

        def verified(self, req_id, n):
            cut.append(n)

        def observe(self, *a): ...
        def stop(self, *a): ...

    costs = CycleCosts()
    recorded, cut = [], []
    costs.record = lambda choice, tokens, seconds, drafted=0, gap=None: recorded.append((choice, drafted))
    hybrid = HybridDrafter("h", Cache(), "eagle3", ScoreRule(0.0), max_cache=8, max_model=4, costs=costs)
    hybrid.start("r", [7, 8], Sampling(), None, 32)
    for verified in (5, 2):  # the first cycle carries the prefill and is not costed
        hybrid.propose("r", 8)
        hybrid.verified("r", verified)
        hybrid.observe("r", [1, 2, 9])
    assert recorded == [(CACHE, 2)]
    assert cut == [5, 2]  # the cache drafter is told too


def test_the_model_drafter_is_judged_at_its_steady_catch_up_cost():
    """A model cycle after a long gap pays the head's catch-up over it, which the next model
    cycle would owe anyway: the model is judged at the gap of back-to-back cycles."""
    c = measured(model=(2.0, 0.005), plain=(1.0, 0.003), n=0)
    for i in range(40):
        gap = 2 if i % 4 == 0 else 30  # mostly sporadic use
        c.record(MODEL, 2, 0.004 + 0.0005 * gap, gap=gap)
        c.record(PLAIN, 1, 0.003)
        c.record(CACHE, 2, 0.004, drafted=2)
    assert c.ema[MODEL].rate() < c.ema[PLAIN].rate()  # sporadic: 2 tokens in 14 ms on most cycles
    assert c.fallback() == MODEL  # steady: 2 tokens in 5 ms, 400 tok/s against 333
    assert c.yield_needed(1, MODEL) > c.yield_needed(1, PLAIN)


def test_the_hybrid_books_the_catch_up_gap_of_its_model_cycles():
    from services.common.types import Draft, Sampling
    from services.drafter.hybrid import HybridDrafter, ScoreRule

    script = iter([(CACHE, 3), (MODEL, 2), (CACHE, 1), (PLAIN, 1), (MODEL, 2), (MODEL, 3)])

    class Cache(Drafter):
        def start(self, *a, **k): ...
        def propose(self, req_id, budget):
            return Draft(token_ids=[1], score=9.0 if choice == CACHE else 0.0)

        def verified(self, req_id, n): ...
        def observe(self, *a): ...
        def stop(self, *a): ...

    costs = CycleCosts()
    recorded = []
    costs.record = lambda choice, tokens, seconds, drafted=0, gap=None, back_to_back=False: recorded.append(
        (choice, gap, back_to_back)
    )
    costs.fallback = lambda: choice
    costs.take = lambda fallback: fallback
    hybrid = HybridDrafter("h", Cache(), "eagle3", ScoreRule(1.0), max_cache=8, max_model=4, costs=costs)
    hybrid.start("r", [7, 8], Sampling(), None, 32)
    for choice, n in script:
        hybrid.propose("r", 8)
        hybrid.observe("r", list(range(n)))
    # the first cycle carries the prefill and the first model cycle the head's prefill: neither is booked
    assert recorded == [(CACHE, None, False), (PLAIN, None, False), (MODEL, 4, False), (MODEL, 2, True)]


def test_a_sporadic_model_cycle_is_followed_by_another_while_none_came_back_to_back():
    from services.common.types import Draft, Sampling
    from services.drafter.hybrid import Delegate, HybridDrafter, ScoreRule

    c = CycleCosts(steady_every=2)
    assert c.follow_up()  # nothing measured back to back yet
    c.record(MODEL, 2, 0.005, gap=2, back_to_back=True)
    assert not c.follow_up()
    c.record(MODEL, 2, 0.009, gap=20)
    assert not c.follow_up()
    c.record(MODEL, 2, 0.009, gap=20)
    assert c.follow_up()  # two sporadic ones since

    class Cache(Drafter):  # drafts worth verifying only when ``good``
        def start(self, *a, **k): ...
        def propose(self, req_id, budget):
            return Draft(token_ids=[1], score=9.0 if good else 0.0)

        def verified(self, req_id, n): ...
        def observe(self, *a): ...
        def stop(self, *a): ...

    costs = CycleCosts(steady_every=2)
    costs.fallback = lambda: MODEL
    costs.take = lambda fallback: fallback
    hybrid = HybridDrafter("h", Cache(), "eagle3", ScoreRule(1.0), max_cache=8, max_model=4, costs=costs)
    hybrid.start("r", [7, 8], Sampling(), None, 64)
    picks = []
    for good in (True, False, True, False, True, True):
        picks.append(isinstance(hybrid.propose("r", 8), Delegate))
        hybrid.observe("r", [5, 6])
    # cycle 2 is the request's first model cycle (not booked); cycle 4 is booked, sporadic: cycle 5 follows it
    assert picks == [False, True, False, True, True, False]


def test_yield_calibration_corrects_each_length_bucket_after_warm_up():
    from services.drafter.hybrid import YieldCalibration

    cal = YieldCalibration(warmup=16)
    for i in range(15):
        cal.realize(1, 0.7, 0)
        assert cal(1, 0.7) == 0.7  # not before 16 are known
    cal.realize(1, 0.7, 0)
    assert abs(cal(1, 0.7)) < 1e-9  # ŷ 0.7 where y was 0
    assert cal(1, 1.0) == pytest.approx(0.3)
    assert cal(2, 0.7) == 0.7 and cal(16, 5.0) == 5.0  # other lengths keep their own


def test_the_hybrid_calibrates_its_predictor_by_the_yields_it_learns():
    """A predictor that promises 0.7 tokens for 1-token drafts that never pass: once 16 true
    yields are known the hybrid stops verifying them (paper rule, ŷ > τ = 0.5)."""
    from services.common.types import Draft, Sampling
    from services.drafter.hybrid import HybridDrafter, PredictorRule

    class Cache(Drafter):
        def start(self, *a, **k): ...
        def propose(self, req_id, budget):
            return Draft(token_ids=[1], score=1.0)

        def verified(self, req_id, n): ...
        def observe(self, *a): ...
        def stop(self, *a): ...

    mlp = CountingMLP(0.7)
    rule = PredictorRule(mlp, NoFlags(), tau=0.5)
    hybrid = HybridDrafter("h", Cache(), "eagle3", rule, max_cache=8, max_model=4)
    hybrid.start("r", [7, 8], Sampling(), None, 64)
    chose = []
    for _ in range(24):
        chose.append(not hasattr(hybrid.propose("r", 8), "drafter"))  # a Delegate has .drafter
        hybrid.observe("r", [5])  # the target never agrees
    assert chose == [True] * 16 + [False] * 8
    assert rule.calibration(1, 0.7) == pytest.approx(0.0)


def test_a_step_s_cache_drafts_are_judged_in_one_predictor_call():
    """``propose_batch``: the cache drafts of every session in the step are drafted in one
    call and judged by one predictor call over all of them; each session's choice is its own."""
    import numpy as np

    from services.common.types import Delegate, Draft, Sampling
    from services.drafter.hybrid import HybridDrafter, PredictorRule

    class Cache(Drafter):
        batches: list[int] = []

        def start(self, *a, **k): ...
        def propose(self, req_id, budget):
            return Draft(token_ids=[1] * len(req_id), score=1.0)

        def propose_batch(self, asks):
            self.batches.append(len(asks))
            return super().propose_batch(asks)

        def observe(self, *a): ...
        def stop(self, *a): ...

    class ByLength:  # ŷ = draft length - 1.5 (feature 2 is the length)
        calls, rows = 0, 0

        def predict(self, phi):
            self.calls, self.rows = self.calls + 1, self.rows + len(phi)
            return np.asarray(phi)[:, 2] - 1.5

    mlp, cache = ByLength(), Cache()
    hybrid = HybridDrafter("h", cache, "eagle3", PredictorRule(mlp, NoFlags(), tau=0.5), max_cache=8, max_model=4)
    names = ["a", "bb", "ccc", "dddd"]
    for r in names:
        hybrid.start(r, [7, 8], Sampling(), None, 64)
    out = hybrid.propose_batch([(r, 8) for r in names])
    assert mlp.calls == 1 and mlp.rows == 4 and cache.batches == [4]
    assert [isinstance(o, Delegate) for o in out] == [True, True, False, False]  # ŷ > τ from 3 tokens
    assert [hybrid.states[r].chose_cache for r in names] == [False, False, True, True]


def test_a_steps_plans_at_once_equal_each_planned_alone():
    """``plan_all`` (a step's drafts under one lock, the fit read once) answers each draft as
    ``plan`` alone would, in order: the prediction's explore counters included."""
    import random

    def costs() -> CycleCosts:
        rng = random.Random(5)
        c = CycleCosts(warmup=4)
        for _ in range(40):
            n = rng.randint(1, 16)
            c.record(CACHE, rng.randint(1, n + 1), 0.008 + 0.001 * n + rng.random() * 0.002, n)
            c.record(rng.choice([MODEL, PLAIN]), rng.randint(1, 3), 0.006 + rng.random() * 0.004, gap=rng.randint(1, 4))
        for n in range(1, 17):  # every bucket past warm-up, with gains either way
            for _ in range(20):
                c.prediction.realize(n, 1.0, declined=rng.random() < 0.5, y=rng.randint(0, 3))
        c.prediction.record_cost(0.002)
        return c

    rng = random.Random(6)
    asks = [(rng.randint(1, 16), rng.choice([MODEL, PLAIN])) for _ in range(200)]
    together, alone = costs(), costs()
    planned = together.plan_all(asks)
    assert planned == [alone.plan(n, f) for n, f in asks]
    assert together.prediction._skipped == alone.prediction._skipped
    assert any(need is not None and need > 0 and not worth for need, worth in planned)  # some not worth predicting
    assert CycleCosts(warmup=4).plan_all(asks[:3]) == [(None, True)] * 3  # unmeasured: the paper's rule
