"""The distributed topology's processes under fault: a verifier that dies is restarted (and
counted); one that cannot start fails the router's start, saying which; kill -9 of the router
leaves no verifier process behind; a second server on a busy port fails instead of sharing it."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.assembly import verifier_command
from services.common.runtime import free_port, stop_processes
from tests.fleet import start_verifier, stop

CLI = [sys.executable, "-m", "services.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def distributed(tiny_dirs, port: int, metrics_port: int) -> list[str]:
    target, draft = tiny_dirs
    return CLI + [
        "serve",
        "--topology",
        "distributed",
        "--replicas",
        "2",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--http-port",
        "0",
        "--target",
        str(target),
        "--draft",
        str(draft),
    ]


def children_of(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def until(cond, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.2)
    return cond()


def generate(port: int) -> subprocess.CompletedProcess:
    args = ["client", "--addr", f"127.0.0.1:{port}", "--prompt", "def add(a, b):", "--max-new-tokens", "8"]
    return subprocess.run(CLI + args + ["--method", "sd"], capture_output=True, text=True, env=ENV, timeout=120)


def metric(port: int, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:  # not serving yet
        return None
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), None)


def test_a_dead_verifier_is_restarted_and_a_killed_router_leaves_no_verifier(tiny_dirs):
    port, metrics_port = free_port(), free_port()
    router = subprocess.Popen(distributed(tiny_dirs, port, metrics_port), env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert "serving on" in next(line for line in router.stdout if "serving on" in line)
        verifiers = children_of(router.pid)
        assert len(verifiers) == 2
        assert until(lambda: metric(metrics_port, "specmesh_verifier_restarts_total") == 0.0, 30)
        victim = min(verifiers)
        os.kill(victim, signal.SIGKILL)
        assert until(lambda: len(children_of(router.pid) - verifiers) == 1, 30), "not restarted"
        assert metric(metrics_port, "specmesh_verifier_restarts_total") == 1.0
        out = None
        for _ in range(60):  # the restarted replica loads its models; the other serves meanwhile
            out = generate(port)
            if out.returncode == 0:
                break
            time.sleep(1)
        assert out is not None and "[FINISH_REASON_LENGTH] 8 tokens" in out.stderr, out.stderr
        verifiers = children_of(router.pid)
        router.kill()  # SIGKILL: no chance to stop its children
        router.wait(10)
        assert until(lambda: not any(running(v) for v in verifiers), 60), "a verifier outlived its router"
        for p in (port + 1, port + 2):  # their ports are free again (to a server: SO_REUSEADDR, not PORT)
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
    finally:
        stop_processes([router])


def test_a_verifier_that_cannot_start_fails_the_start_saying_which(tiny_dirs):
    port = free_port()
    with socket.socket() as blocker:  # the second verifier's port is taken
        blocker.bind(("127.0.0.1", port + 2))
        blocker.listen()
        out = subprocess.run(distributed(tiny_dirs, port, 0), capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode != 0
    assert f"127.0.0.1:{port + 2}: exited with status" in out.stderr
    assert "the port is in use" in out.stderr
    assert "serving on" not in out.stdout


def test_a_second_server_on_a_busy_port_fails_instead_of_sharing_it(tiny_dirs):
    proc, addr = start_verifier(tiny_dirs)
    try:
        port = int(addr.rsplit(":", 1)[1])
        cmd = verifier_command(port, {"target": tiny_dirs[0], "draft": tiny_dirs[1]})
        out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
        assert out.returncode != 0 and f"cannot listen on 127.0.0.1:{port}: the port is in use" in out.stderr
    finally:
        stop([proc])
