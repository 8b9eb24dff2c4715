"""The metrics catalog's per-cycle time split (services/common/metrics.py)."""

import pytest
from prometheus_client import REGISTRY

from services.common.metrics import CYCLE_PARTS
from services.router.engine import GenerationRequest


def cycle_seconds(method: str) -> dict[str, float]:
    return {
        p: REGISTRY.get_sample_value("specmesh_cycle_seconds_total", {"method": method, "part": p}) or 0.0
        for p in CYCLE_PARTS
    }


@pytest.mark.parametrize("method", ["vanilla", "sd", "suffix"])
def test_cycle_seconds_split_a_request_into_draft_verify_and_other(tiny_engine, method):
    """A request adds its own drafting and verification time (as its stats report them) to
    draft and verify, and the rest of its cycles' time to other; the three add up to no more
    than the request's wall time."""
    before = cycle_seconds(method)
    res = tiny_engine.generate(GenerationRequest(tiny_engine.encode("def add(a, b):\n"), 24, method=method)).result()
    delta = {p: v - before[p] for p, v in cycle_seconds(method).items()}
    st = res["stats"]
    assert delta["draft"] == pytest.approx(st["draft_s"], abs=1e-3)
    assert delta["verify"] == pytest.approx(st["verify_s"], abs=1e-3) and delta["verify"] > 0
    assert delta["other"] > 0 and sum(delta.values()) <= st["wall_s"] + 1e-3
    if method == "sd":  # the draft LM drafts on the verifier
        assert delta["draft"] > 0.1 * delta["verify"]


def test_router_and_verifier_sessions_are_two_series_and_vllms_running_is_the_routers():
    """In one process (embedded) the router and the verifier each keep their own series of
    specmesh_active_sessions (before, both set one gauge and overwrote each other), and
    vllm:num_requests_running reads the router's."""
    from prometheus_client import REGISTRY

    from services.common import metrics as m
    from services.common.vllm_metrics import VllmNames

    m.ACTIVE_SESSIONS.labels("router").set(3)
    m.ACTIVE_SESSIONS.labels("verifier").set(5)
    try:
        get = REGISTRY.get_sample_value
        assert get("specmesh_active_sessions", {"component": "router"}) == 3
        assert get("specmesh_active_sessions", {"component": "verifier"}) == 5
        running = next(f for f in VllmNames("x").collect() if f.name == "vllm:num_requests_running")
        assert [s.value for s in running.samples] == [3]
    finally:
        m.ACTIVE_SESSIONS.labels("router").set(0)
        m.ACTIVE_SESSIONS.labels("verifier").set(0)
