"""Helm chart, offline: strict lint, schema, render for several values files, kubernetes-validate."""

import base64
import json
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/specmesh"
CRDS = {"RayService", "ServiceMonitor", "PodMonitor"}  # validated structurally here, not by kubernetes-validate


def values_file(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / name).read_text())


def render(values: dict) -> list[dict]:
    out = helm.Chart.load(str(CHART)).render(values, name="demo", namespace="llm")
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    return docs


def kinds(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind, suffix):
    return next(d for d in kinds(docs, kind) if d["metadata"]["name"].endswith(suffix))


def container(doc):
    return doc["spec"]["template"]["spec"]["containers"][0]


VALUES = [
    {},
    {"mode": "services"},
    values_file("services-cpu-external-redis-values.yaml"),
    values_file("services-tls-auth-values.yaml"),
    values_file("services-gpu-values.yaml"),
    values_file("ray-values.yaml"),
]


@pytest.mark.parametrize("values", VALUES)
def test_lint_strict_and_kubernetes_validate(values):
    report = helm.lint(str(CHART), values, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    for doc in render(values):
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, "1.33.0", strict=True)


def test_schema_rejects_bad_values():
    chart = helm.Chart.load(str(CHART))
    for bad in (
        {"mode": "swarm"},
        {"verifier": {"gpus": -1}},
        {"redis": {"bundled": False, "externalUrl": ""}},
        {"models": {"source": "s3"}},
        {"router": {"port": 70000}},
        {"router": {"verifierLink": "udp"}},
        {"verifier": {"prefillChunk": -1}},
        {"verifier": {"prefixCacheMb": -1}},
        {"verifier": {"maxModelLen": -1}},
        {"verifier": {"kvPool": "yes"}},
        {"router": {"affinitySlack": -1}},
        {"routr": {"replicas": 2}},  # a typo of a key is refused, at every level
        {"verifier": {"replica": 2}},
        {"ray": {"gpuWorkers": {"gpu": 2}}},
    ):
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)


