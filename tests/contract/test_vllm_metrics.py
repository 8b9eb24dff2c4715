"""/metrics under vLLM's names (``--vllm-metric-names``): the same counts as specmesh's own
series in one scrape, summed over methods and draft sources, with vLLM's ``model_name`` label
and finish reasons."""

import urllib.request
from collections import defaultdict

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.assembly import start_http
from services.common.config import ServerConfig
from services.router.grpc_server import build_server
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import wait_for


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((s.labels, s.value))
    return out


def total(samples, **labels) -> float:
    return sum(v for lab, v in samples if all(lab.get(k) == x for k, x in labels.items()))


def test_vllm_names_count_what_specmesh_counts(tiny_engine):
    from dataclasses import replace

    cfg = ServerConfig(port=0, max_sessions=4, served_model_name="tiny-vllm", vllm_metric_names=True)
    server, servicer, port = build_server(tiny_engine, cfg)
    server.start()
    http = start_http(tiny_engine, replace(cfg, http_port=0), servicer)
    http_port = http.server.servers[0].sockets[0].getsockname()[1]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            prompt = "def add(a, b):\n    return a + b\n\ndef add"
            first = []
            for method in ("sd", "suffix", "sd"):  # the last stops at the output's third token
                kw = {"stop_token_ids": [first[2]]} if first else {}
                msgs = list(
                    stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=24, method=method, **kw), timeout=60)
                )
                first = first or [t for msg in msgs for t in msg.token_ids]
        assert wait_for(lambda: not servicer.active)
        m = scrape(http_port)
    finally:
        http.stop()
        server.stop(0)
    for ours, theirs in (
        ("specmesh_spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
        ("specmesh_spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
        ("specmesh_spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
        ("specmesh_generated_tokens_total", "vllm:generation_tokens_total"),
        ("specmesh_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("specmesh_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
        ("specmesh_requests_running", "vllm:num_requests_running"),
        ("specmesh_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("specmesh_request_queue_time_seconds_count", "vllm:request_queue_time_seconds_count"),
        ("specmesh_request_prefill_time_seconds_count", "vllm:request_prefill_time_seconds_count"),
    ):
        assert [lab["model_name"] for lab, _ in m[theirs]] == ["tiny-vllm"], theirs
        assert total(m[theirs]) == total(m[ours]), (theirs, m[theirs], m[ours])
    assert total(m["vllm:spec_decode_num_accepted_tokens_total"]) > 0 and total(m["vllm:generation_tokens_total"]) >= 3
    positions = {lab["position"] for lab, _ in m["vllm:spec_decode_num_accepted_tokens_per_pos_total"]}
    assert "0" in positions
    for p in positions:
        assert total(m["vllm:spec_decode_num_accepted_tokens_per_pos_total"], position=p) == total(
            m["specmesh_spec_decode_num_accepted_tokens_per_pos_total"], position=p
        )
    ours = m["specmesh_requests_total"]
    theirs = m["vllm:request_success_total"]
    assert (
        total(theirs, finished_reason="stop")
        == total(ours, finish_reason="eos") + total(ours, finish_reason="stop")
        > 0
    )
    assert total(theirs, finished_reason="length") == total(ours, finish_reason="length") > 0
    buckets = sorted((float(lab["le"]), v) for lab, v in m["vllm:time_to_first_token_seconds_bucket"])
    assert buckets[-1][0] == float("inf") and buckets[-1][1] == total(m["vllm:time_to_first_token_seconds_count"])
