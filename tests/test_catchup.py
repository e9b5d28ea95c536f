"""Non-blocking catch-up and step reconciliation, with real processes and real etcd."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
import time

import httpx
import pytest
import torch

from conftest import wait_for
from ftsystem.control import keys
from ftsystem.training.http_transport import HTTPTransport, StateServer
from ftsystem.training.snapshot import Snapshotter
from ftsystem.training.transport import DonorUnavailableError
from ftsystem.training.settings import ReplicaSettings
from ftsystem.training.update_log import (KEEP_MIN_ENTRIES, LoggedUpdate, UpdateLog,
                                          log_on_host)
from ftsystem.training.wire import (decode_state, encode_state, receiving_buffers, tensor_places,
                                    tree_tensors)
from ftsystem.training.entry_plan import join_step_absentees
from ftsystem.training.fingerprint import GENESIS
from ftsystem.training.state_access import Credentials, StateAccess
from ftsystem.chaos.faults import FaultPoint
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
from ftsystem.control.store import Store
from ftsystem.control.tokens import state_key
from ftsystem.example.workload import ModelConfig, TinyGPT, num_params
from test_fault_tolerance import TRAIN_ARGS, assert_invariant, load_results

pytestmark = pytest.mark.slow


def test_update_log_keeps_a_window_and_a_budget():
    entry = LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS)  # 1 KiB
    log = UpdateLog(budget_bytes=10 * 1024)
    for step in range(1, 21):
        log.append(step, entry)
    assert log.oldest() == 17  # no session: only the last few steps
    assert [s for s, _ in log.since(18)] == [19, 20] and log.since(15) is None
    log.session_active = True
    for step in range(21, 41):
        log.append(step, entry)
    assert log.oldest() == 31 and log.nbytes == 10 * 1024  # the budget, oldest dropped


def test_update_log_never_holds_more_than_its_budget():
    # Entries of 1 KiB and a budget of 2.5: even the last few steps kept for step
    # reconciliation stay within it (a model whose gradient outgrows the budget keeps none,
    # and members behind receive the whole state).
    entry = LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS)
    log = UpdateLog(budget_bytes=2560)
    for step in range(1, 11):
        log.append(step, entry)
        assert log.nbytes <= 2560
    assert log.oldest() == 9
    tiny = UpdateLog(budget_bytes=100)
    tiny.append(1, LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS))
    assert tiny.oldest() is None and tiny.nbytes == 0
    assert tiny.recycle(256, torch.float32) is not None  # the dropped buffer is reused


def test_update_log_memory_follows_its_budget():
    # Entries of 1 KiB, a budget of 2.5 KiB, a joiner reading (the log keeps all it can):
    # entries and the buffers kept for reuse stay within the budget, beyond it only the one
    # buffer the next step's average needs anyway.
    log = UpdateLog(budget_bytes=2560)
    log.session_active = True
    for step in range(1, 30):
        log.append(step, LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS))
        assert log.held_bytes <= 2560 + 1024
    assert log.nbytes == 2048 and log.held_bytes == 3072


def test_an_entry_over_the_budget_empties_the_log_without_a_gap():
    log = UpdateLog(budget_bytes=2048)
    for step in (1, 2):
        log.append(step, LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS))
    # A larger carry makes step 3 too big: keeping 1 and 2 would leave a log with a gap.
    log.append(3, LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS,
                               carry=b"x" * 2048))
    assert log.entries() == [] and log.since(0) == []
    log.append(4, LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS))
    assert log.since(0) is None and [s for s, _ in log.since(3)] == [4]


def test_reserved_buffers_serve_the_first_steps_and_then_the_log_recycles():
    # A fresh process (a joiner above all) would otherwise page-fault a new buffer for each
    # of its first steps' averages, while the members wait for it at the all-reduce.
    log = UpdateLog(budget_bytes=1 << 20)
    log.reserve(256, torch.float32, torch.device("cpu"))
    reserved = {id(t) for t in log._spare}
    assert len(reserved) == KEEP_MIN_ENTRIES + 1
    taken = []
    for step in range(1, 3 * KEEP_MIN_ENTRIES):
        buf = log.recycle(256, torch.float32)
        assert buf is not None, f"step {step} found no buffer"
        taken.append(id(buf))
        log.append(step, LoggedUpdate(buf, parent=GENESIS, chain=GENESIS))
    assert set(taken) == reserved  # every step reused one of them: nothing new was allocated


def test_a_reserve_stays_within_the_budget():
    log = UpdateLog(budget_bytes=2048)  # two entries of 1 KiB
    log.reserve(256, torch.float32, torch.device("cpu"))
    assert len(log._spare) == 3 and log.held_bytes == 3072  # as in steady state
    over = UpdateLog(budget_bytes=100)  # not even one entry: the one buffer a step needs
    over.reserve(256, torch.float32, torch.device("cpu"))
    assert len(over._spare) == 1


def test_a_recycled_buffer_is_on_the_device_asked_for():
    log = UpdateLog(budget_bytes=100)
    log.append(1, LoggedUpdate(torch.zeros(256), parent=GENESIS, chain=GENESIS))
    assert log.recycle(256, torch.float32, torch.device("cuda", 0)) is None
    assert log.recycle(256, torch.float64) is None
    assert log.recycle(256, torch.float32, torch.device("cpu")) is not None


@pytest.mark.parametrize("place, budget, free, on_host", [
    ("auto", 1 << 30, None, False),       # host gradients: the log is on the host anyway
    ("auto", 1 << 30, 80 << 30, False),   # a quarter of the free memory is 20 GiB
    ("auto", 30 << 30, 80 << 30, True),   # the budget would take over a quarter of it
    ("device", 30 << 30, 80 << 30, False),
    ("host", 1 << 20, 80 << 30, True),
])
def test_the_log_goes_to_the_host_when_the_device_is_short(place, budget, free, on_host):
    assert log_on_host(place, budget, free) is on_host


def test_a_bad_log_place_is_refused_with_its_variable():
    with pytest.raises(ValueError, match="FTSYSTEM_CATCHUP_LOG_PLACE='gpu'"):
        ReplicaSettings.from_env({"FTSYSTEM_CATCHUP_LOG_PLACE": "gpu"})
    assert ReplicaSettings.from_env({"FTSYSTEM_CATCHUP_LOG_PLACE": "host"}).log_place == "host"


def test_the_warm_up_follows_its_variable_and_is_otherwise_left_to_the_device():
    assert ReplicaSettings.from_env({}).warm_up is None  # on a GPU, off on a CPU
    assert ReplicaSettings.from_env({"FTSYSTEM_WARM_UP": "1"}).warm_up is True
    assert ReplicaSettings.from_env({"FTSYSTEM_WARM_UP": "0"}).warm_up is False


def _served_state() -> dict:
    # Every kind of tensor a state holds: float and bfloat16 parameters, a non-contiguous
    # one, 0-d step counters, an empty one; bytes and plain values beside them.
    return {"model": {"w": torch.randn(1000, 300), "t": torch.randn(30, 20).t(),
                      "h": torch.randn(64).bfloat16(), "e": torch.empty(0)},
            "optim": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(1000, 300)}},
            "hyper": [{"lr": 1e-3, "betas": (0.9, 0.999)}], "step": 12,
            "chain": b"\x01" * 32, "carry": b"", "objects": {"sched": {"last_epoch": 3}}}


def test_snapshot_and_log_arrive_bitwise_over_a_real_socket():
    state, log = _served_state(), UpdateLog()
    snapshotter = Snapshotter(lambda: state)
    access = StateAccess(key="t", donor="r0", epoch=lambda: (1, ("r0", "r1")),
                         assigned_donor=lambda rid: None)
    server = StateServer("127.0.0.1", snapshotter, log, current_step=lambda: 12, timeout_s=10,
                         access=access)
    member = HTTPTransport(10, Credentials.of("r1", "t"))
    try:
        stop = threading.Event()

        def train() -> None:  # commits step 12 over and over; the copy starts after one
            while not stop.wait(0.01):
                snapshotter.after_commit(12)
        threading.Thread(target=train, daemon=True).start()
        snapshot = member.fetch_snapshot(server.address)
        stop.set()
        assert snapshot.step == 12 and snapshot.nbytes > 2 * 1000 * 300 * 4
        assert snapshot.stats()["transfer_bytes_per_s"] > 0
        sent, got = list(tree_tensors(state)), list(tree_tensors(snapshot.state))
        assert [(t.dtype, t.shape) for t in sent] == [(t.dtype, t.shape) for t in got]
        assert all(torch.equal(a, b) for a, b in zip(sent, got))
        assert {k: snapshot.state[k] for k in ("hyper", "step", "chain", "carry", "objects")} \
            == {k: state[k] for k in ("hyper", "step", "chain", "carry", "objects")}

        grads = [torch.randn(5000) for _ in range(KEEP_MIN_ENTRIES + 2)]
        for step, grad in enumerate(grads, start=13):
            log.append(step, LoggedUpdate(grad, parent=b"p%d" % step, chain=b"c%d" % step))
        updates, head, nbytes = member.fetch_log(server.address, 14)
        assert head == 12 and nbytes > 4 * 5000 * len(updates)  # head: current_step's answer
        assert [s for s, _ in updates] == list(range(15, 13 + len(grads)))
        assert all(torch.equal(u.grad, grads[s - 13]) and u.chain == b"c%d" % s
                   for s, u in updates)
        assert member.fetch_log(server.address, 1) is None  # dropped
        assert snapshotter.step == -1  # and the old snapshot was freed for a newer one
        with pytest.raises(DonorUnavailableError, match="409"):
            member.fetch_snapshot(server.address, at_step=5)  # committed
    finally:
        server.shutdown()


def test_a_joiner_allocates_what_it_lacks_from_the_donors_layout_before_the_snapshot():
    state = _served_state()
    snapshotter = Snapshotter(lambda: state)
    access = StateAccess(key="t", donor="r0", epoch=lambda: (1, ("r0", "r1")),
                         assigned_donor=lambda rid: None)
    server = StateServer("127.0.0.1", snapshotter, UpdateLog(), current_step=lambda: 12,
                         timeout_s=10, access=access)
    member = HTTPTransport(10, Credentials.of("r1", "t"))
    own = {("model", "w"): torch.zeros(1000, 300), ("model", "h"): torch.zeros(3)}
    layouts, destinations = [], {}

    def into(layout: dict) -> dict:
        layouts.append(layout)
        destinations.update(receiving_buffers(own, layout))
        return destinations
    try:
        assert member.fetch_layout(server.address) == {}  # no commit yet
        stop = threading.Event()

        def train() -> None:
            while not stop.wait(0.01):
                snapshotter.after_commit(12)
        threading.Thread(target=train, daemon=True).start()
        wait_for(lambda: snapshotter.layout is not None, 30, "a first commit")
        snapshot = member.fetch_snapshot(server.address, into=into)
        stop.set()
        wrong = HTTPTransport(10, Credentials("r1", "wrong"))
        assert wrong.fetch_layout(server.address) == {}  # refused
    finally:
        server.shutdown()
    places = tensor_places(state)
    assert {p: (m.shape, m.dtype) for p, m in layouts[0].items()} == \
        {p: (t.shape, t.dtype) for p, t in places.items()}
    received = tensor_places(snapshot.state)
    assert received[("model", "w")] is own[("model", "w")]  # its own, where it fits
    assert received[("optim", 0, "exp_avg")] is destinations[("optim", 0, "exp_avg")]
    assert received[("model", "h")] is destinations[("model", "h")]  # h: another shape
    assert all(torch.equal(received[p], places[p]) for p in places)


def test_the_session_ends_once_everyone_served_is_a_member(monkeypatch):
    monkeypatch.setenv("FTSYSTEM_CATCHUP_IDLE_S", "60")  # not by idleness
    members = ["r0", "r1"]
    log = UpdateLog()
    access = StateAccess(key="t", donor="r0", epoch=lambda: (1, tuple(members)),
                         assigned_donor=lambda rid: "r0")
    server = StateServer("127.0.0.1", Snapshotter(lambda: {}), log, current_step=lambda: 3,
                         timeout_s=10, access=access)
    try:
        log.append(3, LoggedUpdate(torch.zeros(8), parent=GENESIS, chain=GENESIS))
        assert HTTPTransport(10, Credentials.of("r2", "t")).fetch_log(server.address, 2)
        assert log.session_active
        time.sleep(2.5)  # two polls: r2 is still catching up
        assert log.session_active
        members.append("r2")  # its join epoch
        wait_for(lambda: not log.session_active, 30, "the end of the session")
    finally:
        server.shutdown()


def test_a_snapshot_of_the_live_state_survives_the_next_optimizer_step():
    # On CPU nothing is copied at the commit: the transfer reads the state's own memory. A
    # mutation (the next optimizer step) first copies what the transfer has still to send, so
    # the joiner gets the committed step's values bit for bit, and the donor trains on.
    state = {"model": {f"w{i}": torch.randn(1 << 18) for i in range(8)}, "step": 3}
    committed = {k: v.clone() for k, v in state["model"].items()}
    snapshotter = Snapshotter(lambda: state)
    snapshotter.request()
    snapshotter.after_commit(3)
    transfer = snapshotter.taken(3)
    assert transfer is not None  # reading the live memory:
    assert transfer.state.tensors[0].data_ptr() == state["model"]["w0"].data_ptr()
    half = threading.Event()

    class SlowSocket(io.BytesIO):  # a joiner that reads slowly
        def write(self, data) -> int:
            if self.tell() > transfer.nbytes // 2:
                half.set()
            time.sleep(0.002)
            return super().write(data)

    out = SlowSocket()
    sender = threading.Thread(target=transfer.write_to, args=(out,))
    sender.start()
    half.wait(10)
    snapshotter.before_mutation()
    for tensor in state["model"].values():
        tensor += 1.0  # the optimizer step
    sender.join()
    assert snapshotter.step == -1 and snapshotter.taken(3) is None  # no longer offered
    out.seek(0)
    step, received = decode_state(lambda buffer: out.readinto(buffer))
    assert step == 3 and all(torch.equal(received["model"][k], committed[k]) for k in committed)
    assert not torch.equal(state["model"]["w7"], committed["w7"])


def test_a_snapshot_lands_in_the_joiners_own_tensors():
    sent = {"model": {"a": torch.randn(300, 20), "b": torch.randn(7)}, "step": 2}
    ours = {"model": {"a": torch.zeros(300, 20), "b": torch.zeros(8)}}  # b: another shape
    out = io.BytesIO()
    encode_state(2, sent).write_to(out)
    out.seek(0)
    _, received = decode_state(lambda buffer: out.readinto(buffer), tensor_places(ours))
    assert received["model"]["a"] is ours["model"]["a"]  # received in place
    assert torch.equal(ours["model"]["a"], sent["model"]["a"])
    assert received["model"]["b"] is not ours["model"]["b"]
    assert torch.equal(received["model"]["b"], sent["model"]["b"])


def test_joiners_skip_the_join_step_only_when_every_member_has_gradients_to_send():
    # members 0 and 1 come from a commit, 2 is the joiner
    assert join_step_absentees([True, True, True], [False, False, True], []) == ([2], 0)
    # member 0 is behind (it loads the donor's state): member 1's loop states are taken
    assert join_step_absentees([True, True, True], [False, False, True], [0, 2]) == ([2], 1)
    # a member lingering after the last step, or resyncing, sends nothing: no join step
    assert join_step_absentees([False, True, True], [False, False, True], []) == ([], -1)
    # two joiners at once; nobody offering; only joiners
    assert join_step_absentees([True, True, True], [False, True, True], []) == ([1, 2], 0)
    assert join_step_absentees([True, True], [False, False], []) == ([], -1)
    assert join_step_absentees([True, True], [True, True], []) == ([], -1)


def _kill(cfg_kills: list[tuple[int, int, str]]) -> list[ReplicaKill]:
    return [ReplicaKill(r, FaultPoint(step, phase)) for step, r, phase in cfg_kills]


def test_join_while_training(etcd, job_id, tmp_path, monkeypatch):
    # The warm-up step, the default on a GPU, asked for here on the CPU.
    monkeypatch.setenv("FTSYSTEM_WARM_UP", "1")  # inherited by the replicas
    cfg = RunConfig(num_replicas=3, num_steps=300, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=_kill([(40, 1, "step")]), train_args=TRAIN_ARGS, show_progress=False)
    assert_invariant(run_job(cfg), cfg)
    r1 = load_results(tmp_path)["r1"]
    catchup = r1["catchup"]
    assert catchup["donors"] in (["r0"], ["r2"]) and catchup["snapshot_step"] >= 40
    assert catchup["bytes"] > 0 and r1["commits"], "r1 did not train after catching up"
    # its first commit was the join step, taken with no gradient while the members committed
    # theirs (its loader took their states of that step: the invariant above holds)
    assert r1["commits"][0][0] == catchup["join_step"] > catchup["snapshot_step"]
    # and every replica divided that step's sum by the two members that sent gradients
    for r in load_results(tmp_path).values():
        assert [catchup["join_step"], 2, 3] in r["partial_sums"], r["partial_sums"]
    # with the warm-up, it computed one step of its loop before catching up and
    # dropped it: the batch it drew and its dropout did not leave it off the members' state
    # (checked above); a join without it is the test of a log that cannot cover a transfer
    assert catchup["warm_up_s"] > 0
    # and its snapshot arrived during that step, in tensors of its own, loaded after it
    assert catchup["prefetched"]
    # the members let it in with a log-based sync, not a full-state transfer
    join = [e for e in load_results(tmp_path)["r0"]["epochs"] if e["reason"] == "join"]
    assert join, "no join epoch"


def test_a_join_step_that_failed_on_the_joiner_alone_is_taken_again_with_zeros(
        etcd, job_id, tmp_path):
    # r1 restarts after step 30; its join step's all-reduce fails on it alone while the members
    # commit that step. In the next epoch the members sum the following step, divided by the
    # members that send gradients: r1, one step behind, replays the step it missed and must
    # send zeros in that sum (its gradients would be divided as if it sent none).
    cfg = RunConfig(num_replicas=3, num_steps=150, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=_kill([(30, 1, "step"), (31, 1, "fail-join-step")]),
                    train_args=TRAIN_ARGS, show_progress=False)
    assert_invariant(run_job(cfg), cfg)
    assert "injected fail-join-step failure" in (tmp_path / "agent-r1.log").read_text()
    r1 = load_results(tmp_path)["r1"]
    assert all(not r["divergences"] for r in load_results(tmp_path).values())
    # the first step it committed was a join step, taken after the failed one
    assert r1["commits"][0][0] == r1["catchup"]["join_step"]


def test_catch_up_ends_when_the_log_cannot_cover_a_snapshots_transfer(
        etcd, job_id, tmp_path, monkeypatch):
    # A link too slow for the donor's log window: the donor keeps about one step, and the
    # joiner pauses a second after each snapshot. Every log request after a snapshot is
    # answered 410. After FTSYSTEM_CATCHUP_TRIES snapshots the joiner joins as it is, and the
    # epoch's state sync brings it up to date. The joiner runs without the warm-up step, the
    # default on a CPU (a cold join: it asks for its first snapshot before it computes
    # anything).
    monkeypatch.setenv("FTSYSTEM_CATCHUP_PAUSE_S", "1")
    monkeypatch.setenv("FTSYSTEM_CATCHUP_TRIES", "2")
    monkeypatch.setenv("FTSYSTEM_CATCHUP_LOG_BYTES", str(_budget_for_one_step()))
    cfg = RunConfig(num_replicas=2, num_steps=200, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=_kill([(30, 1, "step")]), train_args=TRAIN_ARGS, show_progress=False)
    assert_invariant(run_job(cfg), cfg)
    catchup = load_results(tmp_path)["r1"]["catchup"]
    assert catchup["gave_up_after_snapshots"] == 2, catchup
    assert len(catchup["donors"]) == 3  # two snapshots, then the log that had moved on
    assert "warm_up_s" not in catchup and not catchup.get("prefetched"), catchup


def _budget_for_one_step() -> int:
    """About one update log entry of the example model: its flat buffer (0.4 MB) and its loop
    states (a few KiB); the budget of 1.5 of them keeps one entry, never two."""
    return 6 * num_params(TinyGPT(ModelConfig()))


def test_reconciles_a_step_committed_by_some_members_only(etcd, job_id, tmp_path):
    cfg = RunConfig(num_replicas=3, num_steps=150, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=_kill([(50, 2, "fail-allreduce")]), train_args=TRAIN_ARGS,
                    show_progress=False)
    summary = run_job(cfg)
    assert_invariant(summary, cfg)
    assert summary["failures"] == []  # nobody restarted: reconciled in place
    results = load_results(tmp_path)
    for rid in ("r0", "r1", "r2"):
        assert any(e["reason"] == "resync" for e in results[rid]["epochs"])
    # r2 did not commit step 51 itself: it replayed the update of a member that did (r2's
    # abort may also fail the end of a peer's all-reduce; that peer then replays too).
    assert 51 not in [s for s, _ in results["r2"]["commits"]]
    assert any(51 in [s for s, _ in results[rid]["commits"]] for rid in ("r0", "r1"))


def _registration(etcd_url: str, job: str, rid: str) -> dict | None:
    async def read():
        async with Store(etcd_url) as store:
            return await store.get_json(keys.replica(job, rid))
    return asyncio.run(read())


def _assignment(etcd_url: str, job: str, rid: str) -> dict | None:
    async def read():
        async with Store(etcd_url) as store:
            return await store.get_json(keys.catchup(job, rid))
    return asyncio.run(read())


def _run_in_thread(cfg: RunConfig) -> tuple[threading.Thread, list[dict]]:
    summaries: list[dict] = []
    runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)))
    runner.start()
    return runner, summaries


def test_donor_killed_mid_transfer(etcd, job_id, tmp_path, monkeypatch):
    monkeypatch.setenv("FTSYSTEM_CATCHUP_PAUSE_S", "3")  # a slow link after the snapshot
    cfg = RunConfig(num_replicas=3, num_steps=400, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=_kill([(40, 1, "step")]), train_args=TRAIN_ARGS, show_progress=False)
    runner, summaries = _run_in_thread(cfg)
    try:
        wait_for(lambda: (r := _registration(etcd.url, job_id, "r1")) and
                       r["state"] == "catching_up" and r, 120, "r1 to catch up")
        donor = wait_for(lambda: (a := _assignment(etcd.url, job_id, "r1")) and a["donor"],
                         30, "a donor for r1")
        time.sleep(1.0)  # r1 holds the donor's snapshot and waits before replaying its log
        os.kill(_registration(etcd.url, job_id, donor)["pid"], signal.SIGKILL)
    finally:
        runner.join(300)
    assert_invariant(summaries[0], cfg)
    donors = load_results(tmp_path)["r1"]["catchup"]["donors"]
    assert donors[0] == donor and donors[-1] not in (donor, "r1"), donors


def test_two_replicas_recover_at_once_from_different_donors(etcd, job_id, tmp_path,
                                                            monkeypatch):
    monkeypatch.setenv("FTSYSTEM_CATCHUP_PAUSE_S", "3")  # keeps both catching up together
    cfg = RunConfig(num_replicas=4, num_steps=400, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=_kill([(40, 1, "step"), (40, 2, "step")]), train_args=TRAIN_ARGS,
                    show_progress=False)
    assert_invariant(run_job(cfg), cfg)
    results = load_results(tmp_path)
    first_donors = {results[r]["catchup"]["donors"][0] for r in ("r1", "r2")}
    assert first_donors == {"r0", "r3"}, "donor load was not spread"


def _status(url: str, auth: dict) -> dict | None:
    """A donor's ``/status``; None when the poll's connection failed (one was once reset on a
    loaded machine): the next poll asks again."""
    try:
        return httpx.get(url, headers=auth).json()
    except httpx.TransportError:
        return None


def test_a_dead_joiner_frees_the_donor(etcd, job_id, tmp_path, monkeypatch):
    monkeypatch.setenv("FTSYSTEM_CATCHUP_PAUSE_S", "5")
    monkeypatch.setenv("FTSYSTEM_CATCHUP_IDLE_S", "2")
    cfg = RunConfig(num_replicas=2, num_steps=400, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=_kill([(40, 1, "step")]), train_args=TRAIN_ARGS, show_progress=False)
    runner, summaries = _run_in_thread(cfg)
    try:
        wait_for(lambda: (r := _registration(etcd.url, job_id, "r1")) and
                 r["state"] == "catching_up", 120, "r1 to catch up")
        status_url = f"http://{_registration(etcd.url, job_id, 'r0')['state_addr']}/status"
        # /status answers any replica's token; the run's token makes the state servers' key
        auth = Credentials.of("r9", state_key((tmp_path / "api-token").read_text())).headers()
        # bytes served only grow: a snapshot served and already freed (the joiner pauses past
        # the idle limit) still counts, where a poll of the snapshot itself could miss it
        wait_for(lambda: (s := _status(status_url, auth)) and s["bytes_served"] > 0, 60,
                 "r0 to serve a snapshot")
        os.kill(_registration(etcd.url, job_id, "r1")["pid"], signal.SIGKILL)
        freed = wait_for(lambda: (s := _status(status_url, auth)) and s["snapshot_step"] == -1
                         and not s["session_active"] and s, 30, "r0 to free its snapshot")
    finally:
        runner.join(300)
    # it keeps only the last few updates (for step reconciliation), not the session's log
    # an entry: the averaged gradient, and the data loader's state after it (its shuffle's
    # generator is 5 KB)
    entry_bytes = 4 * num_params(TinyGPT(ModelConfig())) + 16 * 1024
    assert 0 < freed["log_bytes"] <= KEEP_MIN_ENTRIES * entry_bytes
    assert_invariant(summaries[0], cfg)