def test_the_schema_lists_every_key_of_the_default_values():
    """With unknown keys refused, every key values.yaml has must be in the schema (free-form
    maps such as resources stay open)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = []

    def walk(v, s, path):
        if isinstance(v, dict) and "properties" in s:
            assert s.get("additionalProperties") is False, path or "(top)"
            for k, x in v.items():
                if k in s["properties"]:
                    walk(x, s["properties"][k], f"{path}{k}.")
                else:
                    missing.append(path + k)

    walk(values, schema, "")
    assert not missing


def test_services_mode_gpu_workloads():
    docs = render(values_file("services-gpu-values.yaml"))
    assert not kinds(docs, "RayService")
    ver = named(docs, "StatefulSet", "-verifier")
    assert ver["spec"]["replicas"] == 2
    c = container(ver)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and "--device=cuda" in c["args"]
    assert (
        "--prefill-chunk=128" in c["args"] and "--prefix-cache-mb=256" in c["args"] and "--max-model-len=0" in c["args"]
    )
    assert "--no-kv-pool" in c["args"] and "--max-batch=16" in c["args"] and "--no-static-steps" in c["args"]
    pooled = values_file("services-gpu-values.yaml")
    pooled["verifier"] = {**pooled.get("verifier", {}), "kvPool": True, "staticSteps": True, "maxBatch": 32}
    on = container(named(render(pooled), "StatefulSet", "-verifier"))
    assert "--kv-pool" in on["args"] and "--static-steps" in on["args"] and "--max-batch=32" in on["args"]
    spec = ver["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    router = container(named(docs, "Deployment", "-router"))
    verifiers = next(a for a in router["args"] if a.startswith("--verifiers=")).split("=", 1)[1].split(",")
    assert verifiers == [
        "demo-specmesh-verifier-0.demo-specmesh-verifier:50052",
        "demo-specmesh-verifier-1.demo-specmesh-verifier:50052",
    ]
    assert {"name": "SPECMESH_VERIFIER_LINK", "value": "multiplex"} in router["env"]
    assert {"name": "SPECMESH_AFFINITY_SLACK", "value": "2"} in router["env"]
    assert "--http-port=8000" in router["args"] and {"name": "http", "containerPort": 8000} in router["ports"]
    svc = named(docs, "Service", "demo-specmesh")
    assert {"name": "http", "port": 8000, "targetPort": 8000} in svc["spec"]["ports"]
    assert {d["metadata"]["name"] for d in kinds(docs, "Deployment")} == {
        "demo-specmesh-router",
        "demo-specmesh-drafter",
        "demo-specmesh-predictor",
        "demo-specmesh-memory",
    }
    sm = kinds(docs, "ServiceMonitor")[0]
    assert sm["metadata"]["labels"]["release"] == "prometheus" and sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert named(docs, "StatefulSet", "-redis")  # bundled Redis
    for d in kinds(docs, "Deployment") + [ver]:
        assert container(d)["readinessProbe"]["grpc"]["port"] == int(container(d)["ports"][0]["containerPort"])


def test_services_mode_cpu_external_redis_pvc():
    docs = render(values_file("services-cpu-external-redis-values.yaml"))
    ver = named(docs, "StatefulSet", "-verifier")
    assert ver["spec"]["replicas"] == 3 and "nvidia.com/gpu" not in str(container(ver)["resources"])
    assert "--device=cpu" in container(ver)["args"] and "--dtype=float32" in container(ver)["args"]
    assert not [d for d in kinds(docs, "StatefulSet") if d["metadata"]["name"].endswith("-redis")]
    assert not [d for d in kinds(docs, "Secret") if d["metadata"]["name"].endswith("-redis")]  # an existing one
    env = {e["name"]: e for e in container(ver)["env"]}
    assert env["SPECMESH_REDIS_URL"]["value"] == "rediss://redis.example.internal:6380/2"  # no secret in it
    assert env["SPECMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "specmesh-redis"
    assert env["SPECMESH_REDIS_CA"]["value"] == "/etc/specmesh/redis-ca/ca.crt"
    assert {"name": "redis-ca", "secret": {"secretName": "redis-ca"}} in ver["spec"]["template"]["spec"]["volumes"]
    vol = next(v for v in ver["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    assert vol["persistentVolumeClaim"]["claimName"] == "llm-models" and not kinds(docs, "PersistentVolumeClaim")
    assert "initContainers" not in ver["spec"]["template"]["spec"]


def test_ray_mode_rayservice():
    docs = render(values_file("ray-values.yaml"))
    assert not kinds(docs, "Deployment") and not [
        d for d in kinds(docs, "StatefulSet") if "verifier" in d["metadata"]["name"]
    ]
    rs = kinds(docs, "RayService")[0]
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert serve["applications"][0]["import_path"] == "services.ray_app:app"
    assert (
        "specmesh.v1.generate_pb2_grpc.add_GenerationServicer_to_server"
        in serve["grpc_options"]["grpc_servicer_functions"]
    )
    assert serve["applications"][0]["args"]["verifier_gpus"] == 1  # per replica: a 4-GPU worker hosts 4
    assert serve["http_options"] == {"host": "0.0.0.0", "port": 8000}  # the OpenAI-compatible API
    assert serve["applications"][0]["args"]["max_sessions"] == 64  # router.maxSessions: ingress admission
    assert serve["applications"][0]["args"]["verifier_max_sessions"] == 16  # verifier.maxSessions
    assert serve["applications"][0]["args"]["affinity_slack"] == 2
    assert serve["applications"][0]["args"]["max_model_len"] == 0
    assert serve["applications"][0]["args"]["kv_pool"] is False
    assert serve["applications"][0]["args"]["max_batch"] == 16
    assert serve["applications"][0]["args"]["static_steps"] is False
    assert serve["applications"][0]["args"]["ingress_replicas"] == 1
    assert serve["applications"][0]["runtime_env"]["env_vars"]["SPECMESH_PREFILL_CHUNK"] == "128"
    assert serve["applications"][0]["runtime_env"]["env_vars"]["SPECMESH_PREFIX_CACHE_MB"] == "256"
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["replicas"] == 3 and worker["rayStartParams"]["num-gpus"] == "4"
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    svc = named(docs, "Service", "demo-specmesh")
    assert svc["spec"]["selector"]["ray.io/node-type"] == "head"
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert all(head["metadata"]["labels"][k] == v for k, v in svc["spec"]["selector"].items() if k.startswith("app."))
    # every Ray pod serves its node's metrics; the PodMonitor scrapes head and workers
    port = serve["applications"][0]["args"]["metrics_port"]
    assert {"name": "metrics", "containerPort": port} in worker["template"]["spec"]["containers"][0]["ports"]
    pm = kinds(docs, "PodMonitor")[0]
    assert not kinds(docs, "ServiceMonitor") and pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    expr = pm["spec"]["selector"]["matchExpressions"][0]
    assert set(expr["values"]) == {
        head["metadata"]["labels"]["app.kubernetes.io/component"],
        worker["template"]["metadata"]["labels"]["app.kubernetes.io/component"],
    }


def test_dashboard_configmap_carries_the_dashboard():
    docs = render({})
    cm = named(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["specmesh.json"]) == json.loads((ROOT / "deploy/grafana/specmesh.json").read_text())


def test_notes_show_a_client_call():
    notes = helm.Chart.load(str(CHART)).render({}, name="demo", namespace="llm")["specmesh/templates/NOTES.txt"]
    assert "specmesh client --addr" in notes and "grpcurl" in notes and "/v1/completions" in notes


def test_tls_and_auth_are_wired_from_secrets():
    docs = render(values_file("services-tls-auth-values.yaml"))
    router = named(docs, "Deployment", "-router")
    env = {e["name"]: e for e in container(router)["env"]}
    assert env["SPECMESH_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "specmesh-token", "key": "token"}
    ver = named(docs, "StatefulSet", "-verifier")
    venv = {e["name"]: e.get("value") for e in container(ver)["env"]}
    assert venv["SPECMESH_TLS_CERT"] == "/etc/specmesh/tls/tls.crt" and venv["SPECMESH_TLS_CLIENT_CA"]
    assert {"name": "tls", "secret": {"secretName": "specmesh-tls"}} in ver["spec"]["template"]["spec"]["volumes"]
    assert "tcpSocket" in container(ver)["readinessProbe"]  # gRPC probes cannot speak TLS
    with pytest.raises(helm.HelmRenderError):
        render({"mode": "services", "tls": {"enabled": True}})  # a TLS Secret is required


def test_vllm_metric_names_are_dropped_only_when_asked():
    """vLLM's names are on by default; metrics.vllmNames: false adds --no-vllm-metric-names to the
    router and the verifiers; the verifiers label them with the router's served model name; the
    schema wants a boolean."""
    for on in (False, True):
        docs = render({"mode": "services", "metrics": {"vllmNames": on}})
        for kind, suffix in (("Deployment", "-router"), ("StatefulSet", "-verifier")):
            assert ("--no-vllm-metric-names" in container(named(docs, kind, suffix))["args"]) is not on
    docs = render({"mode": "services", "router": {"servedModelName": ["m8b", "alias"]}})
    for kind, suffix in (("Deployment", "-router"), ("StatefulSet", "-verifier")):  # one model_name on both
        args = container(named(docs, kind, suffix))["args"]
        assert args[args.index("--served-model-name") + 1 :][:2] == ["m8b", "alias"], kind
    with pytest.raises(helm.HelmValuesError):
        helm.Chart.load(str(CHART)).render({"metrics": {"vllmNames": "yes"}}, name="demo", namespace="llm")


def test_router_http_settings_reach_its_flags():
    """router.servedModelName, allowedOrigins, healthCheckTimeout and responseStats become the router's flags
    (and the Ray app's args); the schema refuses an empty origin list and a zero timeout."""
    docs = render(
        {
            "mode": "services",
            "router": {
                "servedModelName": ["code-v2", "code"],
                "allowedOrigins": ["https://ui.example"],
                "healthCheckTimeout": 5,
                "responseStats": True,
            },
        }
    )
    args = container(named(docs, "Deployment", "-router"))["args"]
    assert "--response-stats" in args
    i = args.index("--served-model-name")
    assert args[i + 1 : i + 3] == ["code-v2", "code"]
    assert args[args.index("--allowed-origins") + 1] == "https://ui.example" and "--health-check-timeout=5" in args
    default = container(named(render({"mode": "services"}), "Deployment", "-router"))["args"]
    assert "--served-model-name" not in default and "--allowed-origins" not in default
    assert "--response-stats" not in default  # off unless the release enables it
    serve = yaml.safe_load(
        kinds(render({"mode": "ray", "router": {"servedModelName": ["code"]}}), "RayService")[0]["spec"][
            "serveConfigV2"
        ]
    )
    assert serve["applications"][0]["args"]["served_model_name"] == ["code"]
    assert serve["applications"][0]["args"]["health_check_timeout"] == 20
    assert serve["applications"][0]["args"]["response_stats"] is False
    for bad in (
        {"router": {"allowedOrigins": [""]}},
        {"router": {"healthCheckTimeout": 0}},
        {"router": {"servedModelName": [""]}},
    ):
        with pytest.raises(helm.HelmValuesError):
            helm.Chart.load(str(CHART)).validate_schema(bad)


def test_eagle_tree_settings_reach_the_verifiers():
    """models.eagle3Topk and eagle3TreeTokens become the verifier's flags and the Ray app's
    args; the schema refuses a zero top-k and a tree past 64 nodes."""
    docs = render({"mode": "services", "models": {"eagle3Topk": 3, "eagle3TreeTokens": 12}})
    args = container(named(docs, "StatefulSet", "-verifier"))["args"]
    assert "--eagle3-topk=3" in args and "--eagle3-tree-tokens=12" in args
    serve = yaml.safe_load(kinds(render({"mode": "ray"}), "RayService")[0]["spec"]["serveConfigV2"])
    assert (
        serve["applications"][0]["args"]["eagle3_topk"] == 2
        and serve["applications"][0]["args"]["eagle3_tree_tokens"] == 8
    )
    for bad in ({"models": {"eagle3Topk": 0}}, {"models": {"eagle3TreeTokens": 65}}, {"ray": {"ingressReplicas": 0}}):
        with pytest.raises(helm.HelmValuesError):
            helm.Chart.load(str(CHART)).validate_schema(bad)


def test_speculative_config_reaches_router_verifiers_and_the_ray_app():
    """models.speculativeConfig (vLLM's) becomes --speculative-config on the router and the
    verifiers, JSON the CLI reads back as it was given, and the Ray app's speculative_config
    arg; the schema refuses a non-object and a zero num_speculative_tokens."""
    from services.common.config import _json_object

    spec = {"method": "eagle3", "model": "/models/eagle3", "num_speculative_tokens": 3}
    docs = render({"mode": "services", "models": {"speculativeConfig": spec}})
    for kind, suffix in (("StatefulSet", "-verifier"), ("Deployment", "-router")):
        (arg,) = [a for a in container(named(docs, kind, suffix))["args"] if a.startswith("--speculative-config=")]
        assert _json_object(arg.split("=", 1)[1]) == spec
    serve = yaml.safe_load(
        kinds(render({"mode": "ray", "models": {"speculativeConfig": spec}}), "RayService")[0]["spec"]["serveConfigV2"]
    )
    assert serve["applications"][0]["args"]["speculative_config"] == spec
    plain = render({"mode": "services"})
    assert not [a for a in container(named(plain, "StatefulSet", "-verifier"))["args"] if "speculative" in a]
    assert (
        "speculative_config"
        not in yaml.safe_load(kinds(render({}), "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]["args"]
    )
    for bad in (
        {"models": {"speculativeConfig": "eagle3"}},
        {"models": {"speculativeConfig": {"method": "eagle3", "num_speculative_tokens": 0}}},
    ):
        with pytest.raises(helm.HelmValuesError):
            helm.Chart.load(str(CHART)).validate_schema(bad)


@pytest.mark.parametrize("values", VALUES)
def test_every_rendered_configuration_goes_through_the_option_table(values):
    """Each specmesh container's arguments parse as `specmesh` parses them and their engine options
    build a config through EngineConfig.from_mapping; the RayService's args through the Ray app's
    engine_config and server_config (the same tables). A value the engine does not know fails here,
    not in a pod."""
    from services.cli import build_parser
    from services.common.config import OPTIONS, EngineConfig
    from services.ray_app import engine_config, server_config
    from services.router.engine import METHODS

    docs = render(values)
    seen = 0
    for d in kinds(docs, "Deployment") + kinds(docs, "StatefulSet"):
        args = container(d).get("args") or []
        if args[:1] != ["serve"]:
            continue  # Redis
        ns = build_parser().parse_args(args)
        cfg = EngineConfig.from_mapping({k: v for k, v in vars(ns).items() if k in OPTIONS}, METHODS)
        assert str(cfg.target) == "/models/target"
        seen += 1
    for ray in kinds(docs, "RayService"):
        for app in yaml.safe_load(ray["spec"]["serveConfigV2"])["applications"]:
            engine_config(app["args"])
            server_config(app["args"])
            seen += 1
    assert seen


def test_services_mode_carries_a_generated_internal_token_to_every_service():
    """Every specmesh pod of services mode reads the internal token from a file mounted from one
    generated Secret (the router sends it, the internal services require it); Ray mode, whose
    components talk over Ray, has none; internalAuth.enabled=false turns it off."""

    docs = render({"mode": "services"})
    secret = named(docs, "Secret", "-internal")
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    pods = [*kinds(docs, "Deployment"), *kinds(docs, "StatefulSet")]
    specmesh = [d for d in pods if container(d)["name"] != "redis" and "redis" not in d["metadata"]["name"]]
    assert {d["metadata"]["name"].rsplit("-", 1)[-1] for d in specmesh} >= {"router", "verifier"}
    for d in specmesh:
        env = {e["name"]: e.get("value") for e in container(d)["env"]}
        assert env["SPECMESH_INTERNAL_TOKEN_FILE"] == "/etc/specmesh/internal/token", d["metadata"]["name"]
        mounts = {m["name"]: m["mountPath"] for m in container(d)["volumeMounts"]}
        assert mounts["internal-token"] == "/etc/specmesh/internal"
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["internal-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    off = render({"mode": "services", "internalAuth": {"enabled": False}})
    assert not [d for d in kinds(off, "Secret") if d["metadata"]["name"].endswith("-internal")]
    assert "SPECMESH_INTERNAL_TOKEN_FILE" not in json.dumps(render(values_file("ray-values.yaml")))


def test_services_mode_pods_are_non_root_read_only_and_wait_for_their_models():
    """Every container runs as a non-root user on a read-only root filesystem with no
    capabilities and a writable /tmp; a startupProbe gives model loading startupSeconds before
    liveness checks; the init container copies the models image's files from outside the mount
    point (mounting the volume over them would hide them)."""
    docs = render({"mode": "services", "startupSeconds": 300})
    pods = [
        d
        for d in [*kinds(docs, "Deployment"), *kinds(docs, "StatefulSet")]
        if not d["metadata"]["name"].endswith("-redis")
    ]
    assert pods
    for d in pods:
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"], c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"]
        main = spec["containers"][0]
        assert {"name": "tmp", "mountPath": "/tmp"} in main["volumeMounts"]
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]
        assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] == 300
        assert "initialDelaySeconds" not in main["livenessProbe"]
        init = spec["initContainers"][0]
        assert init["command"][-1] == "cp -r /opt/specmesh-models/. /models/"
        assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]


