"""ftsystem.control.store against a real etcd on loopback."""

from __future__ import annotations

import asyncio
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from ftsystem.control.etcd_server import EmbeddedEtcd, EtcdNotInstalledError, etcd_binary, free_port
from ftsystem.control.store import LeaseLostError, Store, StoreUnavailableError, parse_endpoints


def run(coro):
    return asyncio.run(coro)


def test_put_get_and_prefix(etcd, job_id):
    async def scenario():
        async with Store(etcd.url) as store:
            await store.put_json(f"/t/{job_id}/a", {"x": 1})
            await store.put(f"/t/{job_id}/b", "plain")
            items, revision = await store.get_prefix(f"/t/{job_id}/")
            return items, revision, await store.get_json(f"/t/{job_id}/a"), \
                await store.get(f"/t/{job_id}/missing")
    items, revision, value, missing = run(scenario())
    assert items == {f"/t/{job_id}/a": b'{"x": 1}', f"/t/{job_id}/b": b"plain"}
    assert revision > 0 and value == {"x": 1} and missing is None


def test_revoked_lease_removes_its_keys(etcd, job_id):
    async def scenario():
        async with Store(etcd.url) as store:
            lease = await store.grant(30)
            await store.put(f"/t/{job_id}/k", "v", lease=lease)
            await store.revoke(lease)
            await store.revoke(lease)  # revoking twice is not an error
            return await store.get(f"/t/{job_id}/k")
    assert run(scenario()) is None


def test_put_if_absent_and_guarded_put(etcd, job_id):
    async def scenario():
        async with Store(etcd.url) as store:
            key, guard = f"/t/{job_id}/leader", f"/t/{job_id}/epoch"
            first = await store.put_if_absent(key, "me")
            second = await store.put_if_absent(key, "you")
            allowed = await store.put_if_equal(key, "me", guard, "1")
            refused = await store.put_if_equal(key, "you", guard, "2")
            return first, second, allowed, refused, await store.get(guard)
    assert run(scenario()) == (True, False, True, False, b"1")


def test_free_ports_are_bindable_distinct_and_outside_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= port < low for port in ports)  # no outgoing connection gets these
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_unreachable_etcd_names_the_endpoint():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnavailableError, match=r"127\.0\.0\.1.*ftsystem etcd"):
        run(Store(url, retry_deadline_s=0.5).connect())


def test_malformed_endpoint_is_rejected():
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoints("http://nohost")
    assert [str(e) for e in parse_endpoints("a:1, http://b:2/")] == ["http://a:1", "http://b:2"]


def test_watch_resumes_after_etcd_restart(tmp_path):
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd").start()

    async def scenario():
        async with Store(server.url) as writer, Store(server.url, retry_deadline_s=20) as watcher:
            _, revision = await writer.get_prefix("/w/")
            seen: list[tuple[str, str]] = []

            async def follow():
                async for event in watcher.watch_prefix("/w/", start_revision=revision + 1):
                    seen.append((event.kind, event.key))
                    if len(seen) == 2:
                        return

            task = asyncio.create_task(follow())
            await writer.put("/w/before", "1")
            await asyncio.sleep(0.3)
            server.stop()
            await asyncio.sleep(0.5)
            server.start()
            await writer.put("/w/after", "2")  # written while the watch was broken
            await asyncio.wait_for(task, 20)
            return seen
    try:
        assert run(scenario()) == [("PUT", "/w/before"), ("PUT", "/w/after")]
    finally:
        server.stop()


