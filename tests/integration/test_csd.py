"""CSD end to end on the engine: lossless when the gate is closed, rescues when it opens."""

import torch

from services.common.config import GateConfig
from services.router.engine import GenerationRequest
from services.verifier.policies import CalibratedGreedy

PROMPTS = ["def add(a, b):\n", "import os\n\nclass Config:\n", "for i in range(10):\n    ", "x = ["]


def run(eng, method, text, n=40):
    return eng.generate(GenerationRequest(eng.encode(text), n, method=method)).result()


def with_policy(eng, name, policy):
    old = eng.verifier.policies[name]
    eng.verifier.policies[name] = policy
    return old


def test_closed_gate_is_exactly_vanilla_and_memory_learns(tiny_engine):
    eng = tiny_engine
    old = with_policy(eng, "csd", CalibratedGreedy(GateConfig(min_count=0, top_k=50, tau=1.0), eng.verifier.memory))
    try:
        pairs_before = len(eng.verifier.memory)
        for text in PROMPTS:
            out = run(eng, "csd", text)
            assert out["token_ids"] == run(eng, "vanilla", text)["token_ids"]
            assert out["stats"]["rescued_tokens"] == 0
        assert len(eng.verifier.memory) > pairs_before  # first rejections were recorded
    finally:
        eng.verifier.policies["csd"] = old


def test_open_gate_rescues_within_top_k(tiny_engine):
    eng = tiny_engine
    gate = GateConfig(min_count=0, top_k=3, tau=0.05, use_memory=False)
    old = with_policy(eng, "scg", CalibratedGreedy(gate))
    try:
        rescued = cycles_scg = cycles_sd = 0
        for text in PROMPTS:
            out = run(eng, "scg", text)
            rescued += out["stats"]["rescued_tokens"]
            cycles_scg += out["stats"]["cycles"]
            cycles_sd += run(eng, "sd", text)["stats"]["cycles"]
            ids = eng.encode(text)
            # every emitted token is within the target's top-k at its position
            with torch.no_grad():
                logits = eng.verifier.runner.model.forward_train(torch.tensor([ids + out["token_ids"]]))[0]
            for i, tok in enumerate(out["token_ids"]):
                row = logits[len(ids) - 1 + i]
                assert int((row > row[tok]).sum()) < 3
        assert rescued > 0 and cycles_scg < cycles_sd
    finally:
        eng.verifier.policies["scg"] = old
