"""The images, run as the chart runs them: every container of a services-mode release (router,
verifier, drafter, predictor, memory, and the models init container) started with podman from the
rendered manifests' own image, command, arguments, environment, volumes and security settings
(nothing retyped: this file only translates a pod spec into `podman run`), on a network where
each Service's name resolves to its container, beside the chart's Redis (its command run here). Then
Generate, gRPC health, the OpenAI HTTP API and /metrics through the router's container.

Needs the images (`make image`); `make image-test` builds them and runs this."""

from __future__ import annotations

import base64
import contextlib
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

from tests.chart import bundled_redis, env_of

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/specmesh"
VERSION = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "deploy/container/containers.conf")}
NETWORK = "specmesh-smoke"
VALUES = {
    "mode": "services",
    "image": {"tag": VERSION, "pullPolicy": "Never"},
    "models": {"image": f"specmesh/specmesh-models:{VERSION}"},
    # the verifier's target split over two processes (tensor parallel on the CPU: gloo)
    "verifier": {"replicas": 1, "gpus": 0, "tensorParallel": 2},
    "router": {"replicas": 1},
}


def podman(*args: str, check: bool = True) -> str:
    out = subprocess.run(["podman", *args], env=ENV, capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}...: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip()


RAY_VALUES = {
    **VALUES,
    "verifier": {"replicas": 1, "gpus": 0},
    "mode": "ray",
    # the head alone serves (no GPU here): no GPU workers, one replica of each deployment, and
    # CPUs enough on the head for all of them (Ray's CPUs are a logical count)
    "ray": {
        "head": {"resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}},
        "gpuWorkers": {"replicas": 0, "minReplicas": 0, "gpus": 0},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 1},
    },
}


