"""Alerting and recording rules: promtool accepts them, their unit tests pass (each alert fires
on a history that should trigger it, not earlier), they only name metrics the code exports, and
each alert's runbook_url names its section of the runbook in docs/operations.md."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from ftsystem.measure import metrics

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
OPERATIONS = REPO / "docs" / "operations.md"
RUNBOOK = "Runbook"
"""The section of docs/operations.md with one subsection per alert."""
RULE_FILES = ("recording.yml", "alerts.yml")
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def promtool(*args: str) -> subprocess.CompletedProcess:
    if not Path(PROMTOOL).exists():
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return subprocess.run([PROMTOOL, *args], cwd=DASHBOARDS, capture_output=True, text=True,
                          timeout=60, check=False)


def test_promtool_checks_the_rules():
    done = promtool("check", "rules", *RULE_FILES)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass():
    done = promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def alert_rules() -> list[dict]:
    return [rule for name in RULE_FILES
            for group in yaml.safe_load((DASHBOARDS / name).read_text())["groups"]
            for rule in group["rules"] if "alert" in rule]


def test_every_alert_has_a_unit_test():
    alerts = {rule["alert"] for rule in alert_rules()}
    tested = {check["alertname"] for test in
              yaml.safe_load((DASHBOARDS / "alerts_test.yml").read_text())["tests"]
              for check in test.get("alert_rule_test", []) if check["exp_alerts"]}
    assert alerts == tested


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Every series name ftsystem's metrics export (``_total``, ``_bucket``, ...): those of every
    process, and the replica-level ones of a replica's rank 0; the old names of renamed metrics
    left out."""
    families = [*REGISTRY.collect(), *metrics.REPLICA_LEVEL.collect()]
    return {family.name + suffix for family in families
            for suffix in SUFFIXES.get(family.type, ("",))} - set(metrics.RENAMED)


def test_rules_and_dashboards_name_only_exported_metrics():
    texts = [(DASHBOARDS / name).read_text() for name in RULE_FILES]
    texts += [json.dumps(json.loads(p.read_text())) for p in DASHBOARDS.glob("*.json")]
    # Not the recorded series (level:ftsystem_...:operation), which the rules define.
    used = {name for text in texts
            for name in re.findall(r"(?<![:\w])ftsystem_[a-z_]+(?![:\w])", text)}
    assert "ftsystem_steps_committed_total" in used
    unknown = used - exported_names()
    assert not unknown, (f"not exported by ftsystem/measure/metrics.py, or an old name of "
                         f"metrics.RENAMED: {sorted(unknown)}")


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors() -> list[str]:
    """The anchors of the subsections of the runbook section, code blocks left out."""
    lines = re.MULTILINE
    text = re.sub(r"^```.*?^```", "", OPERATIONS.read_text(), flags=lines | re.DOTALL)
    section = re.search(rf"^## {RUNBOOK}\n(.*?)(?=^## |\Z)", text, lines | re.DOTALL)
    assert section, f"docs/operations.md has no '## {RUNBOOK}' section"
    return [github_anchor(h) for h in re.findall(r"^### (.+)$", section.group(1), lines)]


def test_github_anchor():
    assert github_anchor("FtsystemNoLeader") == "ftsystemnoleader"
    assert github_anchor("The job's token and the state servers") == \
        "the-jobs-token-and-the-state-servers"


def test_every_alert_links_its_runbook_section():
    anchors = runbook_anchors()
    assert len(anchors) == len(set(anchors)), anchors
    linked = []
    for rule in alert_rules():
        url = rule["annotations"].get("runbook_url", "")
        path, _, anchor = url.partition("#")
        assert path == "docs/operations.md", (rule["alert"], url)
        assert anchor == github_anchor(rule["alert"]), (rule["alert"], url)
        assert anchor in anchors, f"{rule['alert']}: no '### {rule['alert']}' under {RUNBOOK}"
        linked.append(anchor)
    assert sorted(linked) == sorted(anchors), "runbook sections without an alert: " + \
        str(sorted(set(anchors) - set(linked)))
