"""docker/slurm/ftsystem.sbatch on a real Slurm cluster (``tests/slurm_cluster.py``: slurmctld
and six slurmd, each node a network namespace of its own), submitted with sbatch as users do,
training ``ftsystem.example.train`` on every node.

What a user of the script relies on: replicas of one and of two nodes (FSDP2 across the nodes)
train to one state; a dead compute node costs its replica only, and a spare takes its place; a
replica lost for good makes the job fail; a dead batch node cancels the job; a stop (scancel,
the time limit) stops the agents (a waiting spare too), then the controller, then etcd; etcd and
the controller listen on the batch node's address only; nothing is left in the nodes' temp
directory but what a killed node could not remove.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import wait_for
from ftsystem.launch.netns import namespace_pids
from slurm_cluster import KILL_WAIT_S, SlurmCluster

pytestmark = [pytest.mark.slurm_cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "docker" / "slurm" / "ftsystem.sbatch"
TIMEOUT_S = 12
"""The job's one timeout (ftsystem.sbatch's TIMEOUT): a dead node is noticed within a third."""
JOB_S = 180.0
"""Generous bound on one job: CI's two cores run six nodes' daemons, agents and ranks."""
ETCD_PORT, CONTROLLER_PORT = 2379, 8080
"""ftsystem.sbatch's defaults: each batch node is a host of its own."""


@dataclass
class Job:
    cluster: SlurmCluster
    id: int
    out: Path
    """OUT_DIR: the job's output, logs and results."""
    tmp: Path
    """The nodes' TMPDIR."""

    @property
    def name(self) -> str:
        return f"slurm-{self.id}"  # ftsystem.sbatch's JOB_ID

    def output(self) -> str:
        path = self.out / f"slurm-{self.id}.out"
        return path.read_text() if path.exists() else ""

    def results(self) -> dict[str, dict]:
        return {p.stem: json.loads(p.read_text()) for p in (self.out / "results").glob("r*.json")}

    def batch_node(self) -> str:
        return wait_for(lambda: self.cluster.job(self.id).get("BatchHost", "").strip("()")
                        or None, JOB_S, f"job {self.id} to start")

    def api(self) -> str:
        return f"http://{self.cluster.host(self.batch_node()).address}:{CONTROLLER_PORT}"

    def view(self) -> dict | None:
        """The controller's view of the job (GET /v1/jobs/<job>, with the token the script
        made), None while it does not answer."""
        token = self.out / "api-token"
        if not token.exists():
            return None
        try:
            reply = httpx.get(f"{self.api()}/v1/jobs/{self.name}", timeout=2,
                              headers={"Authorization": f"Bearer {token.read_text().strip()}"})
        except httpx.HTTPError:
            return None
        return reply.json() if reply.status_code == 200 else None

    def wait_training(self, replicas: list[str]) -> None:
        """Until ``replicas`` all train in one epoch."""
        def training() -> bool:
            view = self.view()
            return bool(view) and set(replicas) <= set(view["epoch"]["members"]) and all(
                r["state"] == "member" for r in view["replicas"] if r["id"] in replicas)
        try:
            wait_for(training, JOB_S, f"{', '.join(replicas)} to train", poll=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.output()}") from None

    def wait(self) -> dict[str, str]:
        try:
            return self.cluster.wait_job(self.id, JOB_S)
        except (TimeoutError, RuntimeError) as e:
            raise AssertionError(f"{e}\n{self.output()}") from e

    def left_in_tmp(self) -> list[str]:
        """What the job left in the nodes' TMPDIR, each name without its random part
        (``ftsystem-agent-r1``, ``ftsystem-etcd-<job id>``), but torch's compile cache (kept
        across runs on purpose)."""
        return sorted(re.sub(r"[-.][^-.]+$", "", p.name) for p in self.tmp.iterdir()
                      if not p.name.startswith("torchinductor_"))

    def stop_records(self) -> list[tuple[str, str]]:
        """What ftsystem.sbatch records as it stops things, in order."""
        return re.findall(r"ftsystem\.sbatch: [\d:.]+ (.+) exited \((\d+)\)", self.output())