def verifier_container(docs: list[dict]) -> dict:
    return container(named(docs, "StatefulSet", "-verifier"))


def test_verifier_gpus_n_is_one_replica_split_over_n_gpus():
    """verifier.gpus: N runs each replica's target tensor-parallel over N GPUs of one pod (a rank
    per GPU, /dev/shm for their collectives); verifier.tensorParallel splits it on the CPU too,
    and on GPUs must agree with gpus (refused, saying what to set)."""
    two = render({"mode": "services", "verifier": {"gpus": 2}})
    c = verifier_container(two)
    assert "--tensor-parallel=2" in c["args"] and "--device=cuda" in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    pod = named(two, "StatefulSet", "-verifier")["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]["medium"] == "Memory"
    one = verifier_container(render({"mode": "services", "verifier": {"gpus": 1}}))
    assert "--tensor-parallel=1" in one["args"] and not any(m["name"] == "shm" for m in one["volumeMounts"])
    cpu = verifier_container(render({"mode": "services", "verifier": {"gpus": 0, "tensorParallel": 2}}))
    assert "--tensor-parallel=2" in cpu["args"] and "--device=cpu" in cpu["args"]
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    with pytest.raises(helm.HelmRenderError, match="tensorParallel: 4 with verifier.gpus: 2.*set tensorParallel"):
        render({"mode": "services", "verifier": {"gpus": 2, "tensorParallel": 4}})


def test_ray_verifier_replica_takes_its_ranks_gpus_on_one_worker():
    """In Ray mode a replica reserves a GPU per rank (the app's placement group holds them on one
    worker pod): a 4-GPU worker hosts four replicas at TP 1, two at TP 2; a size that does not
    divide the worker's GPUs is refused."""
    for tp, gpus in ((0, 1), (1, 1), (2, 2)):
        ray = render({"mode": "ray", "verifier": {"tensorParallel": tp}, "ray": {"gpuWorkers": {"gpus": 4}}})
        service = kinds(ray, "RayService")[0]
        args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert (args["verifier_gpus"], args["tensor_parallel"]) == (gpus, max(1, tp))
        workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
        assert workers["rayStartParams"]["num-gpus"] == "4"
        mounts = workers["template"]["spec"]["containers"][0]["volumeMounts"]
        assert any(m["name"] == "shm" for m in mounts) == (tp > 1)
    with pytest.raises(helm.HelmRenderError, match="tensorParallel: 3 does not divide ray.gpuWorkers.gpus: 4"):
        render({"mode": "ray", "verifier": {"tensorParallel": 3}, "ray": {"gpuWorkers": {"gpus": 4}}})


def test_containers_given_gpus_run_the_cuda_image():
    """The CPU image's torch has no CUDA: a verifier with gpus > 0 and Ray's GPU workers run
    ``image.cudaTag``; everything else, and a CPU verifier, the CPU image."""
    images = lambda docs: {  # noqa: E731
        c["name"]: c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    gpu = images(render({"mode": "services", "verifier": {"gpus": 1}}))
    assert gpu.pop("verifier") == "specmesh/specmesh:0.1.0-cuda"
    assert set(gpu.values()) <= {"specmesh/specmesh:0.1.0", "redis:7.4"}
    assert images(render({"mode": "services", "verifier": {"gpus": 0}}))["verifier"] == "specmesh/specmesh:0.1.0"
    custom = render({"mode": "services", "image": {"repository": "r/s", "tag": "1", "cudaTag": "1-cu128"}})
    assert images(custom)["verifier"] == "r/s:1-cu128"
    for gpus, image in ((1, "specmesh/specmesh:0.1.0-cuda"), (0, "specmesh/specmesh:0.1.0")):
        cluster = kinds(render({"mode": "ray", "ray": {"gpuWorkers": {"gpus": gpus}}}), "RayService")[0]
        cluster = cluster["spec"]["rayClusterConfig"]
        assert cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] == image
        assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == "specmesh/specmesh:0.1.0"


def test_ray_mode_carries_pull_secrets_tls_and_the_redis_ca_and_autoscales_its_workers():
    docs = render(
        {
            "mode": "ray",
            "imagePullSecrets": [{"name": "regcred"}],
            "tls": {"enabled": True, "secretName": "specmesh-tls"},
            "redis": {"bundled": False, "externalUrl": "rediss://redis.example:6380/0", "caSecret": "redis-ca"},
        }
    )
    cluster = kinds(docs, "RayService")[0]["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    pods = [cluster["headGroupSpec"]["template"]["spec"], cluster["workerGroupSpecs"][0]["template"]["spec"]]
    for spec in pods:
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["tls"] == "/etc/specmesh/tls" and mounts["redis-ca"] == "/etc/specmesh/redis-ca"
        volumes = {v["name"] for v in spec["volumes"]}
        assert {"tls", "redis-ca", "models", "tmp"} <= volumes
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["SPECMESH_REDIS_CA"] == "/etc/specmesh/redis-ca/ca.crt"


def test_services_mode_has_an_account_budgets_policies_an_hpa_and_a_helm_test():
    docs = render(
        {"mode": "services", "networkPolicy": {"enabled": True}, "router": {"autoscaling": {"enabled": True}}}
    )
    sa = named(docs, "ServiceAccount", "demo-specmesh")
    assert sa["automountServiceAccountToken"] is False
    for d in [*kinds(docs, "Deployment"), named(docs, "StatefulSet", "-verifier")]:
        assert d["spec"]["template"]["spec"]["serviceAccountName"] == "demo-specmesh", d["metadata"]["name"]
    pdbs = {p["metadata"]["name"]: p["spec"] for p in kinds(docs, "PodDisruptionBudget")}
    assert pdbs["demo-specmesh-verifier"]["maxUnavailable"] == 1
    assert pdbs["demo-specmesh-router"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    policies = {p["metadata"]["name"]: p["spec"] for p in kinds(docs, "NetworkPolicy")}
    router_ports = {p["port"] for rule in policies["demo-specmesh-router"]["ingress"] for p in rule["ports"]}
    assert router_ports == {50051, 8000, 9400}
    for c in ("verifier", "drafter", "predictor", "memory", "redis"):
        rules = policies[f"demo-specmesh-{c}"]["ingress"]
        peers = rules[0]["from"][0]["podSelector"]["matchLabels"]
        assert peers == {"app.kubernetes.io/name": "specmesh", "app.kubernetes.io/instance": "demo"}, c
        assert ("ports" in str(rules)) == (c != "redis")  # metrics open to scrapers, Redis not at all
    hpa = kinds(docs, "HorizontalPodAutoscaler")[0]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "demo-specmesh-router"
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "specmesh_queue_depth"
    test = next(d for d in kinds(docs, "Pod") if d["metadata"]["annotations"]["helm.sh/hook"] == "test")
    args = test["spec"]["containers"][0]["args"]
    assert args[0] == "client" and "--addr=demo-specmesh:50051" in args
    plain = render({"mode": "services"})
    assert kinds(plain, "NetworkPolicy") and not kinds(plain, "HorizontalPodAutoscaler")  # policies by default
    assert not kinds(render({"mode": "services", "networkPolicy": {"enabled": False}}), "NetworkPolicy")
    ray = render({})  # the default mode: the dashboard and Ray's ports closed to other pods by default
    head = named(ray, "NetworkPolicy", "-ray-head")["spec"]["ingress"]
    open_ports = {p["port"] for rule in head if "from" not in rule for p in rule["ports"]}
    assert 8265 not in open_ports and {50051, 8000} <= open_ports  # clients: Serve's proxies only
    assert all("from" in rule or "ports" in rule for rule in head) and "namespaceSelector" in str(head)
    tls = render(values_file("services-tls-auth-values.yaml"))
    test = next(d for d in kinds(tls, "Pod") if d["metadata"]["annotations"]["helm.sh/hook"] == "test")
    c = test["spec"]["containers"][0]
    assert "--tls-ca=/etc/specmesh/tls/ca.crt" in c["args"] and {e["name"] for e in c["env"]} >= {"SPECMESH_AUTH_TOKEN"}
    assert {"name": "tls", "mountPath": "/etc/specmesh/tls", "readOnly": True} in c["volumeMounts"]


@pytest.mark.parametrize("mode", ["services", "ray"])
def test_the_bundled_redis_runs_as_its_own_user_on_a_read_only_root(mode):
    """The bundled Redis (both modes) starts as the image's redis user, never root (its command
    skips the image's step-down), on a read-only root filesystem with no capabilities, writable
    /data and /tmp, no service-account token, a maintained image, and the release's pull secrets."""
    docs = render({"mode": mode, "imagePullSecrets": [{"name": "regcred"}]})
    sts = named(docs, "StatefulSet", "-redis")
    spec = sts["spec"]["template"]["spec"]
    pod, c = spec["securityContext"], spec["containers"][0]
    assert pod["runAsNonRoot"] and pod["runAsUser"] == pod["runAsGroup"] == pod["fsGroup"] == 999
    assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/data", "/tmp"}
    assert spec["automountServiceAccountToken"] is False and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert c["image"] == "redis:7.4"


def test_the_bundled_redis_admits_only_specmesh_as_its_acl_user_for_what_it_uses(tmp_path, monkeypatch):
    """The chart's Redis runs with one ACL user, `specmesh`, whose password is on no command line:
    the correction memory (Lua scripts, transactions) and the suffix feed (streams) work through
    it, with the password from SPECMESH_REDIS_PASSWORD and a URL without it; an admin command
    and the default user are refused. It runs as the chart's redis uid where this machine can
    switch to it (as root), as in its pod."""
    import redis as redis_py

    from services.common.runtime import free_port
    from services.drafter.suffix import GlobalSuffixCache
    from services.memory.redis_link import RedisLink
    from services.memory.redis_memory import RedisCorrectionMemory
    from services.memory.suffix_feed import SuffixFeed
    from tests.chart import bundled_redis, secret_value
    from tests.conftest import wait_for

    docs = render({"mode": "services"})
    env = {e["name"]: e for e in container(named(docs, "Deployment", "-router"))["env"]}
    assert env["SPECMESH_REDIS_URL"]["value"] == "redis://specmesh@demo-specmesh-redis:6379/0"
    port = free_port()
    password = secret_value(docs, {"name": named(docs, "Secret", "-redis")["metadata"]["name"], "key": "password"})
    proc = bundled_redis(docs, "127.0.0.1", port, tmp_path)
    try:
        assert password not in " ".join(container(named(docs, "StatefulSet", "-redis"))["command"])
        monkeypatch.setenv("SPECMESH_REDIS_PASSWORD", password)
        url = f"redis://specmesh@127.0.0.1:{port}/0"
        m = RedisCorrectionMemory(RedisLink(url, "ocm"), flush_interval_s=0.05, refresh_interval_s=0.1)
        m.ensure_prior({(9, 9): 2.0})
        m.record([(1, 2)] * 3)
        assert wait_for(lambda: m.lookup(1, 2) == 3 and m.lookup(9, 9) == 2)
        m.close()
        cache = GlobalSuffixCache()
        feed = SuffixFeed(RedisLink(url, "suffix_feed"), cache).start()
        feed.publish([5, 6, 7, 8])
        feed.close()
        admin = redis_py.Redis(host="127.0.0.1", port=port, username="specmesh", password=password)
        assert admin.xlen("specmesh:suffix:outputs") == 1  # the feed's write went through
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            admin.flushall()
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            admin.set("other:key", 1)  # only specmesh's keys
        with pytest.raises((redis_py.exceptions.AuthenticationError, redis_py.exceptions.ResponseError)):
            redis_py.Redis(host="127.0.0.1", port=port, password=password).ping()  # the default user is off
    finally:
        proc.terminate()
        proc.wait(10)


def test_prometheus_rule_carries_the_plain_rules_file():
    """prometheusRule.enabled renders a PrometheusRule whose groups are those of
    deploy/prometheus/specmesh.rules.yaml, with the labels asked for; off by default."""
    import yaml

    assert not kinds(render({}), "PrometheusRule")
    docs = render({"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}})
    (rule,) = kinds(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    plain = yaml.safe_load((ROOT / "deploy/prometheus/specmesh.rules.yaml").read_text())
    assert rule["spec"]["groups"] == plain["groups"] and len(plain["groups"][0]["rules"]) >= 6
