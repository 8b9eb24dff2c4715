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
    assert delta["verify"] + delta["gate"] == pytest.approx(st["verify_s"], abs=1e-3) and delta["verify"] > 0
    assert 0 < delta["gate"] < delta["verify"]  # the acceptance policy, beside the target's forward
    assert delta["network"] == 0  # a verifier in this process
    assert delta["other"] > 0 and sum(delta.values()) <= st["wall_s"] + 1e-3
    if method == "sd":  # the draft LM drafts on the verifier
        assert delta["draft"] > 0.1 * delta["verify"]


def test_router_and_verifier_sessions_are_two_metrics_and_vllms_running_is_the_routers():
    """The router's running completions and a verifier's open sessions are two names, so a
    sum() over either counts each session once; vllm:num_requests_running reads the router's."""
    from prometheus_client import REGISTRY

    from services.common import metrics as m
    from services.common.vllm_metrics import VllmNames

    m.REQUESTS_RUNNING.set(3)
    m.VERIFIER_SESSIONS.set(5)
    try:
        get = REGISTRY.get_sample_value
        assert get("specmesh_requests_running") == 3 and get("specmesh_verifier_sessions") == 5
        running = next(f for f in VllmNames("x").collect() if f.name == "vllm:num_requests_running")
        assert [s.value for s in running.samples] == [3]
    finally:
        m.REQUESTS_RUNNING.set(0)
        m.VERIFIER_SESSIONS.set(0)


def test_known_label_values_start_at_zero_and_a_servers_methods_get_their_series():
    from services.common import metrics as m

    get = REGISTRY.get_sample_value
    assert get("specmesh_verifier_failovers_total", {"stage": "hang"}) is not None
    assert get("specmesh_redis_errors_total", {"component": "suffix_feed"}) is not None
    assert get("specmesh_requests_total", {"method": "zz-new", "finish_reason": "eos"}) is None
    m.known_methods(["zz-new"])
    assert get("specmesh_requests_total", {"method": "zz-new", "finish_reason": "eos"}) == 0
    assert get("specmesh_cycle_seconds_total", {"method": "zz-new", "part": "verify"}) == 0
    assert get("specmesh_hybrid_high_yield_total", {"method": "zz-new", "predicted": "true", "actual": "false"}) == 0
    assert get("specmesh_time_to_first_token_seconds_count", {"method": "zz-new"}) == 0


def test_the_catalogue_follows_prometheus_naming():
    """Base units in the name, no _total in a counter's base name, every help text a sentence."""
    from services.common.metrics import CATALOGUE

    names = [s.name for s in CATALOGUE]
    assert len(names) == len(set(names)) >= 35
    for s in CATALOGUE:
        assert s.name.startswith("specmesh_") and not s.name.endswith("_total"), s.name
        assert s.kind in ("counter", "gauge", "histogram") and len(s.help) > 10, s.name
        if s.unit in ("seconds", "bytes"):
            assert s.name.endswith("_" + s.unit), s.name
        assert set(s.known) <= set(s.labels), s.name


def test_openmetrics_keeps_vllms_colon_names():
    """Prometheus asks for OpenMetrics; a sample must carry the name its HELP and TYPE lines give
    (prometheus_client 0.22-0.26 wrote ``vllm_x`` samples under ``vllm:x``, and Prometheus kept
    no ``vllm:`` series)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest

    from services.common.vllm_metrics import VllmNames

    registry = CollectorRegistry()
    registry.register(VllmNames("m"))
    text = generate_latest(registry).decode()
    samples = [line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert "vllm:num_requests_running" in samples and "vllm:generation_tokens_total" in samples
    assert not [s for s in samples if s.startswith("vllm_")]
