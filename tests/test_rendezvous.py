"""The pure parts of a replica's node agents: shape checks, the ranks' environment, what the
pulses conclude, and host chaos orders."""

from __future__ import annotations

import pytest

from agent.pulse import DONE, ENDED, PeerView
from agent.rendezvous import (Generation, Layout, RendezvousError, check_layout,
                              check_node_rank, check_replica, rank_env, replica_env)
from ftsystem.chaos.spec import ChaosSpecError, expand, spec_from_mapping

GEN = Generation(number=4, lease=7, master_addr="10.0.0.2", master_port=29500,
                 agents=("a", "b", "c"))


def test_every_rank_gets_torchruns_environment_for_the_whole_replica():
    layout = Layout(nodes=3, nproc_per_node=4)
    envs = [rank_env(layout, node, local, GEN, max_restarts=20, run_id="job-r1")
            for node in range(3) for local in range(4)]
    assert [int(e["RANK"]) for e in envs] == list(range(12))
    assert {e["WORLD_SIZE"] for e in envs} == {"12"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["GROUP_RANK"] for e in envs[::4]] == ["0", "1", "2"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.2"}  # node 0's, for every node
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"4"}  # the generation
    assert envs[5]["LOCAL_RANK"] == "1" and envs[5]["RANK"] == "5"


def test_the_replicas_place_in_the_job_uses_ftsystems_and_torchfts_names():
    spec = {"replicas": 3, "replica_ids": ["r0", "r1", "r2"]}
    assert replica_env(spec, "r2") == {"FTSYSTEM_NUM_REPLICAS": "3", "NUM_REPLICA_GROUPS": "3",
                                       "REPLICA_GROUP_ID": "2"}
    assert replica_env(None, "r2") == {}


def test_shapes_that_contradict_the_replica_or_the_job_are_refused():
    mine = Layout(2, 8)
    check_layout(mine, Layout(2, 8), {"nodes_per_replica": 2, "nproc_per_node": 8}, "r0")
    check_layout(mine, None, None, "r0")
    with pytest.raises(RendezvousError, match="runs 4 node"):
        check_layout(mine, Layout(4, 8), None, "r0")
    with pytest.raises(RendezvousError, match="job spec says 2 node"):
        check_layout(mine, None, {"nodes_per_replica": 2, "nproc_per_node": 4}, "r0")
    with pytest.raises(RendezvousError, match="not in this job"):
        check_replica({"replica_ids": ["r0", "r1"]}, "r7")
    check_replica({"replicas": 2}, "anything")  # no list of ids: nothing to check against
    with pytest.raises(RendezvousError, match="outside 0..1"):
        check_node_rank(2, Layout(2, 1))
    check_node_rank(None, Layout(2, 1))  # a spare


def test_generations_round_trip_through_json():
    assert Generation.from_json(GEN.to_json()) == GEN


def test_a_peer_is_dead_after_the_timeout_once_heard_and_after_the_startup_allowance_before():
    view = PeerView(generation=3, peers={"b": 1, "c": 2}, started=100.0)
    assert view.verdict(101.5, timeout_s=1.0, startup_s=5.0) is None  # not heard yet: allowed
    view.hear("b", 3, "run", 101.0)
    view.hear("c", 3, "run", 101.0)
    view.hear("b", 2, "run", 102.5)  # an older generation's pulse proves nothing
    assert view.verdict(101.9, 1.0, 5.0) is None
    assert view.verdict(102.2, 1.0, 5.0).startswith("node 1 silent for 1.2s")
    assert PeerView(3, {"b": 1}, 100.0).verdict(105.1, 1.0, 5.0).startswith("node 1 silent")


def test_a_peer_that_finished_may_fall_silent_and_one_that_ended_ends_us():
    view = PeerView(generation=3, peers={"b": 1}, started=0.0)
    view.hear("b", 3, DONE, 1.0)
    assert view.verdict(60.0, 1.0, 5.0) is None
    view.hear("b", 3, ENDED, 2.0)
    assert view.verdict(2.1, 1.0, 5.0) == "ended by node 1"
    view.hear("stranger", 3, ENDED, 2.0)  # not a peer of this generation: ignored
    assert PeerView(3, {"b": 1}, 0.0).ended_by == ""


def test_host_orders_name_a_node_and_wait_for_their_step():
    spec = spec_from_mapping({"action": "host-kill", "selector": {"replicas": ["r1"]},
                              "after_step": 40, "duration": "2s"})
    [order] = expand(spec, ["r0", "r1"], now=10.0, name="t", nodes_per_replica=4)
    assert order.replica == "r1" and 0 <= order.node < 4 and order.after_step == 40
    assert order.id.endswith(f"-n{order.node}")
    with pytest.raises(ChaosSpecError, match="host-partition needs a positive duration"):
        spec_from_mapping({"action": "host-partition"})
    with pytest.raises(ChaosSpecError, match="after_step must be a whole number"):
        spec_from_mapping({"action": "kill", "after_step": -1})
