"""Yield-predictor replay data agrees with a real suffix run; the MLP learns; rules compare."""

import numpy as np
import pytest

from bench.workloads import Prompt
from services.common.config import EngineConfig
from services.predictor.features import FEATURES, TokenFlags
from services.predictor.mlp import YieldMLP
from services.router.engine import Engine, GenerationRequest
from training.predictor import fit, precision_recall, replay_dataset, report
from training.traces import record_traces

TEXTS = [
    "def area(r):\n    return 3.14 * r * r\n\ndef area(r):\n",
    "import os\nimport sys\nimport os\n",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [",
    "class A:\n    pass\n\nclass B:\n    pass\n\nclass",
]


@pytest.fixture(scope="module")
def traces(tiny_dirs):
    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=None, eagle3=None, max_new_tokens_limit=200))
    return record_traces(eng, [Prompt(f"p{i}", t) for i, t in enumerate(TEXTS * 3)], 48, progress=False)


def test_labels_equal_real_suffix_run(tiny_dirs, traces):
    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=None, eagle3=None, max_new_tokens_limit=200))
    accepted = drafts = 0
    for t in TEXTS * 3:
        s = eng.generate(GenerationRequest(eng.encode(t), 48, method="suffix")).result()["stats"]
        accepted += s["accepted_tokens"]
        drafts += s["drafts_by_source"].get("suffix", 0)
    x, y, scores = replay_dataset(traces, TokenFlags(eng.tokenizer), max_draft=16)
    assert x.shape == (drafts, len(FEATURES)) and int(y.sum()) == accepted and len(scores) == drafts


def test_mlp_learns_and_report_compares_rules(tiny_dirs, traces, tmp_path):
    from transformers import AutoTokenizer

    flags = TokenFlags(AutoTokenizer.from_pretrained(str(tiny_dirs[0])))
    x, y, s = replay_dataset(traces, flags)
    model = fit(x, y, epochs=150, lr=3e-3)
    rep = report(model, x, y, s, tau=6)
    assert rep["mse"] < 0.5 * rep["mse_constant_baseline"]
    assert rep["oracle"]["precision"] == 1.0 and rep["oracle"]["recall"] == 1.0
    model.save(tmp_path / "p", {"tau": 6})
    again = YieldMLP.load(tmp_path / "p")
    assert np.allclose(again.predict(x[:5]), model.predict(x[:5]))


def test_precision_recall():
    pr = precision_recall(np.array([True, True, False, True]), np.array([7, 2, 9, 6]))
    assert pr == {"precision": round(2 / 3, 4), "recall": round(2 / 3, 4), "selected": 3, "high_yield": 3}


def test_loader_rejects_other_features(tmp_path):
    import json

    YieldMLP().save(tmp_path, {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["features"] = cfg["features"][:-1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trained on features"):
        YieldMLP.load(tmp_path)


def test_numpy_predict_equals_torch_forward_and_follows_updates():
    """predict runs on numpy copies of the weights; an in-place update (as an optimizer step
    makes) is picked up on the next call."""
    import torch

    torch.manual_seed(0)
    model = YieldMLP()
    x = np.random.default_rng(0).normal(size=(7, len(FEATURES))).astype(np.float32)
    with torch.no_grad():
        assert np.allclose(model.predict(x), model(torch.from_numpy(x)).numpy(), atol=1e-5)
        model.net[0].weight.mul_(2.0)
        assert np.allclose(model.predict(x), model(torch.from_numpy(x)).numpy(), atol=1e-5)
        model.mean.copy_(torch.linspace(-1, 1, len(FEATURES)))  # normalisation folded into layer 1
        model.std.copy_(torch.linspace(0.5, 3, len(FEATURES)))
        assert np.allclose(model.predict(x), model(torch.from_numpy(x)).numpy(), atol=1e-4)
    assert model.predict(x[0]).shape == (1,)
