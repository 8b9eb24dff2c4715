"""What the Helm chart renders, run here as Kubernetes would run it: a container's environment
and the bundled Redis's own command (tests/contract/test_helm.py and tests/image/test_image.py)."""

from __future__ import annotations

import atexit
import base64
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


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


def bundled_redis(docs, host: str, port: int, directory: Path, within_s: float = 10) -> subprocess.Popen:
    """The chart's bundled Redis, its rendered command and environment run on this machine (no
    Redis image here): only where it listens and its directory change. Returns once it answers."""
    sts = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-redis"))
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["sh", "-c"]
    as_user: list[str] = []
    uid = sts["spec"]["template"]["spec"].get("securityContext", {}).get("runAsUser")
    if uid is not None and os.geteuid() == 0 and shutil.which("setpriv"):  # as its pod runs it, not as root
        directory = Path(tempfile.mkdtemp(prefix="specmesh-redis-"))  # (a pytest tmp_path is root's alone)
        atexit.register(shutil.rmtree, directory, True)
        os.chown(directory, uid, uid)
        as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    script = c["command"][2].replace("redis-server -", f"redis-server - --bind {host} --port {port} --dir {directory}")
    env = {"PATH": "/usr/bin:/bin", **dict(e.split("=", 1) for e in env_of(docs, c))}
    proc = subprocess.Popen([*as_user, "sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    end = time.monotonic() + within_s
    while True:
        assert proc.poll() is None, "the chart's Redis command did not start"
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc
        except OSError:
            if time.monotonic() > end:
                proc.kill()
                raise AssertionError(f"the chart's Redis does not answer on {host}:{port}") from None
            time.sleep(0.1)
