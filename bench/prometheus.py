"""A real Prometheus (Debian's ``prometheus`` package) scraping real specmesh servers, a load that
moves every panel of the dashboard, and the dashboard's queries as Prometheus evaluates them.

Used by tests/integration/test_prometheus.py (every panel returns data in every topology) and,
run as a module, to plot the dashboard's main rows from a real scrape:

    python -m bench.prometheus --out bench/results/dashboard.png   # make dashboard-png
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/grafana/specmesh.json"
RULES = ROOT / "deploy/prometheus/specmesh.rules.yaml"
# Grafana's variables as "All" selects them; rates over 30 s of 1 s scrapes.
VARIABLES = {"$__rate_interval": "30s", "$namespace": ".*", "$pod": ".*", "$model": ".*"}


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install Debian's prometheus package (apt-get install prometheus)")
    return path


class Prometheus:
    """A Prometheus server scraping ``targets`` (host:port) every second, with the alert rules."""

    def __init__(self, targets: list[str], port: int, workdir: Path):
        self.url = f"http://127.0.0.1:{port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "specmesh", "static_configs": [{"targets": targets}]}],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # YAML reads JSON
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(self.url + "/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 2.0) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def wait_scraped(self, n_targets: int, timeout: float = 60) -> None:
        """Until every target has been scraped up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = self.query("up")
            if len(up) == n_targets and all(r["value"][1] == "1" for r in up):
                return
            time.sleep(0.5)
        raise RuntimeError(f"targets not all up: {self.query('up')}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, query) of every dashboard query, its variables substituted."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            out.append((panel["title"], t.get("legendFormat", ""), expr))
    return out


# -- the load ------------------------------------------------------------------------------------
def prompts(n: int = 12) -> list[str]:
    """HumanEval's first ``n`` prompts (data nobody here wrote)."""
    from bench.workloads import humaneval

    return [p.text for p in humaneval(n)]


def drive(addr: str, methods: list[str], seconds: float, streams: int = 3) -> dict[str, int]:
    """``streams`` gRPC clients sending requests for ``seconds`` and until each has sent every
    method once (a slow machine still covers them all): every method in turn on HumanEval prompts,
    each prompt again later (prefix-cache hits), one structured-output request and one invalid
    request per round. Returns counts by outcome."""
    import grpc

    from specmesh.v1 import generate_pb2 as pb
    from specmesh.v1 import generate_pb2_grpc as pb_grpc

    texts = prompts()
    counts = {"ok": 0, "invalid": 0, "other": 0}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.GenerationStub(ch)
            i = k
            while time.monotonic() < end or i < k + len(methods):
                method = methods[i % len(methods)]
                prompt = texts[(i // len(methods)) % len(texts)]  # every method on each prompt
                reqs = [pb.GenerateRequest(prompt=prompt, max_new_tokens=64, method=method)]
                if i % len(methods) == 0:
                    structured = pb.StructuredOutput(regex="[0-9]{2,6}")
                    reqs.append(pb.GenerateRequest(prompt="x = ", max_new_tokens=8, structured_output=structured))
                    reqs.append(pb.GenerateRequest(prompt="", max_new_tokens=8))  # INVALID_ARGUMENT
                for req in reqs:
                    try:
                        list(stub.Generate(req, timeout=120))
                        outcome = "ok"
                    except grpc.RpcError as e:
                        outcome = "invalid" if e.code() == grpc.StatusCode.INVALID_ARGUMENT else "other"
                    with lock:
                        counts[outcome] += 1
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


class OpenStreams:
    """``n`` long Generate streams held open (each has sent its first token and is still
    decoding) until ``close``."""

    def __init__(self, addr: str, n: int, max_new_tokens: int = 900):
        import grpc

        from specmesh.v1 import generate_pb2 as pb
        from specmesh.v1 import generate_pb2_grpc as pb_grpc

        self.channel = grpc.insecure_channel(addr)
        stub = pb_grpc.GenerationStub(self.channel)
        prompt = "def add(a, b):\n"
        req = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, method="vanilla", ignore_eos=True)
        self.calls = [stub.Generate(req, timeout=600) for _ in range(n)]
        for call in self.calls:
            next(call)  # the first token: decoding

    def running(self) -> bool:
        """Every stream still open (none finished)."""
        return all(call.is_active() for call in self.calls)

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self.channel.close()


# -- the server ----------------------------------------------------------------------------------
def start_server(args: list[str], ready_port: int, log: Path, timeout: float = 300) -> subprocess.Popen:
    """``specmesh serve ARGS`` until its gRPC port answers Generate's health check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    out = open(log, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", *args], stdout=out, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{ready_port}") as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                return proc
        except grpc.RpcError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"serve did not answer in {timeout} s: {log.read_text()[-3000:]}")


# -- the picture ---------------------------------------------------------------------------------
MAIN_ROWS = ("Latency", "Throughput and load", "Acceptance")


def main_row_titles() -> list[str]:
    """Titles of the panels of the dashboard's main rows, in order."""
    titles, row = [], None
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        elif row in MAIN_ROWS:
            titles.append(panel["title"])
    return titles


def plot(prom: Prometheus, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    queries = panel_queries()
    titles = main_row_titles()
    cols = 3
    rows = (len(titles) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.9 * rows), squeeze=False)
    for ax, title in zip(axes.flat, titles):
        for _, legend, expr in (q for q in queries if q[0] == title):
            for series in prom.query_range(expr, start, end):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = legend
                for key, value in series["metric"].items():
                    label = label.replace("{{" + key + "}}", value)
                ax.plot(xs, ys, label=label or "value")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds", fontsize=7)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(titles) :]:
        ax.axis("off")
    fig.suptitle("specmesh dashboard, main rows: a real Prometheus scraping `specmesh serve` under load", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(out, dpi=90)


def main() -> int:
    from services.common.runtime import free_port, stop_processes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/dashboard.png")
    p.add_argument("--seconds", type=float, default=90)
    args = p.parse_args()
    methods = ["vanilla", "sd", "suffix", "csd", "eagle3", "hybrid"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port, metrics = free_port(), free_port()
        server = start_server(
            ["--port", str(port), "--http-port", "0", "--metrics-port", str(metrics)], port, work / "serve.log"
        )
        prom = Prometheus([f"127.0.0.1:{metrics}"], free_port(), work)
        try:
            prom.wait_scraped(1)
            start = time.time()
            t0 = time.monotonic()
            counts = drive(f"127.0.0.1:{port}", methods, args.seconds)
            print(f"load: {counts} in {time.monotonic() - t0:.0f} s", flush=True)
            time.sleep(3)
            plot(prom, start, time.time(), args.out)
        finally:
            prom.stop()
            stop_processes([server])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
