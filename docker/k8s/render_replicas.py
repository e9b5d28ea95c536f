"""Print the agents' manifest: one Indexed Job per replica, one pod per node of the replica.

    python docker/k8s/render_replicas.py > docker/k8s/agents.yaml    # 2 x 2 nodes x 8 GPUs
    python docker/k8s/render_replicas.py --replicas 4 --nodes 4 > docker/k8s/agents.yaml

Why one Job per replica (and not a JobSet, nor one Job for all): a Job's failure handling acts
on that Job alone, so a replica that runs out of retries fails by itself while the others train
on; see docker/README.md. Only PyYAML is needed (a dependency of ftsystem).
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import yaml

LABELS = {"app.kubernetes.io/name": "ftsystem", "app.kubernetes.io/component": "agent"}
REPLICA_LABEL = "ftsystem/replica"
# `ftsystem agent`'s exit statuses (agent/supervisor.py, EXIT_*; docs/nodes.md), restated here
# so that rendering needs PyYAML alone; tests/test_deploy.py checks that they agree.
HALTED_EXIT = 3
"""The job halted on an error no restart fixes (a divergence without a majority)."""
MISSED_THE_END_EXIT = 4
"""The job finished without this replica, and no replica holding the final state is left."""
JOB_DELETED_EXIT = 5
"""The job's spec was deleted while the agent ran (`ftsystem job delete --force`)."""
STOPPED_EXITS = (130, 143)
"""Stopped by SIGINT (128 + 2) or SIGTERM (128 + 15: a deleted pod, the kubelet stopping it)."""
METRICS_PORT = 9400
"""The agent's metrics port (FTSYSTEM_METRICS_PORT); the rank of local rank k serves on
9401 + k. Fixed, for the probes; Prometheus still finds every one through the controller."""
RESULTS_CLAIM = "ftsystem-results"
"""The PersistentVolumeClaim (results.yaml) every agent mounts at /data: the results outlive
the pods, and the replica that finished before a pod was replaced keeps its JSON."""
TERMINATION_GRACE_S = 30
"""Longer than an agent takes to exit once told to stop: its ranks' grace (10 s) plus its etcd
work on the way out (STOP_ETCD_S, 5 s; agent/supervisor.py). Past it the kubelet SIGKILLs the
agent, and the exit status (143, ignored) becomes 137, which counts against the retries."""
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
TOKEN_SECRET = "ftsystem-api-token"
"""The job's token (docker/README.md), mounted as in the controllers' pods."""
TOKEN_DIR = "/var/run/secrets/ftsystem"


def train_command(index: int) -> list[str]:
    """The replica's program: replica r<i> reads data shard i (each rank of it a part)."""
    return ["python", "-m", "ftsystem.example.train", "--steps", "3000", "--data-shard", str(index),
            "--sleep-per-step", "0.05", "--out", "/data/results"]


HEADER = """\
# GENERATED: to change it, edit docker/k8s/render_replicas.py or its options, then run
#   python docker/k8s/render_replicas.py{options} > docker/k8s/agents.yaml
# {replicas} replica(s) x {nodes} node(s) x {nproc} GPU(s): one Indexed Job per replica
# (ftsystem-r<i>); completion index k is the node rank of its pod in the replica. A replica
# restarts alone: the other Jobs never see its failures. Evictions and preemptions
# (DisruptionTarget) and a stopped agent (exit {stopped}: SIGINT, SIGTERM) do not use up a
# node's retries. Exits no retry can change fail the Job at once: {halted} (the job halted),
# {missed} (it finished without this replica), {deleted} (it was deleted). A node rank that
# fails more than backoffLimitPerIndex times fails its replica's Job.
"""


class Shape(NamedTuple):
    """What every replica's pods look like."""

    nodes: int
    nproc_per_node: int
    shm_gi: int
    memory_gi: int


