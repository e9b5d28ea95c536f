"""``ftsystem bench controller`` as users run it: a real etcd, a real controller leader, real
lease revocations; small numbers so that it stays a test, not a timed benchmark."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import pytest
from aetcd.rpc import LeaseKeepAliveResponse
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, RequestReceived
from h2.settings import SettingCodes, Settings
from typer.testing import CliRunner

from ftsystem.benchmarks.controller.config import (
    NODES_TARGET_P99_S, TARGET_P99_S, ControllerMode, NodesConfig, control_plane_budget, deal)
from ftsystem.benchmarks.controller.etcd_rates import metric, parse_prometheus
from ftsystem.benchmarks.controller.keepalive_schedule import KeepAliveSchedule
from ftsystem.benchmarks.controller.keepalive_streams import KeepAliveStreams, keepalive_request
from ftsystem.benchmarks.controller.stats import summarize
from ftsystem.cli import app

STATS = {"p50", "p99", "mean", "max"}


def _bench_in_a_process(*args: str) -> subprocess.CompletedProcess:
    """``ftsystem bench controller ARGS`` as a user runs it: a process of its own. In the test
    process, grpc.aio would meet the event loops that earlier tests closed (it binds its
    completion queue to every loop that used it, and was seen to hang there)."""
    result = subprocess.run([sys.executable, "-m", "ftsystem.cli", "bench", "controller", *args],
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_summarize_hand_case() -> None:
    stats = summarize([0.3, 0.1, 0.2])
    assert stats["p50"] == pytest.approx(0.2)
    assert stats["mean"] == pytest.approx(0.2)
    assert stats["max"] == pytest.approx(0.3)
    assert 0.29 < stats["p99"] <= 0.3


def test_malformed_etcd_url_says_what_to_pass() -> None:
    result = CliRunner().invoke(app, ["bench", "controller", "--etcd", "nonsense"])
    assert result.exit_code == 2
    assert "host:port" in result.output


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("controller", ["subprocess", "in-process"])
def test_bench_controller_writes_its_json(tmp_path, controller: str) -> None:
    out = tmp_path / "controller.json"
    rounds = 2 if controller == "in-process" else 1  # the cheaper one also checks --rounds
    result = _bench_in_a_process("--replicas", "32", "--revokes", "5", "--controller", controller,
                                 "--rounds", str(rounds), "--json", str(out))
    data = json.loads(out.read_text())
    assert {"replicas", "revokes", "decision_latency_s", "target_p99_s", "registration_s",
            "controller", "machine"} <= set(data)
    assert data["replicas"] == 32 and data["revokes"] == 5
    assert data["controller"] == controller and data["target_p99_s"] == TARGET_P99_S
    for measure in ("decision_latency_s", "join_latency_s"):
        assert set(data[measure]) == STATS
        assert all(math.isfinite(v) and v > 0 for v in data[measure].values())
        assert data[measure]["p50"] <= data[measure]["p99"] <= data[measure]["max"]
    assert math.isfinite(data["registration_s"]) and data["registration_s"] > 0
    assert "removal: revoke -> epoch seen" in result.stdout
    assert data["rounds"] == rounds and len(data["later_rounds"]) == rounds - 1
    p99 = data["over_rounds"]["decision_p99_s"]
    assert p99["min"] <= data["decision_latency_s"]["p99"] <= p99["max"]
    assert p99["min"] <= p99["median"] <= p99["max"]


# --- nodes mode ----------------------------------------------------------------------------------

def test_budget_at_16384_node_agents() -> None:
    cfg = NodesConfig(num_nodes=16384, num_replicas=64, num_samples=1, etcd=None,
                      controller=ControllerMode.SUBPROCESS)
    budget = control_plane_budget(cfg)
    # 16,384 node leases renewed every 10 s (as a kubelet renews its node lease), plus 64
    # replica leases every 0.5 s.
    assert budget["keepalives_per_s"] == pytest.approx(16384 / 10 + 64 * 2)
    assert budget["writes_per_s"] == pytest.approx(64)  # one progress write per replica a second
    assert cfg.nodes_per_replica == 256


def test_keepalive_schedule_keeps_the_cadence() -> None:
    schedule = KeepAliveSchedule()
    schedule.add(1, 3.0, 1.0, now=0.0)
    schedule.add(2, 3.0, 2.0, now=0.0)
    assert schedule.due(0.5) == ([], 0.0)
    assert schedule.due(1.5) == ([1], 0.5)
    schedule.remove(2)
    assert schedule.due(2.5)[0] == []  # removed: never sent again
    assert schedule.due(4.0)[0] == [1]  # one interval after its last due time, not after 1.5
    assert schedule.next_due() == pytest.approx(7.0)
    assert schedule.due(20.0) == ([1], 13.0)  # far behind: restarts from now
    assert schedule.next_due() == pytest.approx(23.0)


def test_keepalive_request_is_the_protobuf_message() -> None:
    from aetcd.rpc import LeaseKeepAliveRequest
    for lease in (1, 127, 128, 7587882722066151000, 2**63 - 1):
        body = LeaseKeepAliveRequest(ID=lease).SerializeToString()
        assert keepalive_request(lease) == b"\x00" + len(body).to_bytes(4, "big") + body


def test_prometheus_metrics_parse_and_sum_over_labels() -> None:
    samples = parse_prometheus(
        '# HELP etcd_mvcc_put_total Total number of puts.\n'
        'etcd_mvcc_put_total 42\n'
        'grpc_server_msg_received_total{grpc_method="LeaseKeepAlive",grpc_type="bidi"} 7\n'
        'grpc_server_msg_received_total{grpc_method="Watch",grpc_type="bidi"} 3\n'
        'etcd_mvcc_db_total_size_in_bytes 2.4576e+06\n')
    assert metric(samples, "etcd_mvcc_put_total") == 42
    assert metric(samples, "grpc_server_msg_received_total") == 10
    assert metric(samples, "grpc_server_msg_received_total", "LeaseKeepAlive") == 7
    assert metric(samples, "etcd_mvcc_db_total_size_in_bytes") == 2457600
    assert metric(samples, "etcd_mvcc") == 0  # a prefix of a name is not the name


def test_replicas_are_dealt_whole_over_processes() -> None:
    groups = deal([f"r{i}" for i in range(10)], 4)
    assert [len(g) for g in groups] == [3, 3, 2, 2]
    assert sorted(r for g in groups for r in g) == sorted(f"r{i}" for i in range(10))
    assert len(deal(["a", "b"], 8)) == 2


def test_nodes_must_divide_into_replicas() -> None:
    result = CliRunner().invoke(app, ["bench", "controller", "--nodes", "100", "--replicas", "8"])
    assert result.exit_code == 2
    assert "multiple of --replicas" in result.output


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_controller_nodes_mode_writes_its_json(tmp_path) -> None:
    """512 node agents (2 processes) over 8 replicas: every lease end and join is an epoch."""
    out = tmp_path / "controller_nodes.json"
    result = _bench_in_a_process("--nodes", "512", "--replicas", "8", "--revokes", "3",
                                 "--processes", "2", "--window", "2", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["mode"] == "nodes" and "machine" in data
    assert data["config"]["nodes"] == 512 and data["config"]["replicas"] == 8
    assert data["config"]["processes"] == 2 and data["config"]["lease_ttl_s"] == 10
    assert data["config"]["node_lease_ttl_s"] == 40
    for kind in ("node_lease_end", "reported_failure"):
        stats = data["decision_latency_s"][kind]
        assert set(stats) == STATS | {"n"} and stats["n"] == 3
        assert all(math.isfinite(v) and v > 0 for v in stats.values())
        assert stats["p50"] <= stats["p99"] <= stats["max"]
    assert data["epochs"]["seen"] == data["epochs"]["expected"] == 1 + 2 * 2 * 3
    etcd = data["etcd"]
    for field in ("writes_per_s", "keepalives_per_s", "db_size_bytes", "db_in_use_bytes"):
        assert math.isfinite(etcd[field]) and etcd[field] > 0, field
    # The agents' keep-alives reach etcd at about the budgeted rate (a short window: loosely).
    assert 0.5 < etcd["keepalives_per_s"] / data["budget"]["keepalives_per_s"] < 1.5
    assert data["load"]["sustained"] and data["load"]["leases_lost"] == 0
    assert data["error"] is None
    assert data["target_p99_s"] == NODES_TARGET_P99_S
    assert isinstance(data["meets_target"], bool)
    assert "node lease end" in result.stdout and "reported failure" in result.stdout


# --- the keep-alive streams, against an in-memory HTTP/2 server speaking as etcd does ----------

class _Wire(asyncio.Transport):
    """What the client wrote, for the server to read."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def take(self) -> bytes:
        data, self.written = self.written, b""
        return data


