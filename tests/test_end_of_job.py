"""Who a finished replica stays for: pure logic over the job's etcd keys."""

from __future__ import annotations

import json

from ftsystem.control import keys
from ftsystem.training.hsdp import replicas_to_serve
from ftsystem.control.membership import Registration, ReplicaState

JOB = "j"


def _registration(rid: str, state: ReplicaState) -> tuple[str, bytes]:
    reg = Registration(replica_id=rid, state=state, generation=0, host="h")
    return keys.replica(JOB, rid), reg.to_json().encode()


def _generation(rid: str, ended: str) -> tuple[str, bytes]:
    return keys.generation(JOB, rid), json.dumps({"number": 1, "ended": ended}).encode()


def _agent(rid: str, node_rank: int) -> tuple[str, bytes]:
    return keys.agent(JOB, rid, node_rank), b"{}"


def test_a_replica_whose_agents_freed_each_others_ranks_is_still_served() -> None:
    # r0 finished; r1's nodes were cut apart: each agent freed the other's node rank, neither
    # has taken its own back yet, and its generation ended with the cut link.
    items = dict([_registration("r0", ReplicaState.DONE), _agent("r0", 0), _agent("r0", 1),
                  _generation("r0", ""), _generation("r1", "node 1 silent for 1.0s")])
    assert replicas_to_serve(JOB, items) == {"r1"}


def test_done_halted_stopped_and_finished_replicas_are_not_waited_for() -> None:
    items = dict([_registration("r0", ReplicaState.DONE), _agent("r0", 0),
                  _registration("r1", ReplicaState.DONE), _agent("r1", 0),
                  _generation("r2", "killed by SIGKILL"), (keys.halted(JOB, "r2"), b"{}"),
                  _generation("r3", "stopped"),
                  _generation("r4", "")])  # finished and gone
    assert replicas_to_serve(JOB, items) == set()
    # A replica with an agent but not done yet (starting, catching up) is waited for.
    items.update([_agent("r5", 0), _registration("r6", ReplicaState.CATCHING_UP),
                  _agent("r6", 0)])
    assert replicas_to_serve(JOB, items) == {"r5", "r6"}
