"""Grafana dashboards: the committed JSON is what the generator makes, and every panel's query
returns data from a real Prometheus scraping a real job found through the controller's service
discovery. ``tests/test_dashboard_json.py`` checks the JSON itself (datasource, counters,
annotations, the GPU row)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import wait_for
from ftsystem.control.etcd_server import free_port
from ftsystem.chaos.faults import FaultPoint
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
PROMETHEUS = Path("/usr/bin/prometheus")
RATE_INTERVAL = "10s"
"""Grafana's ``$__rate_interval`` is at least 4 scrape intervals (here 1 s)."""
RANGE = "1h"
"""``$__range``, the dashboard's time range: longer than a run."""
ETCD_JOB = "etcd"
"""The scrape job of etcd in ``write_prometheus_config`` (the ``etcd_job`` variable's value)."""
WITHOUT_EXPORTER = ("DCGM_",)
"""Series of exporters the tests do not run (NVIDIA's DCGM exporter: the "GPU" row)."""
OPTIONAL_VARIABLES = {"gpu_host"}
"""Variables read from those exporters: they offer nothing here."""
COMPONENTS = {"controller", "agent", "replica"}
RULE_FILES = ("recording.yml", "alerts.yml")


HALOS = "halos.json"
"""The HALoS dashboard: fed by ``ftsystem halos run``, not by an FT-HSDP job."""
FTSYSTEM = str(Path(sys.executable).with_name("ftsystem"))


def committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def ft_hsdp_dashboards() -> dict[str, dict]:
    return {name: d for name, d in committed().items() if name != HALOS}


def panel_targets(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query of every panel, rows included, but those of
    the exporters the tests do not run."""
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    return [(p["title"], t["refId"], t["expr"]) for p in panels for t in p.get("targets", [])
            if not any(name in t["expr"] for name in WITHOUT_EXPORTER)]


def test_committed_dashboards_are_current(tmp_path):
    done = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--out",
                           str(tmp_path)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, ("dashboards/generate.py failed (pip install -e '.[test]' "
                                  f"installs the grafana-foundation-sdk it needs):\n{done.stderr}")
    generated = sorted(p.name for p in tmp_path.glob("*.json"))
    assert generated == sorted(committed()), ("the generator makes other dashboards than those "
                                              "committed: run python dashboards/generate.py")
    stale = [name for name in generated
             if (tmp_path / name).read_bytes() != (DASHBOARDS / name).read_bytes()]
    assert not stale, f"{stale} differ from the generator's: run python dashboards/generate.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_panel_returns_data_from_a_real_job(etcd, job_id, tmp_path):
    if not PROMETHEUS.exists():
        pytest.skip(f"{PROMETHEUS} is not installed")
    controller = free_port()
    # The job's token, which discovery and the controller's /metrics need: the run writes its
    # own there as it starts (promtool wants the file to exist before).
    token_file = tmp_path / "run" / "api-token"
    token_file.parent.mkdir()
    token_file.write_text("not yet")
    config = write_prometheus_config(tmp_path, f"http://127.0.0.1:{controller}/v1/sd/prometheus",
                                     etcd.url, token_file)
    checked = subprocess.run([shutil.which("promtool") or "/usr/bin/promtool", "check",
                              "config", str(config)], check=False, capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    cfg = RunConfig(num_replicas=2, num_steps=300, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path / "run",
                    # A failed all-reduce on r0 feeds the FTAR failure panel (a peer's death
                    # may surface as an epoch change instead, which is not a failure).
                    kills=[ReplicaKill(1, FaultPoint(60, "step")),
                           ReplicaKill(0, FaultPoint(30, "fail-allreduce"))],
                    train_args=["--sleep-per-step", "0.03"], controller_ports=[controller],
                    show_progress=False)
    prom = f"http://127.0.0.1:{free_port()}"
    prometheus = start_prometheus(config, tmp_path, prom)
    summaries: list[dict] = []
    runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)))
    started = time.time()
    runner.start()
    try:
        wait_for(lambda: _components_up(prom, job_id) >= COMPONENTS, 60,
                 "Prometheus to scrape the controller, the agents and the replicas")
        targets = httpx.get(f"{prom}/api/v1/targets").json()["data"]["activeTargets"]
        replicas = [t["labels"] for t in targets if t["labels"].get("component") == "replica"]
        assert {(t["replica"], t["rank"]) for t in replicas} <= {("r0", "0"), ("r1", "0")}
        # Ranks and agents carry their machine: the --node-id `ftsystem run` gives each node.
        hosts = {t["labels"]["host"] for t in targets
                 if t["labels"].get("component") in ("replica", "agent")}
        assert hosts and hosts <= {f"{job_id}-r0-n0", f"{job_id}-r1-n0"}, hosts
        runner.join(120)
        assert summaries, "the job did not end in time"
        assert len(summaries[0]["failures"]) == 1, summaries[0]["failures"]
        window = {"start": started, "end": time.time(), "step": 1}
        check_variables(prom, job_id, window, ft_hsdp_dashboards(),
                        {"job": {job_id}, "replica": {"r0", "r1"}, "etcd_job": {ETCD_JOB}})
        assert_every_panel_has_data(prom, job_id, window, ft_hsdp_dashboards())
        assert_every_annotation_selects_series(prom, job_id, window, ft_hsdp_dashboards())
        silent = [rule for rule in recording_rules() if not _has_value(prom, rule, window)]
        assert not silent, f"recording rules without data: {silent}"
    finally:
        runner.join(120)
        stop_prometheus(prometheus)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_halos_panel_returns_data_from_a_real_run(etcd, job_id, tmp_path):
    """``ftsystem halos run`` keeps a file_sd list of its endpoints; a real Prometheus scrapes
    the GPS, the LPSs, the workers and their agents through it while w1 is killed once."""
    if not PROMETHEUS.exists():
        pytest.skip(f"{PROMETHEUS} is not installed")
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "halos", "honor_labels": True, "file_sd_configs": [
            {"files": [str(targets)], "refresh_interval": "1s"}]}]}))
    prom = f"http://127.0.0.1:{free_port()}"
    prometheus = start_prometheus(config, tmp_path, prom)
    started = time.time()
    try:
        done = subprocess.run(
            [FTSYSTEM, "halos", "run", "--etcd", etcd.url, "--job", job_id, "--out",
             str(tmp_path / "run"), "--prometheus-sd", str(targets), "--updates", "16",
             "--accumulation-k", "8", "--step-time", "0.05", "--kill-at", "2:w1",
             "--deadline", "200"], capture_output=True, text=True, timeout=220, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        window = {"start": started, "end": time.time(), "step": 1}
        check_variables(prom, job_id, window, {HALOS: committed()[HALOS]}, {"job": {job_id}})
        assert_every_panel_has_data(prom, job_id, window, {HALOS: committed()[HALOS]})
        assert_every_annotation_selects_series(prom, job_id, window, {HALOS: committed()[HALOS]})
    finally:
        stop_prometheus(prometheus)


def assert_every_panel_has_data(prom: str, job_id: str, window: dict,
                                dashboards: dict[str, dict]) -> None:
    empty = [f"{name} / {title} / {ref}: {expr}"
             for name, dashboard in dashboards.items()
             for title, ref, expr in panel_targets(dashboard)
             if not _has_value(prom, _substitute(expr, job_id), window)]
    assert not empty, "panels without data:\n" + "\n".join(empty)


def assert_every_annotation_selects_series(prom: str, job_id: str, window: dict,
                                           dashboards: dict[str, dict]) -> None:
    """Every annotation query runs and selects series of the job: without its ``> 0``, as a
    run may have no event of a kind (the counters exist at zero from each process's start)."""
    silent = [f"{name} / {a['name']}: {a['expr']}"
              for name, dashboard in dashboards.items()
              for a in dashboard["annotations"].get("list", [])
              if not _has_value(prom, _substitute(a["expr"].removesuffix(" > 0"), job_id),
                                window)]
    assert not silent, "annotations without series:\n" + "\n".join(silent)


def stop_prometheus(prometheus: subprocess.Popen) -> None:
    prometheus.terminate()
    try:
        prometheus.wait(15)
    except subprocess.TimeoutExpired:
        prometheus.kill()
        prometheus.wait()


def start_prometheus(config: Path, directory: Path, url: str) -> subprocess.Popen:
    with open(directory / "prometheus.log", "wb") as log:
        return subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}",
             f"--storage.tsdb.path={directory / 'tsdb'}",
             f"--web.listen-address={url.removeprefix('http://')}"],
            stdout=log, stderr=subprocess.STDOUT)


