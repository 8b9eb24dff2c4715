"""The chart's generated secrets (the bundled Redis's password, the internal token) stay the same
across upgrades: rendered cluster-aware by Helm's own engine against a stand-in Kubernetes API
server that answers discovery and Secret reads (what the ``lookup`` template function asks)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import helm_python as helm
import pytest
import yaml

from tests.chart import secret_value
from tests.contract.test_helm import CHART

SECRETS = {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret", "verbs": ["get", "list"]}
DISCOVERY = {
    "/version": {"major": "1", "minor": "30", "gitVersion": "v1.30.0", "platform": "linux/amd64"},
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [SECRETS]},
}


class ApiServer(ThreadingHTTPServer):
    """Kubernetes' API as ``lookup`` reads it: discovery, and GET of a namespaced Secret from
    ``secrets`` (keyed (namespace, name)); 404 with a Status for any other object."""

    def __init__(self):
        self.secrets: dict[tuple[str, str], dict] = {}
        self.reads: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    def kubeconfig(self) -> str:
        server = f"http://127.0.0.1:{self.server_address[1]}"
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stub", "cluster": {"server": server}}],
                "users": [{"name": "stub", "user": {"token": "unused"}}],
                "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": "llm"}}],
                "current-context": "stub",
            }
        )


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?")[0]
        if path in DISCOVERY:
            return self._send(200, DISCOVERY[path])
        parts = path.strip("/").split("/")  # api v1 namespaces NS secrets NAME
        if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "secrets":
            self.server.reads.append(parts[5])
            found = self.server.secrets.get((parts[3], parts[5]))
            if found is not None:
                return self._send(200, found)
        self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def api():
    server = ApiServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


VALUES = {"mode": "services", "redis": {"bundled": True}, "internalAuth": {"enabled": True}}


def render(api: ApiServer, upgrade: bool) -> list[dict]:
    cfg = helm.Config(kubeconfig_content=api.kubeconfig(), namespace="llm")
    try:
        out = cfg.render(
            helm.Chart.load(str(CHART)),
            VALUES,
            name="demo",
            namespace="llm",
            is_install=not upgrade,
            is_upgrade=upgrade,
        )
    finally:
        cfg.close()
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def generated(docs: list[dict]) -> dict[str, str]:
    """The generated secrets' values: the Redis password and the internal token."""
    out = {}
    for doc in docs:
        if doc["kind"] == "Secret" and doc["metadata"]["name"] in ("demo-specmesh-redis", "demo-specmesh-internal"):
            key = "password" if doc["metadata"]["name"].endswith("-redis") else "token"
            out[doc["metadata"]["name"]] = secret_value(docs, {"name": doc["metadata"]["name"], "key": key})
    return out


def test_generated_secrets_survive_an_upgrade(api):
    installed = render(api, upgrade=False)
    first = generated(installed)
    assert set(first) == {"demo-specmesh-redis", "demo-specmesh-internal"}, "the values make both secrets"
    assert "demo-specmesh-redis" in api.reads, "lookup reached the API server"
    assert generated(render(api, upgrade=False)) != first, "with nothing stored, each render draws anew"

    for doc in installed:  # the install created its Secrets in the cluster
        if doc["kind"] == "Secret" and doc["metadata"]["name"] in first:
            api.secrets[("llm", doc["metadata"]["name"])] = doc
    assert generated(render(api, upgrade=True)) == first
