"""docs/configuration.md is what scripts/config_docs.py makes from the option table now."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_doc_is_current():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}  # defaults, not this shell's
    out = subprocess.run(
        [sys.executable, "scripts/config_docs.py", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
