"""A real Prometheus (Debian's 2.42) scraping a real server in each topology under load: every
dashboard panel's queries return data, the running-requests gauge equals the streams open, every
alert rule loads and evaluates, and the rules pass their unit tests (``promtool``)."""

import subprocess
import time

import pytest

from bench.prometheus import ROOT, RULES, OpenStreams, Prometheus, binary, drive, panel_queries, start_server
from services.common.runtime import free_port, stop_processes
from tests.conftest import bundled_available, wait_for

METHODS = ["vanilla", "sd", "suffix", "csd", "eagle3", "hybrid"]
OPEN = 3  # streams held open while the running gauges are read


@pytest.fixture(autouse=True)
def _models():
    if not bundled_available():
        pytest.fail("bundled models missing: run `make models`")


def free_run(n: int) -> int:
    """A port whose next ``n - 1`` ports are free too."""
    import socket

    for _ in range(50):
        base = free_port()
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def check_under_load(prom: Prometheus, addr: str, targets: int) -> None:
    """The running gauges equal the open streams; then, after a load, every panel's queries and
    every rule evaluate with data."""
    prom.wait_scraped(targets)
    streams = OpenStreams(addr, OPEN)
    try:
        seen = {}

        def settled() -> bool:
            # the router's count, vLLM's name for it, and the verifiers' own (under its own name)
            for expr in (
                "sum(specmesh_requests_running)",
                "sum(vllm:num_requests_running)",
                "sum(specmesh_verifier_sessions)",
            ):
                result = prom.query(expr)
                seen[expr] = float(result[0]["value"][1]) if result else None
            return all(v == OPEN for v in seen.values())

        assert wait_for(settled, timeout=15), f"{OPEN} streams open, Prometheus read {seen}"
        assert streams.running(), "a held stream finished before the gauges were read"
    finally:
        streams.close()
    counts = drive(addr, METHODS, seconds=20)
    assert counts["ok"] >= 2 * len(METHODS) and counts["invalid"] >= 1 and counts["other"] == 0, counts
    time.sleep(3)  # the last scrapes
    empty = [(title, expr) for title, _, expr in panel_queries() if not prom.query(expr)]
    assert not empty, "panels without data:\n" + "\n".join(f"  {t}: {e}" for t, e in empty)
    moved = prom.query("sum(increase(specmesh_spec_decode_num_accepted_tokens_total[1m]))")
    assert float(moved[0]["value"][1]) > 0
    assert prom.query('count by (model_name) (vllm:generation_tokens_total{model_name!=""})')
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert len(rules) >= 6
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_embedded_server_every_panel_has_data(tmp_path, private_redis):
    port, metrics = free_port(), free_port()
    args = ["--port", str(port), "--http-port", "0", "--metrics-port", str(metrics), "--max-sessions", "8"]
    args += ["--redis-url", private_redis.url, "--state-dir", str(tmp_path / "state")]
    binary("prometheus")  # missing: said before a server starts, so none is left behind
    server = start_server(args, port, tmp_path / "serve.log")
    prom = Prometheus([f"127.0.0.1:{metrics}"], free_port(), tmp_path)
    try:
        check_under_load(prom, f"127.0.0.1:{port}", 1)
        up = prom.query('min(specmesh_redis_up{component="ocm"})')
        assert up and float(up[0]["value"][1]) == 1
    finally:
        prom.stop()
        stop_processes([server])


def test_embedded_server_without_redis_every_panel_has_data(tmp_path):
    """`make serve`'s shape (no Redis): every panel still has data; the Redis link reads -1 (none
    configured: local memory by choice), which the Redis-down alert does not take for an outage."""
    port, metrics = free_port(), free_port()
    args = ["--port", str(port), "--http-port", "0", "--metrics-port", str(metrics), "--max-sessions", "8"]
    args += ["--state-dir", str(tmp_path / "state")]
    binary("prometheus")
    server = start_server(args, port, tmp_path / "serve.log")
    prom = Prometheus([f"127.0.0.1:{metrics}"], free_port(), tmp_path)
    try:
        check_under_load(prom, f"127.0.0.1:{port}", 1)
        up = {r["metric"]["component"]: float(r["value"][1]) for r in prom.query("specmesh_redis_up")}
        assert up == {"ocm": -1.0, "suffix_feed": -1.0}, up
        assert not prom.query('ALERTS{alertname=~".*Redis.*"}')
    finally:
        prom.stop()
        stop_processes([server])


