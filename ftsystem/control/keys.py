"""The etcd keyspace, in one place (documented in docs/keyspace.md)."""

from __future__ import annotations

import re

ROOT = "/ftsystem"
# Replica and job ids become etcd key segments, process-group prefixes and file names.
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class InvalidIdError(ValueError):
    """A job or replica id that cannot be used as a key segment."""


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):  # "$" allows a "\n"
        raise InvalidIdError(
            f"invalid {kind} id {value!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")
    return value


def job(job_id: str) -> str:
    return f"{ROOT}/{check_id('job', job_id)}"


def spec(job_id: str) -> str:
    """Job spec: replicas, min_replicas, num_steps (written by whoever launches the job)."""
    return f"{job(job_id)}/spec"


def leader(job_id: str) -> str:
    """Leader election key, bound to the leading controller's lease."""
    return f"{job(job_id)}/controller/leader"


def epoch(job_id: str) -> str:
    """The current membership epoch; written only by the leader, in a transaction."""
    return f"{job(job_id)}/epoch"


def controllers(job_id: str) -> str:
    """Prefix of controller instances (address for discovery), each on its own lease."""
    return f"{job(job_id)}/controllers/"


def controller(job_id: str, instance_id: str) -> str:
    return controllers(job_id) + check_id("controller instance", instance_id)


def replicas(job_id: str) -> str:
    """Prefix of replica registrations, each bound to its replica's lease."""
    return f"{job(job_id)}/replicas/"


def replica(job_id: str, replica_id: str) -> str:
    return replicas(job_id) + check_id("replica", replica_id)


def agents(job_id: str) -> str:
    """Prefix of node agent records, ``agents/<replica>/<node rank>``, each bound to its agent's
    lease: alive while the agent runs. Holding the record is holding the node rank (the
    rendezvous slot); a spare's record is ``agents/<replica>/spare-<uid>``."""
    return f"{job(job_id)}/agents/"


def replica_agents(job_id: str, replica_id: str) -> str:
    return f"{agents(job_id)}{check_id('replica', replica_id)}/"


def agent(job_id: str, replica_id: str, node_rank: int) -> str:
    return f"{replica_agents(job_id, replica_id)}{node_rank:05d}"


def spare_agent(job_id: str, replica_id: str, uid: str) -> str:
    return f"{replica_agents(job_id, replica_id)}spare-{check_id('agent', uid)}"


def agent_replica(job_id: str, key: str) -> str:
    """The replica of an agent record's key."""
    return key[len(agents(job_id)):].split("/", 1)[0]


def layout(job_id: str, replica_id: str) -> str:
    """A replica's shape, ``{nodes, nproc_per_node}``, written by its first agent (no lease):
    an agent started with another shape is refused."""
    return f"{job(job_id)}/layouts/{check_id('replica', replica_id)}"


def generations(job_id: str) -> str:
    """Prefix of the replicas' current generations."""
    return f"{job(job_id)}/generations/"


def generation(job_id: str, replica_id: str) -> str:
    """The replica's current generation (no lease): which agent holds each node rank, the
    replica lease, where rank 0 listens, and whether it still runs. Written in transactions
    by the replica's agents: node rank 0 opens a generation, any node ends it."""
    return f"{generations(job_id)}{check_id('replica', replica_id)}"


def metrics_endpoints(job_id: str) -> str:
    """Every rank's metrics endpoint, ``<replica>/<rank>`` -> ``{"addr": "host:port",
    "node_id": its machine}``, on the replica lease: Prometheus discovers all ranks, not only
    the registering rank 0, each with its ``host``."""
    return f"{job(job_id)}/metrics/"


def metrics_endpoint(job_id: str, replica_id: str, rank: int) -> str:
    return f"{metrics_endpoints(job_id)}{check_id('replica', replica_id)}/{rank:05d}"


def catchups(job_id: str) -> str:
    """Prefix of donor assignments for catching-up replicas (leader-owned, leader's lease)."""
    return f"{job(job_id)}/catchup/"


def catchup(job_id: str, replica_id: str) -> str:
    return catchups(job_id) + check_id("replica", replica_id)


def chaos_orders(job_id: str) -> str:
    """Prefix of failure-injection orders (no lease: their outcomes are the record)."""
    return f"{job(job_id)}/chaos/"


def chaos_submissions(job_id: str) -> str:
    """Recent chaos submissions, each on a lease of the rate limit's window
    (``ftsystem.chaos.rate``)."""
    return f"{job(job_id)}/chaos-rate/"


def chaos_submission(job_id: str, submission_id: str) -> str:
    return chaos_submissions(job_id) + submission_id


def chaos(job_id: str, order_id: str) -> str:
    return chaos_orders(job_id) + order_id


def failures(job_id: str) -> str:
    """Prefix of the failure history (no lease: kept after the job for reports)."""
    return f"{job(job_id)}/failures/"


def failure(job_id: str, replica_id: str, generation: int) -> str:
    return f"{failures(job_id)}{check_id('replica', replica_id)}/{generation:06d}"


def divergences(job_id: str) -> str:
    """Prefix of divergence reports (no lease: kept for reports and the REST API)."""
    return f"{job(job_id)}/divergences/"


def divergence(job_id: str, step: int, replica_id: str) -> str:
    return f"{divergences(job_id)}{step:09d}-{check_id('replica', replica_id)}"


def halts(job_id: str) -> str:
    """Prefix of halted replicas (no lease: the reason outlives the process)."""
    return f"{job(job_id)}/halted/"


def finished(job_id: str) -> str:
    """Written (no lease) by the first replica to reach the end of the job: its last step. A
    replica restarted after every holder of the final state has left must not train again."""
    return f"{job(job_id)}/finished"


def halted(job_id: str, replica_id: str) -> str:
    """Set by a replica that hit an error a restart cannot fix: its agent stops restarting it."""
    return f"{halts(job_id)}{check_id('replica', replica_id)}"


def last_segment(key: str) -> str:
    return key.rstrip("/").rsplit("/", 1)[-1]


# --- HALoS real mode (ftsystem/halos/): its own subtree, no FT-HSDP key is reused ---

def halos(job_id: str) -> str:
    """Prefix of everything a HALoS job in real mode keeps in etcd."""
    return f"{job(job_id)}/halos/"


def halos_config(job_id: str) -> str:
    """The run's configuration (``RealConfig``), written by the launcher before any process."""
    return halos(job_id) + "config"


def halos_nodes(job_id: str) -> str:
    """Prefix of the registrations of the GPS, the LPSs and the workers, each bound to the
    lease of the agent that runs it: a dead process's registration disappears with it."""
    return halos(job_id) + "nodes/"


def halos_node(job_id: str, name: str) -> str:
    return halos_nodes(job_id) + check_id("halos node", name)


def halos_stats(job_id: str) -> str:
    """Prefix of each node's cumulative counters (no lease: they outlive the process, so a
    restarted node continues them and the launcher reads them after the run)."""
    return halos(job_id) + "stats/"


def halos_stat(job_id: str, name: str) -> str:
    return halos_stats(job_id) + check_id("halos node", name)


def halos_start(job_id: str) -> str:
    """Written once by the launcher when every node has registered: the workers start then,
    all at once, and the run's clock starts (its time-to-loss is measured from it)."""
    return halos(job_id) + "start"


def halos_done(job_id: str) -> str:
    """Written once by the GPS when the global-update budget is spent: every node then exits."""
    return halos(job_id) + "done"
