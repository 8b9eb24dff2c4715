"""The Grafana dashboard only queries metrics the code exports."""

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import services.common.metrics  # noqa: F401  (registers the catalog)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/specmesh.json"


def exported_names() -> set[str]:
    """specmesh's names (the default registry) and vLLM's (the collector over them)."""
    from services.common.vllm_metrics import VllmNames

    names = set()
    for fam in [*REGISTRY.collect(), *VllmNames("m").collect()]:
        for s in fam.samples:
            names.add(s.name)
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        if fam.type == "histogram":
            names |= {fam.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def panels() -> list[dict]:
    """The dashboard's panels (its rows left out)."""
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_every_dashboard_query_names_exported_metrics():
    exprs = [t["expr"] for p in panels() for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:specmesh_|vllm:)[a-z0-9_:]+", e)}
    assert len(exprs) >= 30 and len(used) >= 30
    missing = used - exported_names()
    assert not missing, f"dashboard queries metrics the code does not export: {sorted(missing)}"


def test_dashboard_covers_the_acceptance_story():
    titles = " ".join(p["title"] for p in panels()).lower()
    for needle in (
        "acceptance rate",
        "accepted length",
        "cycles per 1,000",
        "source mix",
        "rescue rate",
        "precision",
        "first token",
        "tokens per second",
    ):
        assert needle in titles, needle


def test_each_panel_names_its_queries_once():
    """Grafana keys a panel's queries by refId: a repeated one hides a query."""
    for p in panels():
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), (p["title"], refs)


def test_variables_filter_every_query_and_units_are_set():
    """Each query's selectors carry the namespace and pod variables (and the model on vLLM's
    names); each panel has a unit; the datasource, namespace, model and pod variables exist."""
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "namespace", "model", "pod"]
    for p in panels():
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        for t in p["targets"]:
            for name, sel in re.findall(r"\b((?:specmesh_|vllm:)[a-z0-9_:]+)(\{[^}]*\})?", t["expr"]):
                assert 'namespace=~"$namespace"' in sel and 'pod=~"$pod"' in sel, (p["title"], name)
                assert ('model_name=~"$model"' in sel) == name.startswith("vllm:"), (p["title"], name)
