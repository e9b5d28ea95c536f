"""A job's lifecycle in etcd: its spec, validated (pure), created once, read, listed, deleted.

A job exists when its spec exists (``/ftsystem/<job>/spec``, ``docs/keyspace.md``). The leader
starts no epoch before it (``controller/leader.py``). The REST API (``POST/GET/DELETE
/v1/jobs/{job}``, which ``ftsystem job`` calls) and ``ftsystem run`` go through this module.

- Creating a job that exists fails (``JobExistsError``): nothing of an earlier run under the same
  id may leak into a new job, so it must be deleted first.
- Deleting removes every key under the job's prefix in one etcd delete. A job with live agents
  or registrations is refused unless forced: its agents would find their records gone.
- Its outcome, once its agents are gone, is whether every replica finished, read from the
  replicas' generations (``unfinished_replicas``): a batch job's exit status says so.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from ftsystem.control import keys
from ftsystem.control.membership import Policy
from ftsystem.control.store import Store
from ftsystem.control.timeouts import MIN_TIMEOUT_S


class JobSpecError(ValueError):
    """A malformed spec; the message lists every field to fix."""


class JobExistsError(Exception):
    """The job (or what an earlier run left under its id) exists: delete it first."""


class JobNotFoundError(LookupError):
    """Nothing is stored under the job's id."""


class JobRunningError(Exception):
    """Delete refused: agents or replicas of the job are registered."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPolicy:
    every_steps: int = 0
    """Disk checkpoints every this many committed steps (0: none); the job restarts from the
    newest complete one when every replica has died (``docs/checkpoints.md``)."""
    dir: str = ""
    """Where every rank writes them: storage that every node of the job reaches."""
    keep: int = 3
    """Complete checkpoints kept; older ones are removed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    replicas: int
    """The job's capacity: the first epoch waits for this many replicas (until the
    controller's start timeout), and live work-based ETTR is measured against it."""
    min_replicas: int = 1
    """Below this many members an epoch is paused."""
    nodes_per_replica: int = 1
    """Nodes per replica, one agent each; an agent of another shape is refused."""
    nproc_per_node: int = 1
    """Ranks per node."""
    timeout_s: float = 30.0
    """The one timeout (``docs/chaos.md``): every agent takes it, and hands it to its ranks
    (``agent.job_settings``); the leader derives the replicas' lease rule from it."""
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    num_steps: int | None = None
    """Informational: the replicas' program decides when it is done."""
    replica_ids: tuple[str, ...] | None = None
    """If set, an agent for a replica not listed is refused."""
    created_at: float | None = None
    """Unix time of the creation, set by ``create_job``."""

    def to_json(self) -> dict[str, Any]:
        raw = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in raw.items()
                if v is not None}

    @property
    def policy(self) -> Policy:
        """What the leader's ``decide`` needs of the spec."""
        return Policy(min_replicas=self.min_replicas, initial_replicas=self.replicas)


SPEC_FIELDS = frozenset(JobSpec.__dataclass_fields__)
CHECKPOINT_FIELDS = frozenset(CheckpointPolicy.__dataclass_fields__)


def parse_spec(raw: Any) -> JobSpec:
    """Validate a spec as a user or etcd gave it (pure). Missing optional fields take their
    defaults; unknown fields, wrong types and out-of-range values are refused, all at once."""
    if not isinstance(raw, Mapping):
        raise JobSpecError(f"a job spec is a JSON object, not {type(raw).__name__}: "
                           'e.g. {"replicas": 4, "min_replicas": 2}')
    problems: list[str] = []
    if unknown := sorted(set(raw) - SPEC_FIELDS):
        problems.append(f"unknown field(s) {', '.join(map(_shown, unknown))}: the fields are "
                        f"{', '.join(sorted(SPEC_FIELDS))}")
    if "replicas" not in raw:
        problems.append("replicas is missing: give the number of data-parallel replicas")
    # A field in error takes a valid stand-in, so that the checks across fields still run.
    values = {"replicas": 1} | {name: _field(name, raw[name], problems)
                                for name in SPEC_FIELDS & set(raw)}
    spec = JobSpec(**values)
    replicas_known = not any(p.startswith("replicas ") for p in problems)
    if replicas_known and spec.min_replicas > spec.replicas:
        problems.append(f"min_replicas {spec.min_replicas} > replicas {spec.replicas}: lower "
                        "min_replicas or raise replicas")
    if replicas_known and spec.replica_ids is not None and len(spec.replica_ids) < spec.replicas:
        problems.append(f"replica_ids lists {len(spec.replica_ids)} id(s) for {spec.replicas} "
                        "replicas: list at least one id per replica, or leave it out")
    if spec.checkpoint.every_steps and not spec.checkpoint.dir:
        problems.append("checkpoint.every_steps is set without checkpoint.dir: give the "
                        "directory every node writes to")
    if problems:
        raise JobSpecError("invalid job spec: " + "; ".join(problems))
    return spec


