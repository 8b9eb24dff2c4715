"""The installable product: a wheel built from this tree, installed into a fresh virtualenv
outside any checkout, serves and generates on the bundled models it carries. (Its third-party
dependencies come from the project's environment, so the test installs nothing from an index;
its own code and models come only from the wheel.)"""

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import grpc
import pytest

from services.common.runtime import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict]:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # the tree as a clean clone has it (the build writes into its source)
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.so"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(source),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = (tmp / "dist").glob("specmesh-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    purelib = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    # pip run for the venv's interpreter (its scripts point at it; nothing of this environment changes)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=600,
    )
    # then the dependencies, from this environment, after the venv's own site-packages (where the wheel went)
    (purelib / "_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    away = tmp / "elsewhere"  # no checkout here or above
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECMESH_", "PYTHON"))}
    return env_dir, away, env


def run(installed, *args, timeout=300) -> subprocess.CompletedProcess:
    env_dir, away, env = installed
    return subprocess.run(
        [str(env_dir / "bin" / "specmesh"), *args], cwd=away, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_wheel_holds_the_product_and_its_models_only(installed):
    env_dir, away, env = installed
    code = (
        "import services, services.common.config as c, importlib.util as u; "
        "print(services.__file__); print(c.models_dir()); "
        "print(u.find_spec('bench'), u.find_spec('training')); "
        "from services.drafter.suffix_tree import CompiledSuffixTree as T; print(T.__module__)"
    )
    out = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", code],
        cwd=away,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split("\n")
    assert out[0].startswith(str(env_dir)) and out[1] == str(env_dir / "share" / "specmesh" / "models")
    assert out[2] == "None None"  # the benchmarks and training scripts are not installed
    assert out[3] == "services.drafter._suffix_tree"  # the wheel carries the compiled suffix tree
    assert (Path(out[1]) / "target" / "config.json").exists()


def test_generate_runs_on_the_bundled_models(installed):
    out = run(installed, "generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--method", "sd")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_a_models_dir_without_models_is_refused_clearly(installed, tmp_path):
    out = run(installed, "generate", "--prompt", "x", "--models-dir", str(tmp_path))
    assert out.returncode != 0 and f"no model at {tmp_path / 'target'}" in out.stderr and "--models-dir" in out.stderr


def test_serve_answers_generate_from_the_wheel(installed):
    from specmesh.v1 import generate_pb2 as pb
    from specmesh.v1 import generate_pb2_grpc as pb_grpc

    env_dir, away, env = installed
    port = free_port()
    server = subprocess.Popen(
        [str(env_dir / "bin" / "specmesh"), "serve", "--port", str(port), "--http-port", "0", "--metrics-port", "0"],
        cwd=away,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
            msgs = list(
                pb_grpc.GenerationStub(ch).Generate(
                    pb.GenerateRequest(prompt="import os", max_new_tokens=8, method="vanilla"), timeout=120
                )
            )
        assert msgs[-1].usage.completion_tokens == 8
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
