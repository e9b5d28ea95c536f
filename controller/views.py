"""The job as the API and the status page show it, built from one read of its etcd keys (pure).

``controller.app`` answers with these views (typed by ``controller.models``) and
``controller.status_page`` renders them, so both show the same thing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from controller.leader import EpochMark, LiveTerm
from ftsystem.control import keys

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


def build_job_view(job: str, items: dict[str, bytes]) -> dict[str, Any]:
    """The job as its users see it: spec, epoch, and every replica an agent supervises."""
    def under(prefix: str) -> dict[str, Any]:
        return {k[len(prefix):]: json.loads(v) for k, v in items.items() if k.startswith(prefix)}

    registrations = under(keys.replicas(job))
    agents: dict[str, Any] = {}  # per replica, the record of its lowest node rank
    for path, record in sorted(under(keys.agents(job)).items(), reverse=True):
        agents[path.split("/", 1)[0]] = record
    restarts: dict[str, int] = {}
    for path in under(keys.failures(job)):
        rid = path.split("/", 1)[0]
        restarts[rid] = restarts.get(rid, 0) + 1
    epoch = json.loads(items.get(keys.epoch(job), b"null"))
    if epoch:  # where the replicas meet is theirs to know, not the API's readers'
        epoch = {k: v for k, v in epoch.items() if k not in INTERNAL_EPOCH_FIELDS}
    leader = items.get(keys.leader(job))
    replicas = []
    for rid in sorted(set(registrations) | set(agents)):
        reg = registrations.get(rid, {})
        replicas.append({
            "id": rid,
            "state": reg.get("state", "restarting"),  # an agent without a live replica
            "step": reg.get("step"),
            "generation": reg.get("generation", agents.get(rid, {}).get("generation")),
            "restarts": restarts.get(rid, 0),
            "host": reg.get("host") or agents.get(rid, {}).get("host"),
        })
    return {"job": job, "spec": json.loads(items.get(keys.spec(job), b"null")),
            "leader": leader.decode() if leader else None,
            "epoch": epoch or {"number": 0, "members": []},
            "replicas": replicas}


def recent_failures(job: str, items: dict[str, bytes]) -> list[dict[str, Any]]:
    """The job's failure records, newest first, each with its replica and generation."""
    prefix = keys.failures(job)
    failures = []
    for key, value in items.items():
        if key.startswith(prefix):
            rid, _, generation = key[len(prefix):].partition("/")
            failures.append({"time": 0.0, **json.loads(value), "replica": rid,
                             "generation": int(generation) if generation.isdigit() else None})
    return sorted(failures, key=lambda f: f["time"], reverse=True)


def build_status(job: str, items: dict[str, bytes], *, now: float, progress: Progress | None,
                 num_failures: int = NUM_FAILURES_SHOWN) -> dict[str, Any]:
    """``GET /v1/jobs/{job}/status``: the job's view, its last ``num_failures`` failures, the
    leading term's measure (None on a standby) and where the leader serves."""
    view = build_job_view(job, items)
    failures = recent_failures(job, items)
    record = items.get(keys.controllers(job) + view["leader"]) if view["leader"] else None
    return {**view, "time": now, "failures": failures[:num_failures],
            "num_failures": len(failures),
            "progress": progress.to_json() if progress is not None else None,
            "leader_address": json.loads(record).get("addr") if record else None}
