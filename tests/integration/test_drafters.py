"""Every drafter the system builds is a ``Drafter`` and answers every one of its methods: the
registered ones, the hybrids and the remote one over a real gRPC drafter service. (The Ray
one: tests/integration/test_ray_serve.py.)"""

import pytest

from services.drafter.base import DRAFTERS, Drafter
from tests.drafters import METHODS, exercise

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def test_the_base_class_names_the_lifecycle_and_refuses_a_partial_drafter():
    assert {
        "start",
        "propose",
        "verified",
        "observe",
        "stop",
        "propose_batch",
        "after_step",
        "absorb",
        "kv_bytes_per_position",
    } <= set(METHODS)

    class Partial(Drafter):  # no observe, no stop
        def start(self, req_id, prompt, sp, rng, max_new_tokens=0): ...

        def propose(self, req_id, budget): ...

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_every_drafter_an_engine_builds_answers_every_method(tiny_dirs, tiny_eagle3):
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    engine = Engine(
        EngineConfig(
            target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=tiny_eagle3, predictor=None, max_new_tokens_limit=200
        )
    )
    core = engine.verifier
    router_side, verifier_side = dict(engine.drafters), dict(core.drafters)
    assert {"suffix", "ngram"} <= set(router_side) and {"draft-lm", "eagle3"} <= set(verifier_side)
    built = {type(d) for d in {**router_side, **verifier_side}.values()}
    assert set(DRAFTERS.values()) <= built, "a registered drafter the engine does not build is not tested here"
    assert any(name.startswith("hybrid") for name in router_side)
    width = 3 * core.runner.model.s.hidden
    try:
        for name, drafter in {**router_side, **verifier_side}.items():
            assert exercise(drafter, PROMPT, width) == set(METHODS), name
    finally:
        engine.close()


def test_the_remote_drafter_answers_every_method_over_grpc():
    from services.drafter.client import RemoteDrafter
    from services.drafter.grpc_server import build_drafter_server
    from services.drafter.suffix import SuffixDrafter

    server, _, port = build_drafter_server(SuffixDrafter(), vocab_size=100, host="127.0.0.1", port=0)
    server.start()
    try:
        assert exercise(RemoteDrafter(f"127.0.0.1:{port}"), PROMPT) == set(METHODS)
    finally:
        server.stop(0)
