"""The images, run as the chart runs them: every container of a services-mode release (router,
verifier, drafter, predictor, memory, and the models init container) started with podman from the
rendered manifests' own image, command, arguments, environment, volumes and security settings
(nothing retyped: this file only translates a pod spec into `podman run`), on a network where
each Service's name resolves to its container, beside the chart's Redis (its command run here). Then
Generate, gRPC health, the OpenAI HTTP API and /metrics through the router's container.

Needs the images (`make image`); `make image-test` builds them and runs this."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/specmesh"
VERSION = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "deploy/container/containers.conf")}
NETWORK = "specmesh-smoke"
VALUES = {
    "mode": "services",
    "image": {"tag": VERSION, "pullPolicy": "Never"},
    "models": {"image": f"specmesh/specmesh-models:{VERSION}"},
    "verifier": {"replicas": 1, "gpus": 0},
    "router": {"replicas": 1},
}


def podman(*args: str, check: bool = True) -> str:
    out = subprocess.run(["podman", *args], env=ENV, capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}...: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip()


def render() -> list[dict]:
    import helm_python as helm

    out = helm.Chart.load(str(CHART)).render(VALUES, name="demo", namespace="llm")
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def secret_value(docs, ref: dict) -> str:
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"])
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def env_of(docs, container: dict) -> list[str]:
    """The container's environment as Kubernetes sets it: secret references read from the
    rendered Secrets, $(NAME) expanded from the variables defined before it."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        value = secret_value(docs, e["valueFrom"]["secretKeyRef"]) if "valueFrom" in e else str(e["value"])
        env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)
    return [f"{k}={v}" for k, v in env.items()]


def volumes_of(docs, pod: dict, container: dict, models_dir: Path, scratch: Path) -> list[str]:
    """podman volume flags for the container's mounts: the models emptyDir is the directory the
    init container filled, other emptyDirs are tmpfs, secrets are files written from the
    rendered Secret."""
    flags = []
    by_name = {v["name"]: v for v in pod["volumes"]}
    for m in container.get("volumeMounts", []):
        vol, ro = by_name[m["name"]], ":ro" if m.get("readOnly") else ""
        if m["name"] == "models":
            flags += ["-v", f"{models_dir}:{m['mountPath']}{ro}"]
        elif "emptyDir" in vol:
            flags += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
        elif "secret" in vol:
            name = vol["secret"]["secretName"]
            secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name)
            d = scratch / name
            d.mkdir(exist_ok=True)
            for key, data in secret["data"].items():
                (d / key).write_bytes(base64.b64decode(data))
                os.chmod(d / key, 0o444)
            flags += ["-v", f"{d}:{m['mountPath']}{ro}"]
        else:
            raise AssertionError(f"volume kind not handled here: {vol}")
    return flags


def security_of(pod: dict, container: dict) -> list[str]:
    pod_sc, sc = pod.get("securityContext", {}), container.get("securityContext", {})
    flags = ["--user", f"{pod_sc['runAsUser']}:{pod_sc.get('runAsGroup', pod_sc['runAsUser'])}"]
    if sc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if not sc.get("allowPrivilegeEscalation", True):
        flags += ["--security-opt", "no-new-privileges"]
    for cap in sc.get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", cap]
    return flags