COUNTS = {"replicas": 1_000_000, "min_replicas": 1_000_000, "nodes_per_replica": 100_000,
          "nproc_per_node": 1024, "num_steps": 10 ** 12}
"""The counts of a spec and the most each may be: far above any real job, and low enough that
nothing sized by them (a list of replicas, a lease per node) can exhaust a controller."""
MAX_TIMEOUT_S = 3600.0
"""A failure is detected within a third of the timeout: an hour is already no detection."""


def _field(name: str, value: Any, problems: list[str]) -> Any:
    if name in COUNTS:
        return _count(name, value, problems, most=COUNTS[name])
    parse = {"timeout_s": _timeout, "created_at": _created_at, "replica_ids": _replica_ids,
             "checkpoint": _checkpoint}[name]
    return parse(value, problems)


def _shown(value: Any) -> str:
    """A rejected value as the error quotes it: whatever a client sent, kept short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _count(name: str, value: Any, problems: list[str], *, least: int = 1,
           most: int = 10 ** 12) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        problems.append(f"{name} must be an integer from {least} to {most}, not "
                        f"{_shown(value)}")
        return least
    return value


def _finite(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _created_at(value: Any, problems: list[str]) -> float | None:
    if not _finite(value):
        problems.append(f"created_at must be a Unix time, not {_shown(value)}")
        return None
    return float(value)


def _timeout(value: Any, problems: list[str]) -> float:
    if not _finite(value) or not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        problems.append(f"timeout_s must be a number of seconds from {MIN_TIMEOUT_S:g} to "
                        f"{MAX_TIMEOUT_S:g} (the lease TTL is a third of it), not "
                        f"{_shown(value)}")
        return JobSpec.__dataclass_fields__["timeout_s"].default
    return float(value)


def _replica_ids(value: Any, problems: list[str]) -> tuple[str, ...] | None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"replica_ids must be a list of strings, not {_shown(value)}")
        return None
    for rid in value:
        try:
            keys.check_id("replica", rid)
        except keys.InvalidIdError as e:
            problems.append(f"replica_ids: {e}")
    if len(set(value)) != len(value):
        problems.append("replica_ids lists an id twice: each replica once")
    return tuple(value)


def _checkpoint(value: Any, problems: list[str]) -> CheckpointPolicy:
    if not isinstance(value, Mapping):
        problems.append('checkpoint must be an object, e.g. {"every_steps": 100, "dir": '
                        f'"/shared/ckpt", "keep": 3}}, not {_shown(value)}')
        return CheckpointPolicy()
    if unknown := sorted(set(value) - CHECKPOINT_FIELDS):
        problems.append(f"unknown checkpoint field(s) {', '.join(map(_shown, unknown))}: the "
                        f"fields are {', '.join(sorted(CHECKPOINT_FIELDS))}")
    policy = CheckpointPolicy()
    if "every_steps" in value:
        policy = replace(policy, every_steps=_count("checkpoint.every_steps",
                                                    value["every_steps"], problems, least=0))
    if "keep" in value:
        policy = replace(policy, keep=_count("checkpoint.keep", value["keep"], problems,
                                             most=1000))
    if "dir" in value:
        if isinstance(value["dir"], str):
            policy = replace(policy, dir=value["dir"])
        else:
            problems.append("checkpoint.dir must be a path (a string), not "
                            f"{_shown(value['dir'])}")
    return policy


# --- etcd ------------------------------------------------------------------------------------

def _delete_hint(job: str) -> str:
    return f"`ftsystem job delete {job}` or DELETE /v1/jobs/{job}"


async def create_job(store: Store, job: str, spec: JobSpec, *, now: float,
                     exist_ok: bool = False) -> JobSpec:
    """Store the spec of a new job; returns it as stored. Raises ``JobExistsError`` if the
    job has a spec, or an epoch an earlier run left behind, and stores nothing then.
    ``exist_ok``: a job that exists with this very spec is no error (a deployment step that
    runs again: a restarted pod, a requeued batch job); it is returned as it was stored."""
    left = await store.get_json(keys.epoch(job))
    if left is not None and await store.get(keys.spec(job)) is None:
        raise JobExistsError(
            f"job {job!r} has no spec but holds an earlier run's state (epoch "
            f"{left.get('number')}): delete it first ({_delete_hint(job)}) so that the new "
            "job starts clean")
    stored = replace(spec, created_at=now)
    if await store.put_if_absent(keys.spec(job), json.dumps(stored.to_json(), sort_keys=True)):
        return stored
    if exist_ok and (raw := await store.get_json(keys.spec(job))) is not None:
        with contextlib.suppress(JobSpecError):
            if replace(existing := parse_spec(raw), created_at=None) == replace(
                    spec, created_at=None):
                return existing
        raise JobExistsError(f"job {job!r} exists with another spec ({json.dumps(raw)}): "
                             f"delete it first ({_delete_hint(job)}), or pick another job id")
    raise JobExistsError(f"job {job!r} exists: delete it first ({_delete_hint(job)}), or "
                         "pick another job id")


async def get_job(store: Store, job: str) -> dict[str, Any]:
    """The job's stored spec and whether agents or replicas run it."""
    spec = await store.get_json(keys.spec(job))
    if spec is None:
        raise JobNotFoundError(f"no job {job!r}: create it with `ftsystem job create {job} "
                               "--replicas N` (or POST /v1/jobs/" + job + ")")
    return {"job": job, "spec": spec, "running": await _running(store, job) > 0}