def submit(cluster: SlurmCluster, tmp_path: Path, *, nodes: int, steps: int,
           nodes_per_replica: int = 1, spares: int = 0, train: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> Job:
    """ftsystem.sbatch submitted from the repository root, as its header says, with the
    example training of ``steps`` steps as the replicas' program."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()  # for the job's output file, which Slurm opens before the script runs
    tmp.mkdir()
    # The user's environment, which sbatch passes on: this Python's venv, no job token (the
    # script makes one) and nothing of an enclosing Slurm job.
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "FTSYSTEM_API_TOKEN"))} | {
        "NODES_PER_REPLICA": str(nodes_per_replica), "SPARES_PER_REPLICA": str(spares),
        "TIMEOUT": str(TIMEOUT_S), "OUT_DIR": str(out), "VENV": sys.prefix,
        "TMPDIR": str(tmp)} | (env or {})
    program = ("python", "-m", "ftsystem.example.train", "--steps", str(steps),
               "--data-shard", "{replica}", "--out", str(out / "results"), *train)
    job_id = cluster.sbatch(f"--nodes={nodes}", "--gpus-per-node=1", "--time=10",
                            f"--output={out}/slurm-%j.out", str(SBATCH), *program,
                            env=environment, cwd=REPO)
    return Job(cluster, job_id, out, tmp)


def listening(cluster: SlurmCluster, node: str) -> dict[int, set[str]]:
    """The TCP ports listened on in ``node``'s namespace, each with its local addresses."""
    out = subprocess.run(["nsenter", f"--net=/run/netns/{cluster.host(node).name}",
                          "ss", "--listening", "--tcp", "--numeric", "--no-header"],
                         capture_output=True, text=True, check=True).stdout
    ports: dict[int, set[str]] = {}
    for line in out.splitlines():
        address, port = line.split()[3].rsplit(":", 1)
        ports.setdefault(int(port), set()).add(address)
    return ports


def assert_same_state(job: Job, replicas: list[str], steps: int, shards: int) -> dict:
    results = job.results()
    assert sorted(results) == replicas, job.output()
    assert {r["step"] for r in results.values()} == {steps}
    assert len({r["state_hash"] for r in results.values()}) == 1, results
    assert all(len(set(r["shard_hashes"])) == shards for r in results.values()), results
    return results


def test_replicas_of_two_nodes_train_to_one_state_a_spare_taking_a_dead_nodes_place(
        slurm_cluster, tmp_path):
    """2 replicas x (2 nodes + 1 spare), FSDP2 across each replica's nodes. While they train,
    etcd and the controller listen on the batch node's address only; then a node of r1 dies as
    a host dies. Its spare takes the node rank, r1 restarts and catches up, and both replicas
    end with one state (two shards each); the job succeeds."""
    job = submit(slurm_cluster, tmp_path, nodes=6, nodes_per_replica=2, spares=1, steps=30,
                 train=("--sleep-per-step", "0.2"))
    job.wait_training(["r0", "r1"])
    batch = job.batch_node()
    ports = listening(slurm_cluster, batch)
    address = slurm_cluster.host(batch).address
    assert ports[ETCD_PORT] == {address} and ports[CONTROLLER_PORT] == {address}, ports
    slurm_cluster.kill_node("n5")  # SLURM_NODEID 4: r1's node rank 1 (n6 is r1's spare)

    ended = job.wait()
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    results = assert_same_state(job, ["r0", "r1"], 30, shards=2)
    assert results["r1"]["generation"] >= 1, results["r1"]
    assert re.search(r"^5: .*spare takes node rank 1$", job.output(), re.M), job.output()
    assert f"job {job.name}: every replica finished" in job.output()  # read through the API
    assert [what for what, _ in job.stop_records()] == ["the agents", "the controller", "etcd"]
    # Only what the dead host's agent could not remove (a host's own disk, in a real cluster).
    assert job.left_in_tmp() == ["ftsystem-agent-r1"]


def test_a_replica_lost_for_good_fails_the_job(slurm_cluster, tmp_path):
    """3 replicas x 1 node, no spare: r2's node dies. r0 and r1 train to the end with one
    state, and the job's exit status says that r2 did not finish (srun alone exits 0)."""
    job = submit(slurm_cluster, tmp_path, nodes=3, steps=30,
                 train=("--sleep-per-step", "0.2", "--linger", "2"))
    job.wait_training(["r0", "r1", "r2"])
    slurm_cluster.kill_node("n3")

    ended = job.wait()
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "4:0"), job.output()
    assert "not every replica finished: replica r2 did not finish" in job.output()
    assert_same_state(job, ["r0", "r1"], 30, shards=1)
    assert job.left_in_tmp() == ["ftsystem-agent-r2"]  # the dead host's


