"""The job as the API and the status page show it, built from one read of its etcd keys (pure).

``controller.app`` answers with these views (typed by ``controller.models``) and
``controller.status_page`` renders them, so both show the same thing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from controller import models
from controller.leader import EpochMark, LiveTerm
from ftsystem.control import keys
from ftsystem.control.membership import Epoch, Registration
from ftsystem.control.records import decoder, object_or_none, well_formed, well_formed_under

INTERNAL_EPOCH_FIELDS = ("store_addr",)
"""Left out of the public view: the rendezvous store's address. (The state servers' addresses
live in registrations and catch-up assignments, which the view does not copy.)"""
NUM_FAILURES_SHOWN = 20
NUM_RATE_POINTS = 40
"""Points of the step-rate history over the leader's rate window (3 s each over 2 min)."""


@dataclass(frozen=True, slots=True)
class Progress:
    """What the leading term measured from the replicas' step reports (``LiveEttr``) and the
    epochs it saw."""

    ettr_work: float | None
    ettr_time: float | None
    step_rate: float | None
    """Job steps per second over the last ``window_s``."""
    window_s: float
    measured_s: float | None
    """How long the term has measured (it starts over with each new leader)."""
    rates: tuple[tuple[float, float], ...] = ()
    """(Unix time, steps per second) over the last ``window_s``, oldest first."""
    epochs: tuple[EpochMark, ...] = ()
    """The epochs the term found or published, oldest first."""

    @classmethod
    def of(cls, term: LiveTerm, now: float) -> "Progress | None":
        """The term's measure, or None while this instance does not lead."""
        live = term.ettr
        if live is None:
            return None
        values = live.values(now)
        return cls(ettr_work=values["ettr_work"], ettr_time=values["ettr_time"],
                   step_rate=live.step_rate(now), window_s=live.rate_window_s,
                   measured_s=live.measured_s,
                   rates=tuple(live.rate_series(now, NUM_RATE_POINTS)),
                   epochs=tuple(term.epochs))

    def to_json(self) -> dict[str, Any]:
        return {"ettr_work": self.ettr_work, "ettr_time": self.ettr_time,
                "step_rate": self.step_rate, "window_s": self.window_s,
                "measured_s": self.measured_s,
                "rates": [{"time": t, "steps_per_s": rate} for t, rate in self.rates],
                "epochs": [dataclasses.asdict(mark) for mark in self.epochs]}


@dataclass(frozen=True, slots=True)
class AgentRecord:
    """What the view reads of an agent's record (``agents/<rid>/<node>``)."""

    host: str = ""
    generation: int | None = None


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """What the view reads of a failure record (``failures/<rid>/<generation>``)."""

    time: float = 0.0
    step: int | None = None
    reason: str | None = None


_agent_record = decoder("agent record", AgentRecord)
_failure_record = decoder("failure record", FailureRecord)
_spec_record = decoder("job spec", models.JobSpec)


def _one(items: dict[str, bytes], key: str, decode: Any) -> Any:
    return well_formed({key: items[key]}, decode).get(key) if key in items else None


def build_job_view(job: str, items: dict[str, bytes]) -> dict[str, Any]:
    """The job as its users see it: spec, epoch, and every replica an agent supervises.
    A malformed record is left out (and reported: ``ftsystem.control.records``)."""
    registrations = well_formed_under(items, keys.replicas(job), Registration.from_json)
    agents: dict[str, AgentRecord] = {}  # per replica, the record of its lowest node rank
    for path, record in sorted(well_formed_under(items, keys.agents(job), _agent_record).items(),
                               reverse=True):
        agents[path.split("/", 1)[0]] = record
    restarts: dict[str, int] = {}
    for path in well_formed_under(items, keys.failures(job), _failure_record):
        rid = path.split("/", 1)[0]
        restarts[rid] = restarts.get(rid, 0) + 1
    epoch = _one(items, keys.epoch(job), Epoch.from_json)
    leader = items.get(keys.leader(job))
    spec = _one(items, keys.spec(job), _spec_record)
    replicas = []
    for rid in sorted(set(registrations) | set(agents)):
        reg, agent = registrations.get(rid), agents.get(rid, AgentRecord())
        replicas.append({
            "id": rid,
            "state": reg.state.value if reg else "restarting",  # an agent, no live replica
            "step": reg.step if reg else None,
            "generation": reg.generation if reg else agent.generation,
            "restarts": restarts.get(rid, 0),
            "host": (reg.host if reg else "") or agent.host or None,
        })
    # Where the replicas meet is theirs to know, not the API's readers'.
    public_epoch = {f.name: getattr(epoch, f.name) for f in dataclasses.fields(Epoch)
                    if f.name not in INTERNAL_EPOCH_FIELDS} if epoch else None
    return {"job": job, "spec": spec.model_dump(exclude_unset=True) if spec else None,
            "leader": leader.decode(errors="replace") if leader else None,
            "epoch": public_epoch or {"number": 0, "members": []},
            "replicas": replicas}


def recent_failures(job: str, items: dict[str, bytes]) -> list[dict[str, Any]]:
    """The job's failure records, newest first, each with its replica and generation."""
    failures = []
    for path, record in well_formed_under(items, keys.failures(job), _failure_record).items():
        rid, _, generation = path.partition("/")
        failures.append({**dataclasses.asdict(record), "replica": rid,
                         "generation": int(generation) if generation.isdigit() else None})
    return sorted(failures, key=lambda f: f["time"], reverse=True)


def build_status(job: str, items: dict[str, bytes], *, now: float, progress: Progress | None,
                 num_failures: int = NUM_FAILURES_SHOWN) -> dict[str, Any]:
    """``GET /v1/jobs/{job}/status``: the job's view, its last ``num_failures`` failures, the
    leading term's measure (None on a standby) and where the leader serves."""
    view = build_job_view(job, items)
    failures = recent_failures(job, items)
    record = object_or_none(items, keys.controllers(job) + view["leader"]) \
        if view["leader"] else None
    return {**view, "time": now, "failures": failures[:num_failures],
            "num_failures": len(failures),
            "progress": progress.to_json() if progress is not None else None,
            "leader_address": record.get("addr") if record and isinstance(record.get("addr"), str)
            else None}
