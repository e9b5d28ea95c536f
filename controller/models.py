"""The bodies of the controller's REST API, as pydantic models: what ``/openapi.json`` shows.

Request bodies check the shape (field names and JSON types, strictly: no string turned into a
number); the values are then checked where every other caller checks them, by
``ftsystem.control.jobs.parse_spec`` and ``ftsystem.chaos.spec.spec_from_mapping``, so that the
API, the CLI and ``ftsystem run`` accept the same specs. Response models describe what
``controller.app`` builds from etcd, where anyone with etcd credentials can write: their
fields are optional wherever a stored record may lack them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- jobs ------------------------------------------------------------------------------------

class CheckpointPolicy(_Request):
    every_steps: int | None = Field(None, description="disk checkpoints every N committed "
                                    "steps (0: none)")
    dir: str | None = Field(None, description="where every rank writes them: storage every "
                            "node reaches; required when every_steps > 0")
    keep: int | None = Field(None, description="complete checkpoints kept (3)")


class JobSpecRequest(_Request):
    """A job's spec (``docs/operations.md``, "Jobs"): fields left out take their defaults."""

    replicas: int = Field(description="data-parallel replicas: the job's capacity (>= 1)")
    min_replicas: int | None = Field(None, description="epochs with fewer members are "
                                     "paused (1; at most replicas)")
    nodes_per_replica: int | None = Field(None, description="nodes per replica (1)")
    nproc_per_node: int | None = Field(None, description="ranks per node (1)")
    timeout_s: float | None = Field(None, description="the one timeout in seconds (30, at "
                                    "least 6)")
    checkpoint: CheckpointPolicy | None = None
    num_steps: int | None = Field(None, description="steps to train (informational)")
    replica_ids: list[str] | None = Field(None, description="the only replica ids allowed (at "
                                          "least replicas of them)")
    created_at: float | None = Field(None, description="ignored: the controller sets it")

    def raw(self) -> dict[str, Any]:
        """The fields the client gave, for ``jobs.parse_spec``."""
        return self.model_dump(exclude_unset=True)


class Checkpoint(_Response):
    every_steps: int = 0
    dir: str = ""
    keep: int = 3


class JobSpec(_Response):
    """A spec as stored (defaults filled in by ``ftsystem job create`` and the API)."""

    replicas: int | None = None
    min_replicas: int | None = None
    nodes_per_replica: int | None = None
    nproc_per_node: int | None = None
    timeout_s: float | None = None
    checkpoint: Checkpoint | None = None
    num_steps: int | None = None
    replica_ids: list[str] | None = None
    created_at: float | None = Field(None, description="Unix time of the creation")


class Epoch(_Response):
    number: int = Field(description="0 before the first epoch")
    members: list[str] = Field(description="who all-reduces together, in ring order")
    generations: dict[str, int] = Field(default_factory=dict, description="each member's "
                                        "generation (its restarts)")
    paused: bool = Field(False, description="fewer members than min_replicas: no training")
    reason: str = Field("", description="start, removal, join or resync")
    time: float = Field(0.0, description="Unix time the leader decided it")


class Replica(_Response):
    id: str
    state: str = Field(description="its registration's state (starting, catching_up, ready, "
                       "member, done), or restarting when only its agent's record exists")
    step: int | None = Field(None, description="the last committed step it reported")
    generation: int | None = None
    restarts: int = Field(0, description="its failure records")
    host: str | None = None


class JobView(_Response):
    job: str
    spec: JobSpec | None = Field(description="null until the job is created")
    leader: str | None = Field(description="the leading controller instance, if any")
    epoch: Epoch
    replicas: list[Replica]


class JobOutcome(_Response):
    """Whether the job's replicas finished: what a batch job's exit status says once its
    agents are gone (a replica still training reads as not finished)."""

    job: str
    finished: bool = Field(description="every replica of the spec finished")
    unfinished: list[str] = Field(description="why replicas did not finish, one line each "
                                  "(a halt, a generation ended with none after it, one that "
                                  "never ended, replicas that never started)")


class JobEntry(_Response):
    job: str
    spec: JobSpec | None


class JobList(_Response):
    jobs: list[JobEntry]


class CreatedJob(_Response):
    job: str
    spec: JobSpec


class DeletedJob(_Response):
    job: str
    deleted: bool


# --- status: what ``ftsystem status``, ``ftsystem watch`` and the status page show -------------

