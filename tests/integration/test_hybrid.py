"""Hybrid router: lossless, mixes sources per cycle, decisions visible in stats."""
import torch

from services.predictor.features import TokenFlags
from services.predictor.mlp import YieldMLP
from services.router.engine import GenerationRequest
from services.router.hybrid import PredictorRule, ScoreRule

TEXTS = ["def area(r):\n    return 3.14 * r * r\n\ndef area(r):\n", "import os\nimport sys\nimport os\n",
         "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "for i in range(3):\n    print(i)\nfor i in range(3):\n"]


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


def test_hybrid_score_rule_extremes(tiny_eagle_engine):
    eng = tiny_eagle_engine
    eng.add_hybrid("hybrid-rule", ScoreRule(1e9))   # never trust the cache
    assert set(run_all(eng, "hybrid-rule")) == {"eagle3"}
    eng.add_hybrid("hybrid-rule", ScoreRule(0.0))   # always verify a non-empty cache draft
    assert run_all(eng, "hybrid-rule").get("suffix", 0) > 0
