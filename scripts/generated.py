"""What the generators of docs and the dashboard share: write the file, or, with ``--check`` on
the command line, exit non-zero when the file is not what the generator makes now."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(out: Path, text: str, script: str) -> None:
    if "--check" in sys.argv:
        if not out.exists() or out.read_text() != text:
            sys.exit(f"{out} is stale: run python scripts/{script}")
        return
    out.write_text(text)
    print(f"wrote {out}")
