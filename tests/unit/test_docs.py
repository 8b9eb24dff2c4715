"""The generated files are what their scripts make now: docs/configuration.md (the option table),
docs/metrics.md (the metrics catalogue), deploy/grafana/specmesh.json (the panel table)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["config_docs.py", "metrics_docs.py", "dashboard.py"])
def test_the_generated_file_is_current(script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}  # defaults, not this shell's
    out = subprocess.run(
        [sys.executable, f"scripts/{script}", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
