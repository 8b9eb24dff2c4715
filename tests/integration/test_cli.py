"""The `specmesh` entry point as a user runs it: generate --json, serve + client in real processes."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.runtime import free_port

CLI = [sys.executable, "-m", "services.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def wait_serving(server: subprocess.Popen, ch: grpc.Channel, timeout_s: float = 120.0) -> None:
    """Wait until ``server`` answers on ``ch``; fail with its output if it exits first or never
    answers (a bare channel wait only says it timed out)."""
    deadline = time.monotonic() + timeout_s
    ready = grpc.channel_ready_future(ch)
    while True:
        try:
            ready.result(timeout=1)
            return
        except grpc.FutureTimeoutError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            ready.cancel()
            server.kill()
            out = server.communicate(timeout=20)[0] or ""
            raise AssertionError(f"the server did not come up (exit {server.returncode}):\n{out[-3000:]}")


def test_generate_json(tiny_dirs):
    target, draft = tiny_dirs
    out = subprocess.run(
        CLI
        + [
            "generate",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--method",
            "sd",
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "12",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=True,
    )
    obj = json.loads(out.stdout)
    assert set(obj) >= {"text", "token_ids", "stats"} and len(obj["token_ids"]) == 12
    assert set(obj["stats"]) >= {"cycles", "draft_tokens", "accepted_tokens", "tau", "wall_s"}
    assert abs(obj["stats"]["tau"] - 12 / obj["stats"]["cycles"]) < 1e-3


def test_generate_reports_invalid_input(tiny_dirs):
    target, draft = tiny_dirs
    out = subprocess.run(
        CLI + ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--max-new-tokens", "0"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode != 0 and "max_new_tokens" in out.stderr
    for flag in ("--prefill-chunk", "--spec-disable-batch", "--prefix-cache-mb", "--max-model-len"):
        out = subprocess.run(
            CLI + ["generate", "--prompt", "x", flag, "-1"], capture_output=True, text=True, env=ENV, timeout=120
        )
        assert out.returncode == 2 and f"{flag}: expected a whole number >= 0" in out.stderr
    out = subprocess.run(
        CLI + ["serve", "--role", "router", "--affinity-slack", "-1"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 2 and "--affinity-slack: expected a whole number >= 0" in out.stderr


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            out[key] = s.value
    return out


def test_serve_then_client_streams(tiny_dirs):
    target, draft = tiny_dirs
    port, mport, hport = free_port(), free_port(), free_port()
    server = subprocess.Popen(
        CLI
        + [
            "serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--port",
            str(port),
            "--metrics-port",
            str(mport),
            "--http-port",
            str(hport),
            "--response-stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_serving(server, ch)
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        out = subprocess.run(
            CLI
            + [
                "client",
                "--addr",
                f"127.0.0.1:{port}",
                "--prompt",
                "import os",
                "--max-new-tokens",
                "10",
                "--method",
                "sd",
                "--priority",
                "-2",
                "--min-p",
                "0.1",
            ],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "FINISH_REASON_LENGTH" in out.stderr and "10 tokens" in out.stderr
        assert "prompt tokens cached" in out.stderr and "cycles" in out.stderr  # (the server gives stats)
        m = scrape(mport)
        assert m["specmesh_prefix_cache_tokens_total{kind=queried}"] >= 1
        drafted = m["specmesh_spec_decode_num_draft_tokens_total{method=sd,source=draft-lm}"]
        accepted = m["specmesh_spec_decode_num_accepted_tokens_total{method=sd,source=draft-lm}"]
        per_pos = sum(v for k, v in m.items() if k.startswith("specmesh_spec_decode_num_accepted_tokens_per_pos_total"))
        cycles = m["specmesh_cycles_total{method=sd}"]
        assert 0 < accepted <= drafted and per_pos == accepted
        assert m["specmesh_generated_tokens_total{method=sd}"] == 10 == accepted + cycles
        assert m["specmesh_requests_total{finish_reason=length,method=sd}"] == 1
        assert m["specmesh_time_to_first_token_seconds_count{method=sd}"] == 1
        bad = subprocess.run(
            CLI + ["client", "--addr", f"127.0.0.1:{port}", "--prompt", "x", "--method", "nope"],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=60,
        )
        assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr and "method" in bad.stderr
        assert scrape(mport)["specmesh_requests_rejected_total{code=INVALID_ARGUMENT}"] == 1
        body = json.dumps({"prompt": "import os", "max_tokens": 10, "temperature": 0, "method": "sd"}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{hport}/v1/completions", body, {"content-type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(req, timeout=60).read())  # the OpenAI-compatible API beside gRPC
        assert answer["usage"]["completion_tokens"] == 10 and answer["choices"][0]["finish_reason"] == "length"
        assert scrape(mport)["specmesh_generated_tokens_total{method=sd}"] == 20
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    assert server.returncode == 0, server.stdout.read()


def test_calibrate_writes_snapshot_and_loads_redis_prior(tiny_dirs, tmp_path, redis_url):
    import redis

    from services.memory.snapshot import load_snapshot

    target, draft = tiny_dirs
    out = tmp_path / "ocm.json"
    base = [
        sys.executable,
        "-m",
        "training",
        "calibrate",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--limit",
        "3",
        "--max-new-tokens",
        "24",
        "--out",
        str(out),
    ]
    bad = subprocess.run(base + ["--workload", "humaneval"], capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode != 0 and "evaluation set" in bad.stderr
    r = redis.Redis.from_url(redis_url)
    r.delete("specmesh:ocm:prior")
    subprocess.run(
        base + ["--workload", "stdlib-train", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        check=True,
    )
    counts = load_snapshot(out)
    assert counts and all(n >= 1 for n in counts.values())
    prior = r.hgetall("specmesh:ocm:prior")
    assert len(prior) == len(counts)
    r.delete("specmesh:ocm:prior")


def test_component_roles_run_standalone(tiny_dirs, tmp_path):
    from services.predictor.mlp import YieldMLP

    YieldMLP().save(tmp_path / "predictor", {})
    procs = []
    try:
        for role in ("predictor", "drafter", "memory"):
            port = free_port()
            procs.append(
                (
                    role,
                    port,
                    subprocess.Popen(
                        CLI
                        + [
                            "serve",
                            "--role",
                            role,
                            "--port",
                            str(port),
                            "--metrics-port",
                            "0",
                            "--target",
                            str(tiny_dirs[0]),
                            "--predictor",
                            str(tmp_path / "predictor"),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        env=ENV,
                    ),
                )
            )
        for role, port, _ in procs:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                grpc.channel_ready_future(ch).result(timeout=90)
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
                assert status == health_pb2.HealthCheckResponse.SERVING, role
    finally:
        for _, _, p in procs:
            p.terminate()
        for role, _, p in procs:
            assert p.wait(30) == 0, (role, p.stdout.read())


def test_serve_takes_vllms_speculative_config(tiny_dirs, tiny_engine):
    """`serve --speculative-config` (vLLM's flag): its method is the default of a request that
    names none, with the drafter settings it gives (SGLang's server info shows them); the
    output stays vanilla's."""
    from services.router.engine import GenerationRequest
    from specmesh.v1 import generate_pb2 as gpb
    from specmesh.v1 import generate_pb2_grpc as ggrpc

    target, draft = tiny_dirs
    port, http = free_port(), free_port()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    server = subprocess.Popen(
        CLI
        + [
            "serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--eagle3",
            "none",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--http-port",
            str(http),
            "--speculative-config",
            json.dumps(spec),
            "--response-stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    prompt = "x = 1\nx = 1\nx = 1\nx = 1\n"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_serving(server, ch)
            msgs = list(
                ggrpc.GenerationStub(ch).Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=24), timeout=60)
            )
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/get_server_info", timeout=30) as r:
            info = json.loads(r.read())
    finally:
        server.terminate()
        server.wait(timeout=20)
    assert info["speculative_algorithm"] == "ngram" and info["max_draft_tokens"]["ngram"] == 3
    ref = tiny_engine.generate(
        GenerationRequest(tiny_engine.encode(prompt, add_special_tokens=True), 24, method="vanilla")
    ).result()
    assert msgs[-1].method == "ngram" and msgs[-1].stats.draft_tokens > 0
    assert [t for m in msgs for t in m.token_ids] == ref["token_ids"]


def test_serve_stops_when_the_speculative_method_cannot_run(tiny_dirs):
    """--speculative-config asks for eagle3, but no EAGLE-3 head loads: the server says so and
    exits instead of serving another method."""
    target, draft = tiny_dirs
    out = subprocess.run(
        CLI
        + [
            "serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--eagle3",
            "none",
            "--port",
            str(free_port()),
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--speculative-config",
            '{"method": "eagle3"}',
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode != 0
    assert "speculative_config.method: 'eagle3' (eagle3) is not available on these models" in out.stderr
    assert "available: vanilla, sd" in out.stderr


def test_hybrid_metrics_per_source_add_up(tiny_dirs, tiny_eagle3):
    """A hybrid server drafts from two sources; the scraped counters agree with each other:
    per-source accepted ≤ drafted, per-position sum = Σ accepted over sources, generated =
    Σ accepted + cycles, and one hybrid decision per cycle that had a budget."""
    target, draft = tiny_dirs
    port, mport = free_port(), free_port()
    server = subprocess.Popen(
        CLI
        + [
            "serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--eagle3",
            str(tiny_eagle3),
            "--port",
            str(port),
            "--metrics-port",
            str(mport),
            "--http-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_serving(server, ch)
        total = 0
        for prompt in ("x = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\n", "def add(a, b):\n    return a + b\n" * 3):
            out = subprocess.run(
                CLI
                + [
                    "client",
                    "--addr",
                    f"127.0.0.1:{port}",
                    "--prompt",
                    prompt,
                    "--max-new-tokens",
                    "40",
                    "--method",
                    "hybrid-rule",
                ],
                capture_output=True,
                text=True,
                env=ENV,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            total += 40
        m = scrape(mport)
    finally:
        server.terminate()
        server.wait(timeout=20)
    label = "method=hybrid-rule"
    drafted = {
        k.split("source=")[1][:-1]: v
        for k, v in m.items()
        if k.startswith("specmesh_spec_decode_num_draft_tokens_total{") and label in k
    }
    accepted = {
        k.split("source=")[1][:-1]: v
        for k, v in m.items()
        if k.startswith("specmesh_spec_decode_num_accepted_tokens_total{") and label in k
    }
    assert {"suffix", "eagle3"} <= {s for s, v in drafted.items() if v > 0}, drafted
    assert all(accepted.get(s, 0) <= d for s, d in drafted.items())
    per_pos = sum(
        v
        for k, v in m.items()
        if k.startswith("specmesh_spec_decode_num_accepted_tokens_per_pos_total{") and label in k
    )
    cycles = m[f"specmesh_cycles_total{{{label}}}"]
    assert per_pos == sum(accepted.values())
    assert m[f"specmesh_generated_tokens_total{{{label}}}"] == total == sum(accepted.values()) + cycles
    decisions = sum(v for k, v in m.items() if k.startswith("specmesh_hybrid_decisions_total{") and label in k)
    assert 0 < decisions <= cycles


def test_generate_writes_special_tokens_only_when_asked(tiny_dirs):
    """generate --ignore-eos with only the end-of-sequence token allowed: three of its ids,
    and its text only with --no-skip-special-tokens."""
    target, draft = tiny_dirs
    texts = []
    for flag in ("--skip-special-tokens", "--no-skip-special-tokens"):
        out = subprocess.run(
            CLI
            + [
                "generate",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--method",
                "vanilla",
                "--prompt",
                "x",
                "--max-new-tokens",
                "3",
                "--ignore-eos",
                "--allowed-token-id",
                "0",
                flag,
                "--json",
            ],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
            check=True,
        )
        obj = json.loads(out.stdout)
        assert obj["token_ids"] == [0, 0, 0] and obj["finish_reason"] == "length"
        texts.append(obj["text"])
    assert texts == ["", "<|endoftext|>" * 3]


def test_an_empty_or_unreadable_token_file_stops_the_server(tiny_dirs, tmp_path):
    """It never serves without authentication by mistake."""
    target, draft = tiny_dirs
    empty = tmp_path / "token"
    empty.write_text(" \n")
    for path, why in ((empty, "holds no token"), (tmp_path / "missing", "cannot be read")):
        out = subprocess.run(
            CLI
            + ["serve", "--target", str(target), "--draft", str(draft), "--port", "0", "--auth-token-file", str(path)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
        assert out.returncode != 0 and why in out.stderr and "without authentication" in out.stderr


def test_the_distributed_topology_serves_over_tls_with_its_spawned_verifier(tiny_dirs, pki, tmp_path):
    """`serve --topology distributed` spawns its verifier with the same engine options (the option
    table's flags) and reaches it over TLS, trusting --tls-ca; without a CA, or with a file that
    holds none, it stops at start saying so."""
    from services.common.runtime import stop_processes

    target, draft = tiny_dirs
    cert, key = pki["server"]
    base = CLI + [
        "serve",
        "--topology",
        "distributed",
        "--replicas",
        "1",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    ]
    env = {k: v for k, v in ENV.items() if k != "SPECMESH_TLS_CA"}
    no_ca = subprocess.run(base + ["--port", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert no_ca.returncode != 0 and "--tls-ca" in no_ca.stderr
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate")
    bad = subprocess.run(
        base + ["--port", "0", "--tls-ca", str(bogus)], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode != 0 and "holds no PEM certificate" in bad.stderr
    port = free_port()
    server = subprocess.Popen(
        base + ["--port", str(port), "--tls-ca", str(pki["ca"]), "--prefill-chunk", "16"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out = None
        for _ in range(90):  # the router starts once its verifier answers
            out = subprocess.run(
                CLI
                + [
                    "client",
                    "--addr",
                    f"localhost:{port}",
                    "--tls-ca",
                    str(pki["ca"]),
                    "--prompt",
                    "def add(a, b):",
                    "--max-new-tokens",
                    "8",
                    "--method",
                    "sd",
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            if out.returncode == 0:
                break
            time.sleep(1)
        assert out is not None and out.returncode == 0, out.stderr
        assert "[FINISH_REASON_LENGTH] 8 tokens" in out.stderr
        verifier = spawned_verifier(port + 1)
        assert verifier[verifier.index("--prefill-chunk") + 1] == "16"  # the router's engine options, passed on
    finally:
        stop_processes([server])


def spawned_verifier(port: int) -> list[str]:
    """The command line of the verifier process serving on ``port`` (from /proc)."""
    from pathlib import Path

    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode().split("\0")
        except OSError:
            continue
        if "--role" in argv and "verifier" in argv and str(port) in argv:
            return argv
    raise AssertionError(f"no verifier process on port {port}")
