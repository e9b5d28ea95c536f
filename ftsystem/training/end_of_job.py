"""The end of the job: which replicas a finished replica stays for, to serve them the final
state (``FTReplica.finish``)."""

from __future__ import annotations

from ftsystem.control import keys
from ftsystem.control.membership import Epoch, Registration, ReplicaState
from ftsystem.control.records import objects_under, well_formed_under

NOT_RESTARTED = ("", "stopped")
"""How a generation ends when its agents do not start another: it still runs (or finished), or
its agents were told to stop."""


def registrations_of(job: str, items: dict[str, bytes]) -> dict[str, Registration]:
    return well_formed_under(items, keys.replicas(job), Registration.from_json)


def replicas_to_serve(job: str, items: dict[str, bytes]) -> set[str]:
    """Pure: the replicas a finished replica stays for (from the job's keys ``items``): each
    one not done that may still come to load the final state from it.

    That is a replica with a node agent, or one whose last generation ended in a failure and
    that did not halt: its agents are restarting it. The second matters for a replica of
    several nodes cut apart: its agents free each other's node ranks, and take their own back
    only at their next node-lease renewal (up to ``NODE_LEASE_RENEW_S`` later), so meanwhile the
    replica has no agent record at all; a finished replica that left then would take the job's
    state with it, and the restarted one would train the job again from step 0."""
    registrations = registrations_of(job, items)
    with_agent = {keys.agent_replica(job, k) for k in items if k.startswith(keys.agents(job))}
    halted = {keys.last_segment(k) for k in items if k.startswith(keys.halts(job))}
    restarting = {rid for rid, record in objects_under(items, keys.generations(job)).items()
                  if record.get("ended", "") not in NOT_RESTARTED}
    return {rid for rid in with_agent | (restarting - halted)
            if rid not in registrations or registrations[rid].state != ReplicaState.DONE}


def needs_donor(me: str, epoch: Epoch, registrations: dict[str, Registration]) -> bool:
    """Pure: whether a finished replica must enter ``epoch``: it is a member, and so is a
    replica that is not done (it comes to load the final state)."""
    return me in epoch.members and any(
        registrations.get(m) is not None and registrations[m].state != ReplicaState.DONE
        for m in epoch.members)