def _keepalive_streams_opened(url: str) -> float:
    """etcd's own count of LeaseKeepAlive streams it has accepted."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("grpc_server_started_total")
               and 'grpc_method="LeaseKeepAlive"' in line)


def test_keep_alive_renews_over_one_stream_across_a_restart_and_reports_a_lost_lease(tmp_path):
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd").start()

    async def scenario():
        async with Store(server.url, retry_deadline_s=20) as store:
            lease = await store.grant(2)
            await store.put("/k/held", "v", lease=lease)
            before = _keepalive_streams_opened(server.url)
            task = asyncio.create_task(store.keep_alive(lease, 2, every_s=0.2))
            await asyncio.sleep(3.0)  # 15 renewals, past the TTL
            streams = _keepalive_streams_opened(server.url) - before
            held_while_renewed = await store.get("/k/held")
            server.stop()
            server.start()  # etcd keeps the lease across a restart; renewals resume
            await asyncio.sleep(3.0)
            held_after_restart = await store.get("/k/held")
            await store.revoke(lease)
            with pytest.raises(LeaseLostError):
                await asyncio.wait_for(task, 10)
            return streams, held_while_renewed, held_after_restart
    try:
        streams, held_while_renewed, held_after_restart = run(scenario())
    finally:
        server.stop()
    assert streams == 1, f"{streams} keep-alive streams for 15 renewals: want one, long-lived"
    assert held_while_renewed == b"v" and held_after_restart == b"v"


def test_keep_alive_outlives_a_pause_while_other_calls_reconnect(tmp_path):
    """etcd frozen (SIGSTOP) for 7 s, under the 10 s TTL, while a read on the same connection
    times out and reconnects (closing the keep-alive's stream under it): the keep-alive goes
    on, and the lease is still held afterwards."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd").start()

    async def scenario():
        async with Store(server.url, retry_deadline_s=30) as store:
            lease = await store.grant(10)
            await store.put("/p/held", "v", lease=lease)
            task = asyncio.create_task(store.keep_alive(lease, 10, every_s=0.2))
            await asyncio.sleep(0.5)
            server.process.send_signal(signal.SIGSTOP)
            loop = asyncio.get_running_loop()
            loop.call_later(7.0, server.process.send_signal, signal.SIGCONT)
            read_during_pause = await store.get("/p/held")  # retried until etcd is back
            await asyncio.sleep(2.0)  # a few renewals after the pause
            alive = not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return read_during_pause, alive, await store.lease_ttl(lease)
    try:
        read_during_pause, alive, ttl = run(scenario())
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()
    assert read_during_pause == b"v"
    assert alive, "the keep-alive task ended during the pause"
    assert ttl is not None and ttl[0] >= 8, f"lease not renewed after the pause: {ttl}"


def _etcd_metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


def test_embedded_etcd_compacts_its_history(tmp_path):
    """Every ftsystem-started etcd compacts old revisions (here after 1 s instead of the
    hour of ``COMPACTION_RETENTION``), so progress writes do not grow the database forever."""
    from conftest import wait_for
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", compaction_retention="1s").start()

    async def write(count: int) -> int:
        async with Store(server.url) as store:
            for step in range(count):
                await store.put("/c/progress", str(step))
            return (await store.get_prefix("/c/"))[1]
    try:
        revision = run(write(200))
        # Periodic compaction keeps the revisions of the last retention period only.
        wait_for(lambda: _etcd_metric(server.url, "etcd_debugging_mvcc_compact_revision")
                 >= revision - 10, 30, "etcd to compact the history of the 200 writes")
    finally:
        server.stop()


def test_missing_etcd_binary_says_how_to_install(monkeypatch):
    monkeypatch.setenv("FTSYSTEM_ETCD_BIN", "/nonexistent/etcd")
    with pytest.raises(EtcdNotInstalledError, match="apt-get install etcd-server"):
        etcd_binary()


def test_ftsystem_etcd_stops_cleanly_and_refuses_a_taken_port(tmp_path):
    import signal
    import socket
    import subprocess
    import sys

    from conftest import wait_for

    port = free_port()
    cmd = [sys.executable, "-m", "ftsystem.cli", "etcd", "--port", str(port)]
    first = subprocess.Popen(cmd + ["--data-dir", str(tmp_path / "a")], stderr=subprocess.PIPE)

    def serving() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    try:
        wait_for(serving, 30, "etcd to serve")
        second = subprocess.run(cmd + ["--data-dir", str(tmp_path / "b")], capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 2 and "is in use" in second.stderr
        first.send_signal(signal.SIGTERM)
        first.wait(30)
        wait_for(lambda: not serving(), 10, "etcd to stop with ftsystem etcd")
    finally:
        first.kill()


def test_keep_alive_ends_when_cancelled_as_a_renewal_is_answered(etcd):
    """A cancellation that lands as a renewal's reply arrives ends the renewals. Python 3.11's
    ``asyncio.wait_for`` returned the reply and dropped the cancellation then: the task renewed
    forever, and a controller's ``gather`` of it after losing its lease never returned
    (``bench controller`` hung in 2 runs of 16)."""
    async def scenario() -> int:
        async with Store(etcd.url) as store:
            lease = await store.grant(30)
            for attempt in range(200):
                task = asyncio.create_task(store.keep_alive(lease, 30, every_s=0.0001))
                # Cancel at every phase of a renewal: sleep, write, and read of the reply.
                await asyncio.sleep(attempt % 20 * 0.0005)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=5)
                if not done:
                    return attempt
            await store.revoke(lease)
            return -1
    assert run(scenario()) == -1, "a cancelled keep_alive went on renewing"