def replica_job(index: int, shape: Shape) -> dict:
    replica = f"r{index}"
    labels = LABELS | {REPLICA_LABEL: replica}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"ftsystem-{replica}", "labels": labels},
        "spec": {
            # Pod k (JOB_COMPLETION_INDEX) is node rank k; all N run at once, as the replica
            # trains only with all of its nodes.
            "completionMode": "Indexed",
            "completions": shape.nodes,
            "parallelism": shape.nodes,
            # Retries per node rank; one rank out of retries (maxFailedIndexes: 0) fails the
            # whole Job, whose other pods would otherwise wait for that rank forever.
            "backoffLimitPerIndex": 3,
            "maxFailedIndexes": 0,
            # A replacement starts only once the lost pod has terminated, so two agents never
            # hold one node rank (and it is the only value podFailurePolicy allows).
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {"rules": failure_rules()},
            "template": {"metadata": {"labels": labels},
                         "spec": pod_spec(index, shape)},
        },
    }


FAIL_JOB_EXITS = (
    # The job halted (a divergence): every retry would halt again.
    HALTED_EXIT,
    # The job finished without this replica: a new pod finds the same and exits 4 again. Ignored,
    # it would be replaced forever; counted, it would use up its retries and fail anyway, later.
    # The other replicas' Jobs have completed; this one fails now and frees its nodes.
    MISSED_THE_END_EXIT,
    # The job was deleted: there is no job to restart the replica into. A new pod would find no
    # spec and start the replica alone, or in whatever job is created next under the same id.
    JOB_DELETED_EXIT,
)
"""The agent's exits after which no retry can succeed. Not 2 (refused): a replacement pod is
refused while the lost pod's agent still holds its node rank, until that lease expires."""


def failure_rules() -> list[dict]:
    """Evaluated in order, the first match wins; an exit 0 completes the index as usual."""
    return [
        # Eviction, preemption, node drain or shutdown: the node went, not the training.
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "agent", "operator": "In",
                                              "values": list(FAIL_JOB_EXITS)}},
        # Stopped (a deleted pod, the kubelet ending it): someone stopped it, the training did
        # not fail.
        {"action": "Ignore", "onExitCodes": {"containerName": "agent", "operator": "In",
                                             "values": list(STOPPED_EXITS)}},
    ]


def pod_spec(index: int, shape: Shape) -> dict:
    return {
        # Required by podFailurePolicy, and the agent restarts its ranks itself anyway.
        "restartPolicy": "Never",
        # The pod's pause process becomes PID 1 and reaps what the ranks orphan (DataLoader
        # workers, compilers' helpers), which the agent, as PID 1, would leave as zombies; and
        # the agent no longer is PID 1, whose signals without a handler the kernel drops (a
        # SIGTERM before it installs its own would wait out the grace period). Chosen over tini
        # in the image: the image stays the same for Slurm and Compose (`init: true` there).
        "shareProcessNamespace": True,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        # fsGroup: the results volume is writable by the unprivileged user.
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                            "fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch"},
        "affinity": one_agent_per_node(),
        # GPU nodes are commonly tainted so that only GPU pods land there.
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [agent_container(index, shape)],
        "volumes": [
            # Results (one JSON per replica, written by its rank 0) on a claim every pod mounts.
            {"name": "results", "persistentVolumeClaim": {"claimName": RESULTS_CLAIM}},
            # NCCL's intra-node transport and DataLoader workers use /dev/shm; the container
            # runtime's default is 64 MiB.
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shape.shm_gi}Gi"}},
            # The job's token, the controllers' Secret: the agent hands it to its ranks, whose
            # state servers require it; a pod without it does not start.
            {"name": "api-token", "secret": {"secretName": TOKEN_SECRET}},
        ],
    }


def one_agent_per_node() -> dict:
    """The agent's --node-id is the Kubernetes node's name: two agents on one node would claim
    the same node id (and share its GPUs)."""
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": LABELS}}]}}