def test_a_dead_batch_node_cancels_the_job(slurm_cluster, tmp_path):
    """Slurm keeps a --no-kill job whose batch node died running, without its batch script;
    the other nodes notice that its etcd is silent and cancel the job, saying why."""
    job = submit(slurm_cluster, tmp_path, nodes=2, steps=1000,
                 train=("--sleep-per-step", "0.1"), env={"BATCH_NODE_TIMEOUT": "6"})
    job.wait_training(["r0", "r1"])
    assert job.batch_node() == "n1"
    slurm_cluster.kill_node("n1")

    ended = job.wait()
    assert ended["JobState"] == "CANCELLED", ended
    assert "ftsystem: batch node n1 lost" in ended.get("Comment", ""), ended
    assert "batch node n1 lost" in (job.out / "cancelled").read_text()
    # Nothing of the job is left on the surviving node: only its slurmd.
    survivor = slurm_cluster.host("n2").name
    wait_for(lambda: namespace_pids(survivor) == [slurm_cluster.daemons["n2"].pid],
             KILL_WAIT_S + 30, "the job's processes on n2 to end")
    # r1's agent on n2 removed its work directory; the dead batch node's etcd data and r0's
    # agent directory stay, as they would on its own disk.
    assert job.left_in_tmp() == ["ftsystem-agent-r0", f"ftsystem-etcd-{job.id}"]


def test_scancel_stops_the_agents_then_the_controller_then_etcd(slurm_cluster, tmp_path):
    """1 replica x (1 node + 1 spare): the spare, waiting for a node rank, stops as promptly
    as the training agent (Slurm would SIGKILL it after KillWait, and srun report 137)."""
    job = submit(slurm_cluster, tmp_path, nodes=2, spares=1, steps=1000,
                 train=("--sleep-per-step", "0.1"))
    job.wait_training(["r0"])
    wait_for(lambda: re.search(r"^1: .*waiting for a node rank to fall free", job.output(),
                               re.M), JOB_S, "the spare to wait")
    slurm_cluster.run("scancel", "--batch", "--signal=TERM", str(job.id))

    ended = job.wait()
    assert_stopped_in_order(job, ended)
    assert re.search(r"^1: .*told to stop before holding a node rank", job.output(), re.M), \
        job.output()


def test_the_time_limit_stops_the_agents_then_the_controller_then_etcd(slurm_cluster,
                                                                        tmp_path):
    """The script's own #SBATCH --signal=B:TERM@120: once the limit is that near, SIGTERM to
    the batch script alone, which stops the job in order before Slurm kills it."""
    job = submit(slurm_cluster, tmp_path, nodes=2, steps=1000,
                 train=("--sleep-per-step", "0.1"))
    job.wait_training(["r0", "r1"])
    # Two minutes from the start: the signal is due at once (slurmctld looks every 30 s).
    slurm_cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=2")

    ended = job.wait()
    assert_stopped_in_order(job, ended)


def assert_stopped_in_order(job: Job, ended: dict[str, str]) -> None:
    assert ended["ExitCode"] == "143:0", (ended, job.output())
    assert "SIGTERM: stopping the agents, then the controller, then etcd" in job.output()
    # Each is sent SIGTERM once the one before it has exited.
    assert job.stop_records() == [("the agents", "143"), ("the controller", "143"),
                                  ("etcd", "143")], job.output()
    # The agents left through etcd: none had to skip its etcd work on the way out.
    assert "skipped" not in job.output(), job.output()
    assert job.left_in_tmp() == []