def _etcd_side(wire: _Wire, **settings: int) -> tuple[H2Connection, list[int]]:
    """A server that read the client's preface and answered each stream's headers."""
    server = H2Connection(H2Configuration(client_side=False))
    server.local_settings = Settings(client=False, initial_values={
        SettingCodes[name.upper()]: value for name, value in settings.items()})
    server.initiate_connection()
    opened = [e.stream_id for e in server.receive_data(wire.take())
              if isinstance(e, RequestReceived)]
    for sid in opened:
        server.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
    return server, opened


def _reply(lease: int, ttl: int) -> bytes:
    body = LeaseKeepAliveResponse(ID=lease, TTL=ttl).SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def test_keepalive_streams_deliver_replies_and_end_with_the_stream() -> None:
    async def scenario() -> None:
        replies = []
        client = KeepAliveStreams("etcd:2379", 4, lambda lease, ttl: replies.append((lease, ttl)))
        wire = _Wire()
        client.connection_made(wire)
        server, opened = _etcd_side(wire)
        assert opened == [1, 3, 5, 7]
        await client.send([10, 11, 14])  # each lease on stream lease % 4: 10, 14 -> 5; 11 -> 7
        requests = {e.stream_id: e.data for e in server.receive_data(wire.take())
                    if isinstance(e, DataReceived)}
        assert requests == {5: keepalive_request(10) + keepalive_request(14),
                            7: keepalive_request(11)}
        message = _reply(10, 40) + _reply(14, 0)
        server.send_data(5, message[:7])  # a message split over two DATA frames
        server.send_data(5, message[7:])
        client.data_received(server.data_to_send())
        assert replies == [(10, 40), (14, 0)] and not client.ended.done()
        server.send_headers(5, [("grpc-status", "14"), ("grpc-message", "unavailable")],
                            end_stream=True)
        client.data_received(server.data_to_send())
        with pytest.raises(ConnectionError, match="grpc-status"):
            await client.ended
    asyncio.run(scenario())


def test_keepalive_streams_wait_for_flow_control_window() -> None:
    async def scenario() -> None:
        client = KeepAliveStreams("etcd:2379", 1, lambda lease, ttl: None)
        wire = _Wire()
        client.connection_made(wire)
        server, _ = _etcd_side(wire, initial_window_size=20)
        client.data_received(server.data_to_send())  # etcd's settings: 20 bytes per stream
        sending = asyncio.create_task(client.send(list(range(1000, 1004))))  # 4 x 8 bytes
        await asyncio.sleep(0)
        assert not sending.done()
        server.receive_data(wire.take())  # the client's acknowledgement of the settings
        server.increment_flow_control_window(100, stream_id=1)
        client.data_received(server.data_to_send())
        await asyncio.wait_for(sending, 1)
        sent = b"".join(e.data for e in server.receive_data(wire.take())
                        if isinstance(e, DataReceived))
        assert sent == b"".join(keepalive_request(lease) for lease in range(1000, 1004))
    asyncio.run(scenario())