def agent_container(index: int, shape: Shape) -> dict:
    gpus = str(shape.nproc_per_node)
    # A memory-backed emptyDir is charged to the container's memory: the limit covers both.
    memory = {"memory": f"{shape.memory_gi + shape.shm_gi}Gi"}
    return {
        "name": "agent",
        "image": "ftsystem-agent:dev",
        "imagePullPolicy": "IfNotPresent",
        "args": ["--etcd", "$(ETCD_ENDPOINTS)", "--job", "$(JOB_ID)",
                 "--replica-id", f"r{index}", "--node-rank", "$(JOB_COMPLETION_INDEX)",
                 "--nodes", str(shape.nodes), "--nproc-per-node", gpus,
                 "--host", "$(POD_IP)", "--node-id", "$(NODE_NAME)",
                 "--", *train_command(index)],
        "env": agent_env(),
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
        # /metrics is served by a thread of the agent from its start, before etcd is reached:
        # it says that the process runs, not that the replica trains (the agent restarts it).
        # A liveness failure stops the agent with SIGTERM: exit 143, ignored, a new pod.
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                           "periodSeconds": 10, "timeoutSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                          "periodSeconds": 20, "timeoutSeconds": 5, "failureThreshold": 6},
        # Extended resources are requested through limits (the request equals the limit).
        "resources": {"requests": {"cpu": str(2 * shape.nproc_per_node),
                                   "memory": f"{shape.memory_gi}Gi"},
                      "limits": memory | {"nvidia.com/gpu": gpus}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "results", "mountPath": "/data"},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "api-token", "mountPath": TOKEN_DIR, "readOnly": True}],
    }


def agent_env() -> list[dict]:
    def field(name: str, path: str) -> dict:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    def config(name: str) -> dict:
        return {"name": name, "valueFrom": {"configMapKeyRef": {"name": "ftsystem-job",
                                                                "key": name}}}
    # The Job controller injects JOB_COMPLETION_INDEX too; declared here, the $(...) expansion
    # of the args does not depend on that. --host must be reachable from the replica's other
    # nodes (the pod IP), --node-id names the machine.
    return [field("JOB_COMPLETION_INDEX", INDEX_ANNOTATION), field("POD_IP", "status.podIP"),
            field("NODE_NAME", "spec.nodeName"), config("JOB_ID"), config("ETCD_ENDPOINTS"),
            {"name": "FTSYSTEM_API_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"},
            {"name": "FTSYSTEM_METRICS_PORT", "value": str(METRICS_PORT)}]


DEFAULTS = {"replicas": 2, "nodes": 2, "nproc_per_node": 8, "shm_gi": 16, "memory_gi": 64}


def render(**options: int) -> str:
    """The manifest for these options (the others at DEFAULTS), header included."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    o = DEFAULTS | options
    shape = Shape(o["nodes"], o["nproc_per_node"], o["shm_gi"], o["memory_gi"])
    jobs = [replica_job(i, shape) for i in range(o["replicas"])]
    changed = "".join(f" --{k.replace('_', '-')} {v}" for k, v in o.items() if v != DEFAULTS[k])
    header = HEADER.format(options=changed, replicas=o["replicas"], nodes=o["nodes"],
                           nproc=o["nproc_per_node"],
                           stopped=", ".join(map(str, STOPPED_EXITS)),
                           halted=HALTED_EXIT, missed=MISSED_THE_END_EXIT,
                           deleted=JOB_DELETED_EXIT)
    return header + yaml.dump_all(jobs, Dumper=_Dumper, sort_keys=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of plain values (args, exit codes) on one line as in the
    hand-written manifests; no anchors (&id001) for the labels shared by Job and pod."""

    def ignore_aliases(self, data) -> bool:
        return True

    def represent_list(self, data: list) -> yaml.Node:
        flow = all(isinstance(item, (str, int)) for item in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _Dumper.represent_list)


def parse_args(argv: list[str]) -> dict[str, int]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=positive, default=DEFAULTS["replicas"],
                   help="data-parallel replicas: one Job each (r0, r1, ...)")
    p.add_argument("--nodes", type=positive, default=DEFAULTS["nodes"],
                   help="nodes per replica: one pod each")
    p.add_argument("--nproc-per-node", type=positive, default=DEFAULTS["nproc_per_node"],
                   help="ranks per node, one GPU each (nvidia.com/gpu)")
    p.add_argument("--shm-gi", type=positive, default=DEFAULTS["shm_gi"],
                   help="size of /dev/shm (GiB, memory-backed)")
    p.add_argument("--memory-gi", type=positive, default=DEFAULTS["memory_gi"],
                   help="memory per pod besides /dev/shm (GiB)")
    return vars(p.parse_args(argv))


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


if __name__ == "__main__":
    sys.stdout.write(render(**parse_args(sys.argv[1:])))