def aliases(docs, workload: dict) -> list[str]:
    """The DNS names that reach this workload's pod: each Service selecting it, and a
    StatefulSet pod's own name under its headless Service."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    names = [
        s["metadata"]["name"]
        for s in docs
        if s["kind"] == "Service" and s["spec"]["selector"].items() <= labels.items()
    ]
    if workload["kind"] == "StatefulSet":
        names.append(f"{workload['metadata']['name']}-0.{workload['spec']['serviceName']}")
    return names


def bundled_redis(docs, host: str, scratch: Path) -> subprocess.Popen:
    """The chart's bundled Redis, its rendered command run on this machine (no Redis image here):
    only where it listens (the network's gateway, which its Service name resolves to) and its
    directory change."""
    sts = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-redis"))
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["sh", "-c"]
    script = c["command"][2].replace("redis-server -", f"redis-server - --bind {host} --port 6379 --dir {scratch}")
    env = {"PATH": "/usr/bin:/bin", **dict(e.split("=", 1) for e in env_of(docs, c))}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    assert proc.poll() is None, "the chart's Redis command did not start"
    return proc


def wait_serving(addr: str, within_s: float = 180) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + within_s
    while True:
        try:
            with grpc.insecure_channel(addr) as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > end:
            raise AssertionError(f"{addr}: not serving after {within_s} s")
        time.sleep(1)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    if not shutil.which("podman"):
        pytest.fail("podman is required (make image-test installs nothing: see docs/deploy.md)")
    for image in (f"specmesh/specmesh:{VERSION}", f"specmesh/specmesh-models:{VERSION}"):
        if subprocess.run(["podman", "image", "exists", image], env=ENV).returncode != 0:
            pytest.fail(f"image {image} missing: run make image")
    docs = render()
    scratch = tmp_path_factory.mktemp("release")
    models = scratch / "models"
    models.mkdir()
    os.chown(models, 10001, 10001)
    podman("network", "rm", "-f", NETWORK, check=False)
    podman("network", "create", NETWORK)
    gateway = json.loads(podman("network", "inspect", NETWORK))[0]["subnets"][0]["gateway"]
    redis = bundled_redis(docs, gateway, scratch)
    started: list[str] = []
    workloads = [
        d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and not d["metadata"]["name"].endswith("-redis")
    ]
    try:
        for w in workloads:
            pod = w["spec"]["template"]["spec"]
            for init in pod.get("initContainers", []):  # each pod's init fills the shared models dir
                podman(
                    "run", "--rm", "--network", NETWORK, *security_of(pod, init),
                    *volumes_of(docs, pod, {**init, "volumeMounts": init["volumeMounts"]}, models, scratch),
                    "--entrypoint", init["command"][0], init["image"], *init["command"][1:],
                )  # fmt: skip
        for w in workloads:
            pod = w["spec"]["template"]["spec"]
            c = pod["containers"][0]
            name = w["metadata"]["name"]
            flags = [f"--network-alias={a}" for a in aliases(docs, w)]
            flags += [f"--add-host=demo-specmesh-redis:{gateway}"]
            for e in env_of(docs, c):
                flags += ["-e", e]
            podman(
                "run", "-d", "--name", name, "--network", NETWORK, *flags, *security_of(pod, c),
                *volumes_of(docs, pod, c, models, scratch), c["image"], *c.get("args", []),
            )  # fmt: skip
            started.append(name)
        ip = json.loads(podman("inspect", "demo-specmesh-router"))[0]["NetworkSettings"]["Networks"][NETWORK][
            "IPAddress"
        ]
        wait_serving(f"{ip}:50051")
        yield ip, docs
    finally:
        print(podman("ps", "-a", check=False))
        for name in started:
            print(f"--- {name} ---\n" + podman("logs", "--tail", "30", name, check=False))
        podman("rm", "-f", "-t", "5", *started, check=False)
        podman("network", "rm", "-f", NETWORK, check=False)
        redis.terminate()
        redis.wait(10)


def test_generate_health_http_and_metrics_through_the_charts_containers(release):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specmesh.v1 import generate_pb2 as gpb
    from specmesh.v1 import generate_pb2_grpc as ggrpc

    ip, _ = release
    with grpc.insecure_channel(f"{ip}:50051") as ch:
        msgs = list(
            ggrpc.GenerationStub(ch).Generate(
                gpb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=16, method="sd"), timeout=120
            )
        )
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert sum(len(m.token_ids) for m in msgs) == 16 and msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", body, {"content-type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"]
    metrics = urllib.request.urlopen(f"http://{ip}:9400/metrics", timeout=10).read().decode()
    assert re.search(r"^specmesh_requests_total\{.*\} [1-9]", metrics, re.M)


def test_the_containers_run_as_the_chart_says(release):
    """Non-root, read-only root filesystem, capabilities dropped: what the pods' security
    settings ask, checked from inside the running router."""
    ip, _ = release
    out = podman("exec", "demo-specmesh-router", "sh", "-c", "id -u; touch /opt/x 2>&1; grep CapEff /proc/1/status")
    uid, touched, caps = out.splitlines()
    assert uid == "10001" and "Read-only file system" in touched and caps.split()[-1] == "0000000000000000"