def images_of(docs: list[dict]) -> set[str]:
    """The specmesh images the rendered pods run (their containers' and init containers')."""
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("image"), str) and node["image"].startswith("specmesh/"):
                found.add(node["image"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk([d.get("spec", {}) for d in docs if d["kind"] != "Pod"])  # the helm test pod is not started
    return found


def render(values: dict = VALUES) -> list[dict]:
    import helm_python as helm

    out = helm.Chart.load(str(CHART)).render(values, name="demo", namespace="llm")
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


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


class Cluster:
    """What the test stands up around the pods: a podman network whose gateway runs the chart's
    Redis, a models directory the init containers fill, and the containers started."""

    def __init__(self, docs: list[dict], scratch: Path, network: str):
        if not shutil.which("podman"):
            pytest.fail("podman is required: make image-test (docs/deploy.md, Images)")
        for image in images_of(docs):
            if subprocess.run(["podman", "image", "exists", image], env=ENV).returncode != 0:
                pytest.fail(f"image {image} missing: run make image (make image-cuda for a -cuda tag)")
        self.docs, self.scratch, self.started, self.network = docs, scratch, [], network
        self.models = scratch / "models"
        self.models.mkdir()
        os.chown(self.models, 10001, 10001)
        podman("network", "rm", "-f", network, check=False)
        podman("network", "create", network)
        self.gateway = json.loads(podman("network", "inspect", network))[0]["subnets"][0]["gateway"]
        # the network's bridge (and its gateway address, where Redis listens) exists while a container is on it
        self.holder = f"{network}-holder"
        podman("run", "-d", "--rm", "--name", self.holder, "--network", network, "--entrypoint", "sleep",
               f"specmesh/specmesh-models:{VERSION}", "infinity")  # fmt: skip
        try:
            self.redis = bundled_redis(docs, self.gateway, 6379, scratch)
        except BaseException:
            podman("rm", "-f", "-t", "0", self.holder, check=False)
            podman("network", "rm", "-f", network, check=False)
            raise

    def init(self, pod: dict) -> None:
        """Run the pod's init containers (they fill the shared models directory)."""
        for init in pod.get("initContainers", []):
            podman(
                "run", "--rm", "--network", self.network, *security_of(pod, init),
                *volumes_of(self.docs, pod, init, self.models, self.scratch),
                "--entrypoint", init["command"][0], init["image"], *init["command"][1:],
            )  # fmt: skip

    def start(self, name: str, pod: dict, c: dict, args: list[str], extra: list[str] = ()) -> str:
        """Start container ``c`` of ``pod`` as ``name`` with ``args``; returns its address."""
        flags = [*extra, f"--add-host=demo-specmesh-redis:{self.gateway}"]
        for e in env_of(self.docs, c):
            flags += ["-e", e]
        podman(
            "run", "-d", "--name", name, "--network", self.network, *flags, *security_of(pod, c),
            *volumes_of(self.docs, pod, c, self.models, self.scratch), c["image"], *args,
        )  # fmt: skip
        self.started.append(name)
        return json.loads(podman("inspect", name))[0]["NetworkSettings"]["Networks"][self.network]["IPAddress"]

    def close(self) -> None:
        print(podman("ps", "-a", check=False))
        for name in self.started:
            print(f"--- {name} ---\n" + podman("logs", "--tail", "40", name, check=False))
        podman("rm", "-f", "-t", "5", *self.started, check=False)
        podman("rm", "-f", "-t", "0", self.holder, check=False)
        podman("network", "rm", "-f", self.network, check=False)
        self.redis.terminate()
        self.redis.wait(10)


@contextlib.contextmanager
def services_release(values: dict, scratch: Path, network: str = NETWORK):
    """A services-mode release rendered from ``values``: every workload's pod, started from its
    rendered spec; yields (the router's address, the rendered documents)."""
    docs = render(values)
    cluster = Cluster(docs, scratch, network)
    workloads = [
        d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and not d["metadata"]["name"].endswith("-redis")
    ]
    ip = ""
    try:
        for w in workloads:
            cluster.init(w["spec"]["template"]["spec"])
        for w in workloads:
            pod = w["spec"]["template"]["spec"]
            c = pod["containers"][0]
            aliases_ = [f"--network-alias={a}" for a in aliases(docs, w)]
            addr = cluster.start(w["metadata"]["name"], pod, c, c.get("args", []), aliases_)
            ip = addr if w["metadata"]["name"].endswith("-router") else ip
        wait_serving(f"{ip}:50051")
        yield ip, docs
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    with services_release(VALUES, tmp_path_factory.mktemp("release")) as running:
        yield running


@pytest.fixture(scope="module")
def ray_release(tmp_path_factory):
    """A Ray-mode release on a network of its own: the head
    pod started as KubeRay starts it (`ray start --head` with the group's rayStartParams), then
    the RayService's serveConfigV2 deployed to it with `serve deploy`, as KubeRay does."""
    docs = render(RAY_VALUES)
    scratch = tmp_path_factory.mktemp("ray")
    service = next(d for d in docs if d["kind"] == "RayService")
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    pod = head["template"]["spec"]
    c = pod["containers"][0]
    (scratch / "serve").mkdir()
    (scratch / "serve" / "config.yaml").write_text(service["spec"]["serveConfigV2"])
    os.chmod(scratch / "serve" / "config.yaml", 0o444)
    params = [f"--{k}={v}" for k, v in head["rayStartParams"].items()]
    if "num-cpus" not in head["rayStartParams"]:  # KubeRay: the container's CPU limit, else its request
        res = c.get("resources", {})
        params.append(f"--num-cpus={res.get('limits', {}).get('cpu') or res['requests']['cpu']}")
    cluster = Cluster(docs, scratch, NETWORK + "-ray")
    try:
        cluster.init(pod)
        serve_dir = ["-v", f"{scratch / 'serve'}:/etc/specmesh-serve:ro", "--shm-size=1g", "--entrypoint", "ray"]
        ip = cluster.start("demo-specmesh-ray-head", pod, c, ["start", "--head", "--block", *params], serve_dir)
        end = time.monotonic() + 180
        while True:  # the dashboard takes the deployment once it is up
            out = subprocess.run(
                ["podman", "exec", "demo-specmesh-ray-head", "serve", "deploy", "/etc/specmesh-serve/config.yaml"],
                env=ENV, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            if out.returncode == 0:
                break
            assert time.monotonic() < end, out.stderr[-2000:]
            time.sleep(3)
        wait_serving(f"{ip}:50051", within_s=300)
        yield ip, docs
    finally:
        cluster.close()


def generate_health_http_and_metrics(ip: str) -> None:
    """Generate (gRPC), gRPC health, /v1/completions and /metrics through the router at ``ip``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specmesh.v1 import generate_pb2 as gpb
    from specmesh.v1 import generate_pb2_grpc as ggrpc

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
    # the router reached the chart's Redis as its ACL user (a Redis outage would only degrade it)
    assert re.search(r'^specmesh_redis_up\{component="suffix_feed"\} 1\.0$', metrics, re.M), metrics[-3000:]


def test_generate_health_http_and_metrics_through_the_charts_containers(release):
    ip, _ = release
    generate_health_http_and_metrics(ip)


def test_the_containers_run_as_the_chart_says(release):
    """Non-root, read-only root filesystem, capabilities dropped: what the pods' security
    settings ask, checked from inside the running router."""
    ip, _ = release
    out = podman("exec", "demo-specmesh-router", "sh", "-c", "id -u; touch /opt/x 2>&1; grep CapEff /proc/1/status")
    uid, touched, caps = out.splitlines()
    assert uid == "10001" and "Read-only file system" in touched and caps.split()[-1] == "0000000000000000"


def test_the_verifier_serves_split_over_two_ranks(release):
    """verifier.tensorParallel: 2 on the CPU: the verifier's container runs a second rank (a
    spawned worker process) beside the server; every Generate of this release goes through both."""
    ip, docs = release
    args = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-verifier"))
    assert "--tensor-parallel=2" in args["spec"]["template"]["spec"]["containers"][0]["args"]
    name = args["metadata"]["name"]
    ranks = podman("exec", name, "sh", "-c", "grep -l 'spawn_mai[n]' /proc/[0-9]*/cmdline | wc -l")
    assert int(ranks) == 1, ranks


def test_ray_mode_generate_health_http_and_metrics_through_the_head_container(ray_release):
    ip, _ = ray_release
    generate_health_http_and_metrics(ip)


def test_ray_pods_run_as_the_chart_says(ray_release):
    out = podman("exec", "demo-specmesh-ray-head", "sh", "-c", "id -u; touch /opt/x 2>&1; grep CapEff /proc/1/status")
    uid, touched, caps = out.splitlines()
    assert uid == "10001" and "Read-only file system" in touched and caps.split()[-1] == "0000000000000000"
