"""``ftsystem status`` and ``ftsystem watch``: the view of a status answer (pure), and the
errors a user sees. Both commands run against a live job in ``test_status_page.py``, on the
job its browser test trains."""

from __future__ import annotations

import io
from rich.console import Console
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.control.etcd_server import free_port
from unittest.mock import create_autospec

import pytest

from ftsystem.control.api_client import ApiError, ControllerClient
from ftsystem.control.status_cli import render, sparkline, views

STATUS = {
    "job": "demo", "spec": {"replicas": 3, "num_steps": 200}, "leader": "c0",
    "leader_address": "10.0.0.5:8080", "time": 1000.0,
    "epoch": {"number": 3, "members": ["r0", "r2"], "reason": "removal", "paused": False},
    "replicas": [
        {"id": "r0", "state": "member", "step": 150, "generation": 0, "restarts": 0,
         "host": "h0"},
        {"id": "r1", "state": "catching_up", "step": 20, "generation": 1, "restarts": 1,
         "host": "h1"},
        {"id": "r2", "state": "member", "step": 148, "generation": 0, "restarts": 0,
         "host": None}],
    "failures": [{"replica": "r1", "generation": 0, "time": 990.0, "step": 140,
                  "reason": "killed by SIGKILL"}],
    "num_failures": 1,
    "progress": {"ettr_work": 0.61, "ettr_time": 0.93, "step_rate": 12.5, "window_s": 120.0,
                 "measured_s": 80.0,
                 "rates": [{"time": 970.0, "steps_per_s": 14.0},
                           {"time": 985.0, "steps_per_s": 0.0},
                           {"time": 1000.0, "steps_per_s": 7.0}],
                 "epochs": [{"number": 2, "time": 900.0, "num_members": 3, "reason": "join",
                             "paused": False},
                            {"number": 3, "time": 990.5, "num_members": 2,
                             "reason": "removal", "paused": False}]}}


def _text(status: dict) -> str:
    return _plain(render(status))


def _plain(view) -> str:
    console = Console(record=True, width=120, color_system=None, file=io.StringIO())
    console.print(view)
    return console.export_text()


def test_a_sparkline_scales_to_its_peak():
    assert sparkline([]) == ""
    assert sparkline([0.0, 7.0, 14.0]) == "▁▅█"
    assert sparkline([0.0, 0.0]) == "▁▁"


def test_the_view_shows_epoch_rate_progress_and_failures():
    text = _text(STATUS)
    assert "job demo" in text and "leader c0 (10.0.0.5:8080)" in text
    assert "epoch 3 (removal)  2 of 3 replicas: r0, r2" in text
    assert "step rate 12.50 steps/s over 2 min  █▁▅" in text
    assert "ETTR work 0.610, time 0.930" in text
    assert "epochs: 2 join 3 (100 s ago)  3 removal 2 (10 s ago)" in text
    rows = {line.split()[0]: line for line in text.splitlines()
            if line.split() and line.split()[0] in ("r0", "r1", "r2")}
    assert "150/200" in rows["r0"] and "catching_up" in rows["r1"] and "20/200" in rows["r1"]
    assert rows["r0"].count("━") > rows["r1"].count("━")  # the bars: r0 far ahead of r1
    assert "recent failures (1 of 1, newest first)" in text
    assert "killed by SIGKILL" in text and "(10 s ago)" in text


def test_a_standby_without_the_leaders_measure_says_so():
    standby = STATUS | {"progress": None, "progress_note": "measured by the leader c0 at "
                        "10.0.0.5:8080, which this machine does not reach"}
    text = _text(standby)
    assert "step rate, ETTR: measured by the leader c0 at 10.0.0.5:8080" in text
    paused = STATUS | {"epoch": STATUS["epoch"] | {"paused": True}, "failures": []}
    text = _text(paused)
    assert "PAUSED" in text and "failures: none" in text


def test_watch_keeps_the_last_view_with_a_note_while_the_controller_is_away():
    api = create_autospec(ControllerClient, instance=True)
    down = ApiError("the controller at http://c:8080 does not answer (refused)")
    api.get.side_effect = [STATUS, down, STATUS | {"time": 1001.0}]
    shown = [_plain(view) for _, view in zip(range(3), views(api, "demo"))]
    assert "not updating" not in shown[0] and "00:16:40 UTC" in shown[0]
    assert shown[1].startswith(shown[0].rstrip("\n")[:40]) and "not updating (the controller" \
        " at http://c:8080 does not answer (refused)); showing the last view" in shown[1]
    assert "00:16:41 UTC" in shown[2] and "not updating" not in shown[2]
    api.get.side_effect = [down]
    with pytest.raises(ApiError):  # no view yet: the command fails instead
        next(views(api, "demo"))


def test_an_unreachable_controller_says_what_to_do(monkeypatch):
    monkeypatch.setenv("FTSYSTEM_API_TOKEN", "t")
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (["status", "demo"], ["watch", "demo", "--iterations", "1"],
                 ["job", "get", "demo"], ["job", "create", "demo", "--replicas", "1"]):
        done = CliRunner().invoke(app, [*argv, "--controller", url])
        assert done.exit_code == 2, (argv, done.output)
        assert f"the controller at {url} does not answer" in done.output
        assert "start it (ftsystem controller" in done.output
        assert "--controller (or FTSYSTEM_CONTROLLER)" in done.output
    moved = CliRunner().invoke(app, ["job", "get", "demo", "--etcd", "http://127.0.0.1:2379"])
    assert moved.exit_code == 2 and "through the controller's API" in moved.output
