"""The committed dashboards, read as JSON (no Prometheus, no browser): every panel reads the
``datasource`` variable, counters are plotted through ``rate``/``increase``, failures and epoch
changes are annotations, a collapsed "GPU" row shows DCGM's metrics, and etcd is the job's.
``tests/test_dashboards.py`` checks that this JSON is the generator's and that it has data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FT_HSDP = ("job-overview.json", "replica-detail.json", "catch-up.json")
WITH_GPU_ROW = ("job-overview.json", "halos.json")
DCGM = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE")
ETCD_JOB = "etcd"
"""The scrape job of etcd in docker/prometheus.yml, which the rules select."""


def committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those of collapsed rows included (rows too)."""
    return [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]


def exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and every annotation query."""
    found = [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]
    found += [(f"annotation {a['name']}", a["expr"])
              for a in dashboard["annotations"].get("list", [])]
    return found


def datasource_refs(node: object) -> list[object]:
    """Every value of a ``datasource`` key, at any depth."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "datasource"] + \
            [r for v in node.values() for r in datasource_refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in datasource_refs(v)]
    return []


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    found = committed()
    assert set(FT_HSDP) | {"halos.json"} <= set(found), sorted(found)
    return found


def test_every_dashboard_selects_its_prometheus_with_a_variable(dashboards):
    provisioned = yaml.safe_load(
        (DASHBOARDS / "provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    assert "prometheus" in {d["type"] for d in provisioned}  # what the variable offers
    for name, dashboard in dashboards.items():
        first = dashboard["templating"]["list"][0]
        assert (first["name"], first["type"], first["query"]) == \
            ("datasource", "datasource", "prometheus"), name


def test_no_datasource_uid_is_hard_coded(dashboards):
    for name, dashboard in dashboards.items():
        refs = datasource_refs(dashboard)
        assert refs, name
        assert all(ref == DATASOURCE for ref in refs), \
            f"{name}: {sorted({json.dumps(r) for r in refs if r != DATASOURCE})}"
        for panel in panels(dashboard):
            if panel["type"] != "row":
                assert panel.get("datasource") == DATASOURCE, (name, panel["title"])
                assert all(t.get("datasource") == DATASOURCE for t in panel["targets"]), \
                    (name, panel["title"])
        queried = [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
        assert all(v["datasource"] == DATASOURCE for v in queried), name
        assert all(a["datasource"] == DATASOURCE
                   for a in dashboard["annotations"].get("list", [])), name


COUNTER = re.compile(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*_total\b")
WRAPPED = re.compile(r"\b(rate|irate|increase)\(\s*$")


def raw_counters(expr: str) -> list[str]:
    """The counters of ``expr`` that are not the argument of rate/irate/increase."""
    return [m.group() for m in COUNTER.finditer(expr) if not WRAPPED.search(expr[:m.start()])]


def test_raw_counters_are_found():
    assert raw_counters("sum(ftsystem_replica_restarts_total{job=\"j\"})") == \
        ["ftsystem_replica_restarts_total"]
    assert raw_counters("sum(increase(ftsystem_replica_restarts_total{job=\"j\"}[1h])) / "
                        "sum(rate( ftsystem_steps_committed_total[5m]))") == []


def test_counters_are_plotted_through_rate_or_increase(dashboards):
    raw = [f"{name} / {where}: {expr}" for name, dashboard in dashboards.items()
           for where, expr in exprs(dashboard) if raw_counters(expr)]
    assert not raw, "counters plotted raw (they start over with each process):\n" + \
        "\n".join(raw)


def annotations(dashboard: dict) -> dict[str, dict]:
    return {a["name"]: a for a in dashboard["annotations"].get("list", [])}


@pytest.mark.parametrize("name", FT_HSDP)
def test_failures_and_epoch_changes_are_annotations(dashboards, name):
    found = annotations(dashboards[name])
    for title, counter in (("Replica restarts", "ftsystem_replica_restarts_total"),
                           ("Injected chaos", "ftsystem_failures_injected_total"),
                           ("Epoch changes", "ftsystem_membership_changes_total")):
        assert title in found, (name, sorted(found))
        expr = found[title]["expr"]
        assert f"increase({counter}{{" in expr and 'job="$job"' in expr, expr
        assert found[title]["enable"] and found[title]["titleFormat"], found[title]


def test_halos_marks_node_restarts(dashboards):
    found = annotations(dashboards["halos.json"])
    assert "increase(ftsystem_replica_restarts_total{" in found["Node restarts"]["expr"]


@pytest.mark.parametrize("name", WITH_GPU_ROW)
def test_a_collapsed_gpu_row_shows_dcgm_metrics(dashboards, name):
    rows = [p for p in dashboards[name]["panels"] if p["type"] == "row" and p["title"] == "GPU"]
    assert len(rows) == 1, name
    row = rows[0]
    assert row["collapsed"] is True
    queried = " ".join(t["expr"] for p in row["panels"] for t in p["targets"])
    assert all(metric in queried for metric in DCGM), queried
    # DCGM's series elsewhere than in the collapsed row would be queried on every load.
    top = [t["expr"] for p in dashboards[name]["panels"] for t in p.get("targets", [])]
    assert not any("DCGM_" in expr for expr in top)
    assert "gpu_host" in {v["name"] for v in dashboards[name]["templating"]["list"]}


ETCD_METRIC = re.compile(r"(?<![:\w])etcd_[a-z_]+(?![:\w])(\{[^}]*\})?")
"""An etcd metric and its selector, not a recorded series (``instance:etcd_...:min``)."""


def test_etcd_panels_select_the_jobs_etcd(dashboards):
    used = 0
    for name, dashboard in dashboards.items():
        for where, expr in exprs(dashboard):
            for m in ETCD_METRIC.finditer(expr):
                used += 1
                assert 'job="$etcd_job"' in (m.group(1) or ""), (name, where, expr)
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        if any("etcd_" in expr for _, expr in exprs(dashboard)):
            assert variables["etcd_job"]["current"]["value"] == ETCD_JOB, name
    assert used


def test_rules_select_the_same_etcd():
    rules = [rule["expr"] for name in ("recording.yml", "alerts.yml")
             for group in yaml.safe_load((DASHBOARDS / name).read_text())["groups"]
             for rule in group["rules"]]
    selectors = [m.group(1) for expr in rules for m in ETCD_METRIC.finditer(expr)]
    assert selectors and all(s == f'{{job="{ETCD_JOB}"}}' for s in selectors), selectors


def test_every_variable_a_query_uses_is_defined(dashboards):
    for name, dashboard in dashboards.items():
        defined = {v["name"] for v in dashboard["templating"]["list"]}
        texts = [expr for _, expr in exprs(dashboard)]
        texts += [v.get("query", "") for v in dashboard["templating"]["list"]]
        used = {m for text in texts for m in re.findall(r"\$(\w+)", text)
                if not m.startswith("__")}
        assert used <= defined, (name, sorted(used - defined))
