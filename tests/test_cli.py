"""Bad input on the command line: a clear message, exit code 2, nothing started."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.etcd_server import free_port

runner = CliRunner()


def plain(output: str) -> str:
    """The message without rich's box drawing and line wrapping."""
    return " ".join(output.replace("│", " ").split())


@pytest.mark.parametrize("args, message", [
    (["run", "--replicas", "2", "--kill-at", "5:9"], "replica 9 does not exist"),
    (["run", "--kill-at", "soon"], "expected STEP:REPLICA[:PHASE]"),
    (["run", "--kill-at", "5:1:never"], "PHASE in step, allreduce, fail-allreduce"),
    (["run", "--replicas", "2", "--min-replicas", "3"], "--min-replicas"),
    (["run", "--job", "a/b"], "invalid job id"),
    (["agent", "--etcd", "http://127.0.0.1:1", "--job", "j", "--replica-id", "r 1", "--",
      "true"], "invalid replica id"),
    (["agent", "--etcd", "http://127.0.0.1:1", "--job", "j", "--replica-id", "r1",
      "--kill-at", "x", "--", "true"], "malformed fault point"),
    (["controller", "--etcd", "http://nohost", "--job", "j"], "expected host:port"),
])
def test_bad_arguments(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in plain(result.output)


def test_unreachable_etcd_is_named(monkeypatch):
    monkeypatch.setenv("FTSYSTEM_ETCD_RETRY_S", "1")
    url = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["agent", "--etcd", url, "--job", "j", "--replica-id", "r1",
                                 "--", "true"])
    assert result.exit_code == 2
    assert "etcd unreachable" in plain(result.output) and url in plain(result.output)