async def list_jobs(store: Store) -> list[dict[str, Any]]:
    """Every job with a spec in this etcd, by id. Reads the keys (not the values) of every
    job once: a rare operator's request, not one to poll."""
    names = await store.keys_with_prefix(keys.ROOT + "/")
    jobs = sorted(k.split("/")[2] for k in names if k.count("/") == 3 and k.endswith("/spec"))
    return [{"job": job, "spec": await store.get_json(keys.spec(job))} for job in jobs]


async def delete_job(store: Store, job: str, *, force: bool = False) -> None:
    """Remove every key of the job (one etcd delete of its prefix). Refused while agents or
    replicas are registered unless ``force``; ``JobNotFoundError`` if nothing is stored."""
    if not force and (running := await _running(store, job)):
        raise JobRunningError(
            f"job {job!r} is running ({running} agent and replica record(s) registered): stop "
            "its agents first, or force it (--force, or DELETE ...?force=true); its agents "
            "then fail, their records gone")
    if not await store.keys_with_prefix(keys.job(job) + "/"):
        raise JobNotFoundError(f"no job {job!r}: nothing is stored under its id")
    await store.delete_prefix(keys.job(job) + "/")


async def job_outcome(store: Store, job: str) -> list[str]:
    """Why replicas of the job did not finish, one line each; empty when every one did."""
    spec = await store.get_json(keys.spec(job))
    if spec is None:
        raise JobNotFoundError(f"no job {job!r}: nothing to report (was it deleted?)")
    generations, _ = await store.get_prefix(keys.generations(job))
    halts, _ = await store.get_prefix(keys.halts(job))
    return unfinished_replicas(
        parse_spec(spec), {keys.last_segment(k): json.loads(v) for k, v in generations.items()},
        {keys.last_segment(k): json.loads(v) for k, v in halts.items()})


def unfinished_replicas(spec: JobSpec, generations: Mapping[str, Mapping[str, Any]],
                        halted: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Pure: why replicas did not finish, one line each (empty: all of the spec's replicas
    did). ``generations``: each replica's last generation (``keys.generation``: its number,
    ``ended`` and ``finished``); ``halted``: the halt records by replica."""
    reasons = []
    for rid, gen in sorted(generations.items()):
        number = gen.get("number")
        if gen.get("finished"):
            continue
        if rid in halted:
            reasons.append(f"replica {rid} halted at step {halted[rid].get('step')}: "
                           f"{halted[rid].get('reason')}")
        elif gen.get("ended"):
            reasons.append(f"replica {rid} did not finish: its generation {number} ended "
                           f"({gen['ended']}) and none followed (a node lost for good, no "
                           "spare to take its place, or stopped)")
        else:
            reasons.append(f"replica {rid} did not finish: its generation {number} never "
                           "ended (its agents died with their nodes, or still run)")
    if (missing := spec.replicas - len(generations)) > 0:
        never = [rid for rid in spec.replica_ids or () if rid not in generations]
        reasons.append(f"{missing} of the job's {spec.replicas} replicas never started"
                       + (f" (of {', '.join(never)})" if never else ""))
    return reasons


async def _running(store: Store, job: str) -> int:
    return (len(await store.keys_with_prefix(keys.agents(job)))
            + len(await store.keys_with_prefix(keys.replicas(job))))