class Failure(_Response):
    replica: str
    generation: int | None
    time: float = Field(0.0, description="Unix time its agent recorded it")
    step: int | None = Field(None, description="its last committed step")
    reason: str | None = None


class RatePoint(_Response):
    time: float = Field(description="Unix time, the end of the interval")
    steps_per_s: float


class EpochMark(_Response):
    number: int
    time: float
    num_members: int
    reason: str
    paused: bool


class Progress(_Response):
    """What the leading controller measures from the replicas' step reports; it starts over
    with each new leader."""

    ettr_work: float | None = Field(description="steps the members committed, against what the "
                                    "spec's replicas would have at the normal step time")
    ettr_time: float | None = Field(description="fraction of the time the job advanced")
    step_rate: float | None = Field(description="job steps per second over window_s")
    window_s: float
    measured_s: float | None = Field(description="how long this leader has measured")
    rates: list[RatePoint] = Field(description="the step rate over window_s, oldest first")
    epochs: list[EpochMark] = Field(description="epochs this leader found or published, "
                                    "oldest first (the last ones)")


class JobStatus(JobView):
    """One read of the job: its view, its recent failures, and the leader's measure."""

    time: float = Field(description="Unix time of the read")
    failures: list[Failure] = Field(description="the most recent, newest first")
    num_failures: int = Field(description="every failure record of the job")
    progress: Progress | None = Field(description="null unless this instance leads: then "
                                      "ask leader_address")
    leader_address: str | None = Field(description="host:port the leading instance "
                                       "advertises, if it does")


# --- chaos and events ----------------------------------------------------------------------

class ChaosSelector(_Request):
    replicas: list[str] = Field(default_factory=list, description="replica ids; empty: all")


class ChaosMtbf(_Request):
    mtbf: str | float = Field(description="mean time between failures (Poisson), e.g. 30s")


class ChaosSpecRequest(_Request):
    """A failure-injection spec (``docs/chaos.md``); its values are checked as ``ftsystem chaos
    apply`` checks them (400 with the reason)."""

    action: str | list[str] = Field(description="kill, hang, slow, partition, host-kill, "
                                    "host-partition, controller-kill, etcd-member-kill, "
                                    "etcd-pause, or a list of them (each firing picks one)")
    mode: str | None = Field(None, description="one (default), fixed or percent")
    value: float | None = Field(None, description="how many (fixed) or which share (percent)")
    selector: ChaosSelector | None = None
    duration: str | float | None = Field(None, description="hang, slow, partition: e.g. 5s")
    schedule: str | ChaosMtbf | None = Field(None, description="'@every 30s', {mtbf: 30s}, or "
                                             "none: once, now")
    horizon: str | float | None = Field(None, description="how far ahead a schedule is "
                                        "expanded (300s)")
    seed: int | None = None
    slow_fraction: float | None = Field(None, description="slow: the share of each period "
                                        "stopped (0.5)")
    after_step: int | None = Field(None, description="orders wait until the job has reached "
                                   "this step")

    def raw(self) -> dict[str, Any]:
        """The fields the client gave, for ``spec_from_mapping``."""
        return self.model_dump(exclude_unset=True)


class SubmittedChaos(_Response):
    orders: list[str] = Field(description="the ids of the orders stored")


class Order(_Response):
    id: str
    action: str
    replica: str = Field(description="empty for a service action")
    at: float = Field(description="Unix time at which it is due")
    duration_s: float = 0.0
    slow_fraction: float = 0.5
    node: int = 0
    after_step: int = 0
    state: str = Field("pending", description="pending, done or failed")
    outcome: str = ""
    executed_at: float | None = None


class OrderList(_Response):
    orders: list[Order]


class Event(_Response):
    """A divergence (with found_by, differs_from, epoch) or a halt (with reason)."""

    kind: str = Field("divergence", description="divergence or halt")
    replica: str | None = None
    step: int | None = None
    time: float | None = None


class EventList(_Response):
    events: list[Event]


# --- probes and discovery ---------------------------------------------------------------------

class Health(_Response):
    status: str
    job: str
    instance: str
    pid: int
    leader: bool


class Readiness(_Response):
    ready: bool
    leader: str | None = Field(None, description="the leading instance (when ready)")
    failed: str | None = Field(None, description="etcd or leader (when not ready)")
    detail: str | None = None


class TargetGroup(_Response):
    """Prometheus HTTP service discovery: one process that serves metrics."""

    targets: list[str]
    labels: dict[str, str]


class ErrorDetail(BaseModel):
    detail: str
