"""Hybrid router: lossless, mixes sources per cycle, decisions visible in stats."""

import torch

from services.common.types import Sampling
from services.drafter.hybrid import CACHE, MODEL, PLAIN, Delegate, PredictorRule, ScoreRule
from services.predictor.features import TokenFlags
from services.predictor.mlp import YieldMLP
from services.router.engine import GenerationRequest

TEXTS = [
    "def area(r):\n    return 3.14 * r * r\n\ndef area(r):\n",
    "import os\nimport sys\nimport os\n",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [",
    "for i in range(3):\n    print(i)\nfor i in range(3):\n",
]


class MatchLenMLP(YieldMLP):
    """A stand-in g_θ: predicted yield = match length (feature 1), to make decisions predictable."""

    @torch.inference_mode()
    def predict(self, phi):
        return phi.reshape(-1, phi.shape[-1])[:, 1]


def run_all(eng, method):
    sources = {}
    for t in TEXTS:
        ids = eng.encode(t)
        van = eng.generate(GenerationRequest(ids, 48, method="vanilla")).result()
        out = eng.generate(GenerationRequest(ids, 48, method=method)).result()
        assert out["token_ids"] == van["token_ids"], (method, t)
        for k, v in out["stats"]["drafts_by_source"].items():
            sources[k] = sources.get(k, 0) + v
    return sources


def test_hybrid_predictor_rule_is_lossless_and_mixes_sources(tiny_eagle_engine):
    eng = tiny_eagle_engine
    eng.add_hybrid("hybrid", PredictorRule(MatchLenMLP(), TokenFlags(eng.tokenizer), tau=1))
    sources = run_all(eng, "hybrid")
    assert sources.get("suffix", 0) > 0 and sources.get("eagle3", 0) > 0, sources
    assert run_all(eng, "hybrid-csd")  # calibrated gating on top of the same drafts runs


def test_cost_aware_hybrid_is_lossless_and_follows_measured_costs(tiny_eagle_engine):
    """Seeded with a model drafter far slower than a plain step, the cost-aware hybrid falls
    back to plain steps (and re-measures the drafter now and then); with a fast one, to it."""
    eng = tiny_eagle_engine
    eng.add_hybrid("hybrid", PredictorRule(MatchLenMLP(), TokenFlags(eng.tokenizer), tau=1), cost_aware=True)
    costs = eng.drafters["hybrid"].costs
    for _ in range(costs.warmup):
        costs.record(MODEL, 1, 10.0)
    run_all(eng, "hybrid")
    plain, model = costs.ema[PLAIN].n, costs.ema[MODEL].n
    assert costs.ema[CACHE].n > 0 and plain >= costs.warmup and model <= costs.warmup + plain // 16 + 1
    eng.add_hybrid("hybrid", PredictorRule(MatchLenMLP(), TokenFlags(eng.tokenizer), tau=1), cost_aware=True)
    costs = eng.drafters["hybrid"].costs
    for _ in range(costs.warmup):
        costs.record(MODEL, 100, 1e-6)
        costs.record(PLAIN, 1, 10.0)
    assert run_all(eng, "hybrid").get("eagle3", 0) > 0
    plain, model = costs.ema[PLAIN].n, costs.ema[MODEL].n
    assert model > costs.warmup and plain <= costs.warmup + model // 16 + 1


def test_cost_aware_hybrid_does_not_charge_a_prefill_to_a_choice(tiny_eagle_engine):
    """Neither a request's first cycle (the target's prefill) nor its first model cycle (the
    EAGLE-3 head's prefill over the prompt) is recorded as a cost."""
    eng = tiny_eagle_engine
    eng.add_hybrid("hybrid", PredictorRule(MatchLenMLP(), TokenFlags(eng.tokenizer), tau=1), cost_aware=True)
    hybrid = eng.drafters["hybrid"]
    chosen = []  # (request, delegated) of cycles the hybrid decided
    propose_batch = hybrid.propose_batch  # the engine asks once per step for all its sessions

    def spy(asks):
        choices = propose_batch(asks)
        chosen.extend((req_id, isinstance(c, Delegate)) for (req_id, _), c in zip(asks, choices))
        return choices

    hybrid.propose_batch = spy
    for t in TEXTS:
        eng.generate(GenerationRequest(eng.encode(t), 24, method="hybrid")).result()
    recorded = sum(e.n for e in hybrid.costs.ema.values())
    started, drafted, unrecorded = set(), set(), 0
    for r, delegated in chosen:
        first_model = delegated and r not in drafted
        unrecorded += r not in started or first_model
        started.add(r)
        drafted |= {r} if delegated else set()
    assert len(started) == len(TEXTS) and drafted, "warm-up tries the model drafter"
    assert recorded == len(chosen) - unrecorded > 0
    assert hybrid.costs.cache_cost.n == hybrid.costs.ema[CACHE].n


def test_consulted_predictions_are_booked_with_their_true_yields(tiny_eagle_engine):
    """Each prediction that weighed a draft against measured costs is booked once its draft's
    true yield is known (declined drafts: by shadow verification), and only then."""
    eng = tiny_eagle_engine
    eng.add_hybrid("hybrid", PredictorRule(MatchLenMLP(), TokenFlags(eng.tokenizer), tau=1), cost_aware=True)
    costs = eng.drafters["hybrid"].costs
    for _ in range(costs.warmup):  # a cache cycle costs 100 plain steps: every draft needs a yield
        costs.record(PLAIN, 1, 1e-4)
        costs.record(CACHE, 1, 1e-2, drafted=4)
    eng.suffix_cache.clear()  # no earlier test's outputs to draft from
    booked = []
    realize = costs.realize_prediction
    costs.realize_prediction = lambda n, need, declined, y: (
        booked.append((n, need, declined, y)) or realize(n, need, declined, y)
    )
    run_all(eng, "hybrid")
    run_all(eng, "hybrid")
    consulted = costs.prediction.cost.n
    assert 0 < len(booked) <= consulted
    assert sum(g.n for g in costs.prediction.gain.values()) == len(booked)
    assert all(0 <= y <= n and need > 0 for n, need, _, y in booked)


def test_hybrid_score_rule_extremes(tiny_eagle_engine):
    eng = tiny_eagle_engine
    eng.add_hybrid("hybrid-rule", ScoreRule(1e9))  # never trust the cache
    assert set(run_all(eng, "hybrid-rule")) == {"eagle3"}
    eng.add_hybrid("hybrid-rule", ScoreRule(0.0))  # always verify a non-empty cache draft
    assert run_all(eng, "hybrid-rule").get("suffix", 0) > 0


def test_tau_sweep_rows_and_extremes(tiny_eagle_engine, tmp_path):
    """bench.hybrid_sweep: every setting is lossless; τ = ∞ is EAGLE-3 alone, cycle for cycle."""
    from bench.hybrid_sweep import best, markdown, plot, sweep
    from bench.workloads import Prompt

    eng = tiny_eagle_engine
    eng.add_hybrid("hybrid", PredictorRule(MatchLenMLP(), TokenFlags(eng.tokenizer), tau=1))
    eng.add_hybrid("hybrid-rule", ScoreRule(0.0))
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(TEXTS[:2])]
    rows = sweep(eng, prompts, 24, {"hybrid": [1.0, 1e9], "hybrid-rule": [0.0, 1e9]})
    assert [(r["method"], r["setting"]) for r in rows] == [
        ("suffix", None),
        ("eagle3", None),
        ("hybrid", "cost-aware"),
        ("hybrid", 1.0),
        ("hybrid", 1e9),
        ("hybrid-rule", 0.0),
        ("hybrid-rule", 1e9),
    ]
    assert all(r["exact_match_vs_vanilla"] == 1.0 for r in rows)
    by = {(r["method"], r["setting"]): r for r in rows}
    assert by["hybrid", 1e9]["cycles_per_1k"] == by["eagle3", None]["cycles_per_1k"]
    result = {
        "workload": "t",
        "limit": 2,
        "max_new_tokens": 24,
        "command": "test",
        "rows": rows,
        "best": {m: best(rows, m) for m in ("hybrid", "hybrid-rule")},
    }
    assert "| hybrid | tau = 1.0 |" in markdown(result) and "| hybrid | cost-aware |" in markdown(result)
    plot(result, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_a_delegated_cycle_verifies_the_cache_draft_beside_the_models(tiny_eagle_engine):
    """A cycle that asks the verifier's drafter and also carries a router draft (hybrid-tree's
    model cycles) verifies both as one tree: when the router's branch is the true
    continuation it is kept whole, whatever the (untrained) head drafted. A sampled session's
    chain from the head carries a q: it keeps rejection sampling, alone."""
    from services.common.types import CycleRequest, SessionSpec

    eng = tiny_eagle_engine
    ids = eng.encode("def add(a, b):\n")
    ref = eng.generate(GenerationRequest(ids, 12, method="vanilla")).result()["token_ids"]
    session = eng.verifier.open(SessionSpec(ids, 12, model_drafter="eagle3", max_draft=8))
    try:
        first = session.cycle(CycleRequest())  # the prompt's cycle: one token
        assert first.committed == ref[:1]
        both = session.cycle(
            CycleRequest(draft_with="eagle3", budget=3, draft_ids=tuple(ref[1:5]), draft_source="suffix")
        )
        assert both.committed == ref[1 : 1 + len(both.committed)] and len(both.committed) >= 5
        assert both.drafted >= 4
    finally:
        session.close()
    sampled = eng.verifier.open(
        SessionSpec(ids, 12, Sampling(temperature=1.0, seed=3), model_drafter="eagle3", max_draft=8)
    )
    try:
        sampled.cycle(CycleRequest())
        out = sampled.cycle(CycleRequest(draft_with="eagle3", budget=3, draft_ids=(1, 2, 3, 4), draft_source="suffix"))
        assert out.drafted <= 3  # the head's chain only
    finally:
        sampled.close()
