"""OCM snapshot files: JSON {"format": "specmesh-ocm/1", "pairs": [[draft, target, count], ...], "meta": {...}}."""

from __future__ import annotations

import json
from pathlib import Path

from services.memory.correction_memory import Pair

FORMAT = "specmesh-ocm/1"


def save_snapshot(path: Path, counts: dict[Pair, float], meta: dict | None = None) -> None:
    pairs = sorted(([d, t, n] for (d, t), n in counts.items()), key=lambda x: -x[2])
    Path(path).write_text(json.dumps({"format": FORMAT, "meta": meta or {}, "pairs": pairs}) + "\n")


def load_snapshot(path: Path) -> dict[Pair, float]:
    obj = json.loads(Path(path).read_text())
    if obj.get("format") != FORMAT:
        raise ValueError(f"{path}: not an OCM snapshot (format {obj.get('format')!r}, expected {FORMAT!r})")
    return {(int(d), int(t)): float(n) for d, t, n in obj["pairs"]}