def test_distributed_router_and_verifiers_every_panel_has_data(tmp_path, private_redis):
    """The router and its two spawned verifiers, each scraped on its own port."""
    port, metrics = free_run(3), free_run(3)
    args = ["--topology", "distributed", "--replicas", "2", "--port", str(port), "--http-port", "0"]
    args += ["--metrics-port", str(metrics), "--max-sessions", "8", "--redis-url", private_redis.url]
    args += ["--state-dir", str(tmp_path / "state")]
    binary("prometheus")  # missing: said before a server starts, so none is left behind
    server = start_server(args, port, tmp_path / "serve.log")
    prom = Prometheus([f"127.0.0.1:{metrics + i}" for i in range(3)], free_port(), tmp_path)
    try:
        check_under_load(prom, f"127.0.0.1:{port}", 3)
        live = prom.query('sum(specmesh_verifiers_live{component="router"})')
        assert float(live[0]["value"][1]) == 2
        usage = prom.query("vllm:kv_cache_usage_perc")  # from the verifiers, where the K/V is
        assert len(usage) == 2
    finally:
        prom.stop()
        stop_processes([server])


def test_alert_rules_parse_and_pass_their_unit_tests():
    check = subprocess.run([binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 6 rules found" in check.stdout, check.stdout + check.stderr
    tests = ROOT / "tests/prometheus/rules_test.yaml"
    run = subprocess.run(
        [binary("promtool"), "test", "rules", tests.name], cwd=tests.parent, capture_output=True, text=True
    )
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_ray_serve_every_panel_has_data_and_health_follows_the_verifiers(tmp_path, private_redis):
    """Under Ray Serve: the node exporter (every replica process of the node summed, vLLM's names
    too) gives every panel data; the HTTP /metrics through Serve's proxy serves the same sum; gRPC
    health answers NOT_SERVING while no verifier replica is live and Watch streams the changes."""
    import contextlib
    import threading
    import urllib.request

    import grpc
    import ray
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.fleet import ray_serve

    metrics_port = free_port()
    args = {
        "models_dir": str(ROOT / "models"),
        "verifier_gpus": 0,
        "verifier_replicas": 1,
        "cpus_per_replica": 0.25,
        "shared_memory": True,
        "remote_drafter": True,
        "redis_url": private_redis.url,
        "metrics_port": metrics_port,
        "metrics_host": "127.0.0.1",
        "max_sessions": 8,
    }
    with ray_serve(args) as (channel, port, http_port):
        prom = Prometheus([f"127.0.0.1:{metrics_port}"], free_port(), tmp_path)
        try:
            check_under_load(prom, f"127.0.0.1:{port}", 1)
        finally:
            prom.stop()
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()
        assert "vllm:generation_tokens_total{" in text and "specmesh_verify_batch_size_count" in text

        health = health_pb2_grpc.HealthStub(channel)
        S = health_pb2.HealthCheckResponse
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=60).status == S.SERVING
        seen: list[int] = []
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=300)

        def follow() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                for r in watch:
                    seen.append(r.status)

        threading.Thread(target=follow, daemon=True).start()
        assert wait_for(lambda: seen == [S.SERVING], timeout=30), seen
        for name in [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]:
            if "VerifierDeployment" in name:
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

        def status() -> int:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=60).status

        assert wait_for(lambda: status() == S.NOT_SERVING, timeout=30), "health stayed SERVING with no verifier"
        assert wait_for(lambda: status() == S.SERVING, timeout=240), "health did not come back"
        assert wait_for(lambda: seen == [S.SERVING, S.NOT_SERVING, S.SERVING], timeout=10), seen
        watch.cancel()
