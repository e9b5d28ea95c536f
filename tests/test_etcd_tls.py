"""etcd over TLS with client certificates, against a real etcd started with certificates made
here: a client with the CA's certificate works, any other is refused with a message that says
what to set, and a whole job (controller, agents, ranks, a restart and its catch-up) runs to
the end with nothing but the three settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from etcd_certs import Certs, make_certs
from ftsystem.cli import app
from ftsystem.control.etcd_server import EmbeddedEtcd
from ftsystem.control.etcd_tls import ENV_NAMES, ClientTls, EtcdTlsError, ServerTls
from ftsystem.control.store import Store, StoreTlsError, parse_endpoints


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_etcd(certs, tmp_path_factory) -> EmbeddedEtcd:
    server = EmbeddedEtcd(data_dir=tmp_path_factory.mktemp("tls-etcd"), tls=ServerTls(
        cert=certs.server_cert, key=certs.server_key, client_ca=certs.ca)).start()
    yield server
    server.stop()


@pytest.fixture
def no_tls_env(monkeypatch) -> None:
    """The process's environment without etcd certificates, restored after the test (the CLI
    sets them for its children)."""
    for name in ENV_NAMES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _tls(certs: Certs, *, cert=True) -> ClientTls:
    return ClientTls.from_files(certs.ca, certs.client_cert if cert else None,
                                certs.client_key if cert else None)


def test_a_client_with_a_certificate_of_the_ca_uses_etcd_over_tls(tls_etcd, certs, job_id):
    assert tls_etcd.url.startswith("https://127.0.0.1:")

    async def use() -> None:
        async with Store(tls_etcd.url, tls=_tls(certs)) as store:
            items, revision = await store.get_prefix(f"/{job_id}/")
            events = store.watch_prefix(f"/{job_id}/", start_revision=revision + 1)
            lease = await store.grant(5)
            await store.put(f"/{job_id}/a", "1", lease=lease)
            await store.refresh(lease)
            event = await anext(events)
            assert (event.kind, event.key, event.value) == ("PUT", f"/{job_id}/a", b"1")
            assert await store.get(f"/{job_id}/a") == b"1" and not items
            await store.revoke(lease)
            assert await store.get(f"/{job_id}/a") is None
    asyncio.run(use())


def _refusal(url: str, tls: ClientTls | None) -> str:
    async def connect() -> None:
        # a long deadline: the refusal must come from the handshake, not from giving up
        async with Store(url, tls=tls, retry_deadline_s=60):
            pass
    with pytest.raises(StoreTlsError) as refused:
        asyncio.run(connect())
    return str(refused.value)


def test_clients_without_the_right_certificate_are_refused_and_told_what_to_set(
        tls_etcd, etcd, certs, no_tls_env):
    for tls in (_tls(certs, cert=False),  # no client certificate
                ClientTls.from_files(certs.ca, certs.stranger_cert, certs.stranger_key)):
        message = _refusal(tls_etcd.url, tls)
        assert "refused this client's certificate" in message
        assert "FTSYSTEM_ETCD_CERT" in message and "FTSYSTEM_ETCD_KEY" in message
    plain = tls_etcd.url.replace("https://", "http://")
    message = _refusal(plain, None)
    assert "speaks TLS" in message and "https://" in message
    assert all(name in message for name in ENV_NAMES)
    untrusted = ClientTls.from_files(certs.stranger_cert, certs.client_cert, certs.client_key)
    assert "FTSYSTEM_ETCD_CA" in _refusal(tls_etcd.url, untrusted)
    # and the other way round: https:// to a plain etcd
    message = _refusal(etcd.url.replace("http://", "https://"), _tls(certs))
    assert "does not speak TLS" in message and etcd.url in message


def test_certificate_settings_that_cannot_work_are_named_before_connecting(certs, tmp_path):
    missing = tmp_path / "missing.pem"
    with pytest.raises(EtcdTlsError, match=f"FTSYSTEM_ETCD_CERT={missing}: cannot read"):
        ClientTls.from_env({"FTSYSTEM_ETCD_CERT": str(missing),
                            "FTSYSTEM_ETCD_KEY": str(certs.client_key)})
    with pytest.raises(EtcdTlsError, match=f"FTSYSTEM_ETCD_CA={tmp_path}: cannot read"):
        ClientTls.from_env({"FTSYSTEM_ETCD_CA": str(tmp_path)})  # a directory
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(EtcdTlsError, match="not a PEM file"):
        ClientTls.from_env({"FTSYSTEM_ETCD_CA": str(garbage)})
    with pytest.raises(EtcdTlsError, match="FTSYSTEM_ETCD_CERT is set but FTSYSTEM_ETCD_KEY"):
        ClientTls.from_env({"FTSYSTEM_ETCD_CERT": str(certs.client_cert)})
    assert ClientTls.from_env({}) is None
    with pytest.raises(EtcdTlsError, match="plain http: write it https://127.0.0.1:2379"):
        Store("http://127.0.0.1:2379", tls=_tls(certs))
    assert [(str(e), e.tls) for e in parse_endpoints("https://a:1,https://b:2/")] == [
        ("https://a:1", True), ("https://b:2", True)]
    with pytest.raises(ValueError, match="mix http:// and https://"):
        Store("https://127.0.0.1:2379,http://127.0.0.2:2379")
    with pytest.raises(EtcdTlsError, match="--client-ca"):
        ServerTls(cert=certs.server_cert, key=certs.server_key, client_ca=missing)


def test_ftsystem_commands_take_the_certificates_and_say_what_is_missing(
        tls_etcd, certs, no_tls_env, tmp_path):
    # `chaos apply` writes to etcd itself (jobs go through the controller's API).
    spec = tmp_path / "kill.yaml"
    spec.write_text("action: kill\nselector: {replicas: [r0]}\n")
    apply = ["chaos", "apply", str(spec), "--job", "tls-cli", "--etcd", tls_etcd.url]
    runner = CliRunner()
    result = runner.invoke(app, [*apply, "--etcd-ca", str(certs.ca)])
    assert result.exit_code == 2 and "FTSYSTEM_ETCD_CERT" in result.output, result.output
    result = runner.invoke(app, [*apply, "--etcd-ca", str(certs.ca),
                                 "--etcd-cert", str(certs.client_cert)])
    assert result.exit_code == 2 and "--etcd-key" in result.output.replace("\n", " ")
    result = runner.invoke(app, apply, env={
        "FTSYSTEM_ETCD_CA": str(certs.ca), "FTSYSTEM_ETCD_CERT": str(certs.client_cert),
        "FTSYSTEM_ETCD_KEY": str(certs.client_key)})
    # With all three it reached etcd over TLS and read the job's registrations: this job has
    # none, so the spec is refused on its merits, not for the connection.
    assert "none registered" in result.output, result.output
    result = runner.invoke(app, ["etcd", "--cert", str(certs.server_cert)])
    assert result.exit_code == 2 and "--client-ca" in result.output


@pytest.mark.slow
def test_a_job_with_a_restart_runs_to_the_end_over_tls(tls_etcd, certs, tmp_path, job_id):
    """``ftsystem run`` with the certificates as options: its controller, its agents and their
    ranks (the first and the restarted generation of the replica killed at step 10) reach etcd
    over TLS only through what it passes down."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    run = subprocess.run(
        [sys.executable, "-m", "ftsystem.cli", "run", "--etcd", tls_etcd.url, "--job", job_id,
         "--replicas", "2", "--steps", "30", "--kill-at", "10:1", "--sleep-per-step", "0.02",
         "--timeout", "30", "--out", str(tmp_path), "--json", str(tmp_path / "s.json"),
         "--etcd-ca", str(certs.ca), "--etcd-cert", str(certs.client_cert),
         "--etcd-key", str(certs.client_key)],
        env=env, capture_output=True, text=True, timeout=280)
    logs = "\n".join(p.read_text()[-1500:] for p in tmp_path.glob("*.log"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:] + logs
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == 30 and summary["bitwise_identical"] and summary["agents_ok"]
    assert [f["replica"] for f in summary["failures"]] == ["r1"]
