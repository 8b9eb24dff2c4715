"""The predictor's per-request history must not depend on the router's choices: a declined
cache draft is shadow-verified against later tokens, so its true yield is recorded."""

from services.predictor.features import FEATURES, TokenFlags, YieldTracker


def test_verified_draft_records_its_yield_as_replay_does():
    t = YieldTracker(10, 100)
    assert t.update([1, 2, 3, 4], [1, 2, 9], verified=True, tag="a") == [("a", 2)]
    assert list(t.yields) == [2, 0, 0] and list(t.accepted) == [2, 0, 0] and t.generated == 3


def test_declined_draft_that_misses_within_the_step_is_exact():
    t = YieldTracker(10, 100)
    assert t.update([5, 6, 7], [8], verified=False, tag="b") == [("b", 0)]
    assert t.yields[0] == 0 and not t.shadows


def test_declined_draft_is_shadow_verified_until_it_misses():
    t = YieldTracker(10, 100)
    assert t.update([1, 2, 3, 4, 5], [1], verified=False, tag="d") == []  # censored: yield ≥ 1
    assert list(t.yields) == [0, 0, 0]
    assert t.update([], [2], verified=False) == [(None, 0)]  # an empty draft: yield 0, now
    assert t.update([7], [3, 9], verified=True, tag="e") == [("d", 3), ("e", 0)]
    assert list(t.yields) == [0, 3, 0] and not t.shadows and t.generated == 4


def test_shadow_that_runs_out_counts_the_whole_draft():
    t = YieldTracker(10, 100)
    t.update([1, 2, 3], [1, 2], verified=False, tag="f")
    assert t.update([4, 4], [3, 4, 5], verified=True, tag="g") == [("f", 3), ("g", 0)]


def test_selection_rate_counts_high_yield_drafts_not_choices():
    t = YieldTracker(10, 100)
    draft = list(range(20))
    t.update(draft, [0], verified=False)  # declined; its yield is 9 (> 6)
    t.update(draft[1:], draft[1:9] + [99], verified=True)  # verified; yield 8 (> 6)
    assert list(t.yields) == [8, 9, 0]
    assert abs(t.selection_rate - 0.68) < 1e-9 and abs(t.yield_ema - (0.8 * 0.2 * 9 + 0.2 * 8)) < 1e-9


def test_a_steps_features_in_one_array_equal_each_drafts_own():
    """``featurize_all`` (the router's step) makes the rows ``featurize`` (training, replay) makes."""
    import numpy as np

    from services.common.types import Draft
    from services.predictor.features import featurize, featurize_all

    class Tok:
        def __len__(self):
            return 6

        def decode(self, ids):
            return [" ", "x", ",", "(", "\n", "ab"][ids[0]]

    flags = TokenFlags(Tok())
    t1, t2 = YieldTracker(10, 100), YieldTracker(300, 64)
    t2.update([1, 2, 3], [1, 2, 5], verified=True)
    asks = [
        (Draft([1, 4, 2], token_probs=[0.9, 0.5, 0.25], score=1.65, match_len=7), t1, 8),
        (Draft([]), t2, 3),
        (Draft([5], token_probs=[0.125], score=0.125, match_len=2, features={"tree": "global"}), t2, 16),
    ]
    together = featurize_all(asks, flags)
    assert together.dtype == np.float32 and together.shape == (3, len(FEATURES))
    assert np.array_equal(together, np.stack([featurize(d, t, flags, b) for d, t, b in asks]))