def write_prometheus_config(directory: Path, discovery_url: str, etcd_url: str,
                            token_file: Path) -> Path:
    """The job through the controller's discovery, with the job's token (``token_file``), etcd
    (as scrape job ``ETCD_JOB``), and the committed rules (evaluated every second, so that the
    recording rules have data within the run)."""
    path = directory / "prometheus.yml"
    token = {"type": "Bearer", "credentials_file": str(token_file)}
    path.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DASHBOARDS / name) for name in RULE_FILES],
        "scrape_configs": [
            {"job_name": "ftsystem", "honor_labels": True, "authorization": token,
             "http_sd_configs": [
                 {"url": discovery_url, "refresh_interval": "1s", "authorization": token}]},
            {"job_name": ETCD_JOB, "static_configs": [
                {"targets": [etcd_url.removeprefix("http://")]}]}],
    }))
    return path


def recording_rules() -> list[str]:
    return [rule["record"] for name in RULE_FILES
            for group in yaml.safe_load((DASHBOARDS / name).read_text())["groups"]
            for rule in group["rules"] if "record" in rule]


def check_variables(prom: str, job_id: str, window: dict, dashboards: dict[str, dict],
                    expected: dict[str, set[str]]) -> None:
    """Each ``label_values(selector, label)`` variable offers the values ``expected`` gives for
    its name (those of ``OPTIONAL_VARIABLES`` aside; the datasource variable is no query)."""
    for dashboard in dashboards.values():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query" or variable["name"] in OPTIONAL_VARIABLES:
                continue
            selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)",
                                           variable["query"]).groups()
            values = httpx.get(f"{prom}/api/v1/label/{label}/values", params={
                "match[]": _substitute(selector, job_id), "start": window["start"],
                "end": window["end"]}).json()["data"]
            assert expected[variable["name"]] <= set(values), (variable["name"], values)


def _substitute(expr: str, job_id: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", RANGE)
            .replace("$etcd_job", ETCD_JOB).replace("$gpu_host", ".*")
            .replace("$job", job_id).replace("$replica", ".*"))


def _has_value(prom: str, expr: str, window: dict) -> bool:
    """Whether the query yields a number (not NaN) at some time of the run."""
    reply = httpx.get(f"{prom}/api/v1/query_range", params={"query": expr, **window}).json()
    assert reply["status"] == "success", (expr, reply)
    return any(math.isfinite(float(v)) for series in reply["data"]["result"]
               for _, v in series["values"])


def _components_up(prom: str, job_id: str) -> set[str]:
    """The components of the job that Prometheus has scraped successfully."""
    try:
        targets = httpx.get(f"{prom}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
    except (httpx.HTTPError, ValueError):  # not listening, or not ready yet
        return set()
    return {t["labels"]["component"] for t in targets
            if t["labels"].get("job") == job_id and t["health"] == "up"}
