"""Static steps (``--static-steps``, services/common/graphs.py): single-session target steps in
static shapes, which a GPU replays from CUDA graphs. On the CPU they run the same static
forward eagerly: every method must give the tokens it gives on the eager forward, the EAGLE-3
head fed by the static step's captured features included."""

import pytest

from services.common.config import EngineConfig
from services.router.engine import Engine, GenerationRequest

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "import os\n\nfor name in os.listdir('.'):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]
METHODS = ["vanilla", "sd", "suffix", "eagle3", "hybrid", "eagle3-tree"]


@pytest.fixture(scope="module")
def static_engine():
    engine = Engine(EngineConfig(static_steps=True))
    yield engine
    engine.close()


def outputs(engine: Engine, method: str) -> list[list[int]]:
    return [
        engine.generate(GenerationRequest(engine.encode(p), 48, method=method, ignore_eos=True)).result()["token_ids"]
        for p in PROMPTS
    ]


@pytest.mark.parametrize("method", METHODS)
def test_static_steps_give_the_eager_forwards_tokens(bundled_engine, static_engine, method):
    model = static_engine.verifier.runner.model
    assert model.static_steps is not None and bundled_engine.verifier.runner.model.static_steps is None
    calls = []
    steps = model.static_steps
    model.static_steps = lambda *a, **k: calls.append(a[0].shape[1]) or steps(*a, **k)
    try:
        got = outputs(static_engine, method)
    finally:
        model.static_steps = steps
    assert got == outputs(bundled_engine, method)
    assert calls and max(calls) <= 16, "no step went through the static path, or a prompt did"
