"""The Grafana dashboard only queries metrics the code exports."""

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import services.common.metrics  # noqa: F401  (registers the catalog)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/specmesh.json"


def exported_names() -> set[str]:
    names = set()
    for fam in REGISTRY.collect():
        for s in fam.samples:
            names.add(s.name)
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        if fam.type == "histogram":
            names |= {fam.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def test_every_dashboard_query_names_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bspecmesh_[a-z0-9_]+", e)}
    assert len(exprs) >= 12 and len(used) >= 15
    missing = used - exported_names()
    assert not missing, f"dashboard queries metrics the code does not export: {sorted(missing)}"


def test_dashboard_covers_the_acceptance_story():
    titles = " ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]).lower()
    for needle in (
        "acceptance rate",
        "accepted length",
        "cycles per 1,000",
        "source mix",
        "rescue rate",
        "precision",
        "first token",
        "throughput",
    ):
        assert needle in titles, needle


def test_each_panel_names_its_queries_once():
    """Grafana keys a panel's queries by refId: a repeated one hides a query."""
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), (p["title"], refs)
