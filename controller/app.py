"""The controller's REST API (FastAPI). Every instance serves it, reading etcd; one leads."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Response
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller import models
from controller.auth import BearerAuth, load_token
from controller.leader import LeaderConfig, LiveTerm, run_elections
from controller.status_page import install_status_page
from controller.views import NUM_FAILURES_SHOWN, Progress, build_job_view, build_status
from ftsystem.chaos import rate as chaos_rate
from ftsystem.control import jobs, keys
from ftsystem.measure import metrics
from ftsystem.chaos.spec import ChaosSpecError, read_orders, spec_from_mapping, submit
from ftsystem.control.membership import ReplicaState
from ftsystem.control.records import decoder, objects_under, time_of, well_formed
from ftsystem.control.store import HeldKey, Store, StoreError

_event = decoder("event", models.Event)

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 1.0
"""How long ``/readyz`` waits for etcd. Below the probes' own timeout (2 s in docker/k8s), so
that a frozen etcd gets a 503 that says so rather than a probe timeout that says nothing; and
far below the store's retry deadline, which outlasts any probe."""
ERRORS = {status: {"description": what, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/ErrorDetail"}}}} for status, what in (
    (401, "no token, or another: send Authorization: Bearer <the job's token>"),
    (503, "etcd unreachable"))}
"""Every route of the API may answer these, in JSON whatever its own media type (the status
page, /metrics); ``_errors`` declares ``ErrorDetail`` itself."""


class AsBuilt(APIRoute):
    """A route of the API: its answer holds the fields its handler built from etcd and no
    others (a field a stored record lacks stays out); the response model types and documents
    them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs | {"response_model_exclude_unset": True})


def create_app(store: Store, cfg: LeaderConfig, *, insecure: bool = False,
               public_read: bool = False) -> FastAPI:
    """The controller's app. Raises ``AuthConfigError`` (before anything starts) when no API
    token is configured and ``insecure`` is not set. ``public_read``: GET and HEAD need no
    token."""
    is_leader = asyncio.Event()
    term = LiveTerm()  # what this instance measures while it leads, for its status
    auth = BearerAuth(load_token(), insecure=insecure, public_read=public_read)
    metrics.init_controller(cfg.job)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await store.connect()
        tasks = [asyncio.create_task(run_elections(store, cfg, is_leader, term))]
        tasks[0].add_done_callback(_exit_on_crash)
        if cfg.address:
            record = HeldKey(store, keys.controller(cfg.job, cfg.instance_id), cfg.lease_ttl_s)
            await record.set({"addr": cfg.address})
            tasks.append(asyncio.create_task(record.hold()))
            tasks.append(asyncio.create_task(_restore_when_deleted(store, record)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await store.close()

    app = FastAPI(title="ftsystem controller", version="1", lifespan=lifespan)
    # Every route of the API is on this router, behind the token: a route added to it later is
    # closed by default too. Only the probes, /healthz and /readyz, are on the app itself:
    # orchestrators' probes carry no token.
    api = APIRouter(dependencies=[Depends(auth)], responses=ERRORS, route_class=AsBuilt)

    @app.get("/healthz", response_model=models.Health)
    async def healthz() -> dict:
        """Liveness: the process serves HTTP (no etcd read, no token)."""
        return {"status": "ok", "job": cfg.job, "instance": cfg.instance_id,
                "pid": os.getpid(), "leader": is_leader.is_set()}

    @app.get("/readyz", response_model=models.Readiness,
             responses={503: {"model": models.Readiness, "description": "not ready"}})
    async def readyz() -> JSONResponse:
        """Ready to serve the API: etcd answers and some instance leads the job (503 names
        the condition that failed). Not a liveness check: an etcd outage must not restart
        the controllers. No token."""
        status, body = await readiness(store, cfg.job)
        return JSONResponse(body, status_code=status)

    @api.get("/v1/jobs", response_model=models.JobList)
    async def list_jobs() -> dict:
        """Every job with a spec in this etcd (not only this controller's)."""
        return {"jobs": await jobs.list_jobs(store)}

    @api.get("/v1/jobs/{job}", response_model=models.JobView, responses=_errors(400, 404))
    async def get_job(job: str) -> dict:
        """The job's spec (null until it is created), epoch and replicas."""
        _check_job(cfg.job, job)
        return await job_view(store, job)

    @api.get("/v1/jobs/{job}/outcome", response_model=models.JobOutcome,
             responses=_errors(400, 404))
    async def get_outcome(job: str) -> dict:
        """Whether every replica finished, from their last generations and halt records
        (``ftsystem job outcome``, at the end of docker/slurm/ftsystem.sbatch); 404 until the
        job is created."""
        _check_job(cfg.job, job)
        try:
            unfinished = await jobs.job_outcome(store, job)
        except jobs.JobNotFoundError as e:
            raise HTTPException(404, str(e)) from e
        return {"job": job, "finished": not unfinished, "unfinished": unfinished}

    @api.post("/v1/jobs/{job}", status_code=201, response_model=models.CreatedJob,
              responses={**_errors(400, 404, 409), 200: {
                  "model": models.CreatedJob, "description": "exist_ok: it exists, so"}})
    async def create_job(job: str, spec: models.JobSpecRequest, response: Response,
                         exist_ok: bool = Query(False, description="answer 200 if the job "
                                                "exists with this very spec")) -> dict:
        """Create the job from its spec: 409 if it exists (delete it first; with exist_ok,
        200 if it exists with this very spec), 422 if the spec is malformed. The leader
        starts no epoch before this."""
        _check_job(cfg.job, job)
        now = time.time()
        try:
            stored = await jobs.create_job(store, job, jobs.parse_spec(spec.raw()), now=now,
                                           exist_ok=exist_ok)
        except jobs.JobSpecError as e:  # in the shape FastAPI declares for its own 422s
            raise HTTPException(422, [{"loc": ["body"], "type": "value_error",
                                       "msg": f"{e}; nothing was stored"}]) from e
        except jobs.JobExistsError as e:
            raise HTTPException(409, str(e)) from e
        if stored.created_at != now:  # it existed, with this spec
            response.status_code = 200
        return {"job": job, "spec": stored.to_json()}

    @api.delete("/v1/jobs/{job}", response_model=models.DeletedJob,
                responses=_errors(400, 404, 409))
    async def delete_job(job: str, force: bool = Query(
            False, description="delete even while agents or replicas are registered")) -> dict:
        """Remove every key of the job: 409 while it runs (unless force), 404 if nothing is
        stored. A job created again under the same id starts clean."""
        _check_job(cfg.job, job)
        try:
            await jobs.delete_job(store, job, force=force)
        except jobs.JobRunningError as e:
            raise HTTPException(409, str(e)) from e
        except jobs.JobNotFoundError as e:
            raise HTTPException(404, str(e)) from e
        return {"job": job, "deleted": True}

    @api.get("/v1/jobs/{job}/status", response_model=models.JobStatus,
             responses=_errors(400, 404))
    async def get_status(job: str, failures: int = Query(
            NUM_FAILURES_SHOWN, ge=0, le=1000, description="how many recent failures")) -> dict:
        """One read of the job for an operator (``ftsystem status``, ``ftsystem watch``): its
        view, its recent failures and, from the leading instance, the step rate, ETTR and
        the epochs of its term (a standby answers progress null and leader_address)."""
        _check_job(cfg.job, job)
        items, _ = await store.get_prefix(keys.job(job) + "/")
        now = time.time()
        return build_status(job, items, now=now, progress=Progress.of(term, now),
                            num_failures=failures)

    @api.get("/v1/jobs/{job}/replicas/{replica_id}", response_model=models.Replica,
             responses=_errors(400, 404))
    async def get_replica(job: str, replica_id: str) -> dict:
        _check_job(cfg.job, job)
        try:
            keys.check_id("replica", replica_id)
        except keys.InvalidIdError as e:
            raise HTTPException(400, str(e)) from e
        view = await job_view(store, job)
        for replica in view["replicas"]:
            if replica["id"] == replica_id:
                return replica
        raise HTTPException(404, f"replica {replica_id!r} is not part of job {job!r}; "
                                 f"GET /v1/jobs/{job} lists its replicas")

    limit, window_s = chaos_rate.configured_rate()

    @api.post("/v1/jobs/{job}/chaos", status_code=201, response_model=models.SubmittedChaos,
              responses=_errors(400, 404, 429))
    async def post_chaos(job: str, spec: models.ChaosSpecRequest) -> dict:
        """Validate a chaos spec, expand it against the job's replicas, store the orders.
        Rate-limited per job (``FTSYSTEM_CHAOS_RATE``, shared with ``ftsystem chaos apply``)."""
        _check_job(cfg.job, job)
        try:
            parsed = spec_from_mapping(spec.raw())
            await chaos_rate.take(store, job, limit, window_s)
            orders = await submit(store, job, parsed, f"api-{int(time.time() * 1000)}",
                                  now=time.time())
        except ChaosSpecError as e:
            raise HTTPException(400, f"invalid chaos spec: {e}; nothing was stored") from e
        except chaos_rate.ChaosRateError as e:
            raise HTTPException(429, f"{e}; nothing was stored") from e
        return {"orders": [order.id for order in orders]}

    @api.get("/v1/jobs/{job}/chaos", response_model=models.OrderList,
             responses=_errors(400, 404))
    async def list_chaos(job: str) -> dict:
        """Every chaos order of the job with its state and outcome, oldest first."""
        _check_job(cfg.job, job)
        items, _ = await store.get_prefix(keys.chaos_orders(job))
        return {"orders": [dataclasses.asdict(o) for o in read_orders(items)]}

    @api.get("/v1/jobs/{job}/events", response_model=models.EventList,
             responses=_errors(400, 404))
    async def list_events(job: str) -> dict:
        """What replicas reported about the job's state: divergences (a replica whose state
        differed from the others', how it was found, whom it differed from) and halts (a
        replica stopped for an error no restart fixes), oldest first."""
        _check_job(cfg.job, job)
        divergences, _ = await store.get_prefix(keys.divergences(job))
        halted, _ = await store.get_prefix(keys.halts(job))
        events = [e.model_dump() for e in well_formed(divergences, _event).values()]
        events += [{**e.model_dump(), "kind": "halt", "replica": keys.last_segment(k)}
                   for k, e in well_formed(halted, _event).items()]
        return {"events": sorted(events, key=lambda e: time_of(e))}

    @api.get("/v1/sd/prometheus", response_model=list[models.TargetGroup])
    async def prometheus_service_discovery() -> list[dict]:
        """Prometheus HTTP service discovery: every metrics endpoint of the job."""
        items, _ = await store.get_prefix(keys.job(cfg.job) + "/")
        return discovery_targets(cfg.job, items)

    @api.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        """Prometheus text format."""
        await _refresh_gauges(store, cfg.job)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StoreError)
    async def store_unavailable(_request, exc: StoreError):
        return Response(json.dumps({"detail": str(exc)}), status_code=503,
                        media_type="application/json")

    install_status_page(app, api, store, cfg, term)
    app.include_router(api)
    return app


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route declares besides 401 and 503 (``{"detail": "..."}``)."""
    what = {400: "an invalid id or spec", 404: "another job, no such replica, or no job created",
            409: "refused for the job's state", 429: "over the chaos rate limit"}
    return {status: {"model": models.ErrorDetail, "description": what[status]}
            for status in statuses}


async def _restore_when_deleted(store: Store, record: HeldKey) -> None:
    """Put this instance's discovery record back after a job deletion removed it (the
    controller keeps serving the job id, waiting for a new spec)."""
    while True:
        items, revision = await store.get_prefix(record.key)
        if record.key not in items and record.lease:
            try:
                await record.set(record.value)
            except StoreError as e:  # a lapsed lease: hold() writes it again on a new one
                log.warning("%s not restored: %s", record.key, e)
        async for event in store.watch_prefix(record.key, start_revision=revision + 1):
            if event.kind == "DELETE":
                break


async def readiness(store: Store, job: str) -> tuple[int, dict[str, Any]]:
    """One read of the leader key, bounded by ``READY_TIMEOUT_S``: it answers both whether
    etcd is reachable and whether an instance leads (the key lives on the leader's lease)."""
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            leader = await store.get(keys.leader(job))
    except (StoreError, TimeoutError) as e:
        return readiness_reply(job, leader=None, etcd_error=str(e) or "no answer")
    return readiness_reply(job, leader=leader, etcd_error=None)


def readiness_reply(job: str, *, leader: bytes | None, etcd_error: str | None
                    ) -> tuple[int, dict[str, Any]]:
    """Pure: ``/readyz``'s status and body from what the read found."""
    if etcd_error is not None:
        return 503, {"ready": False, "failed": "etcd",
                     "detail": f"reading etcd failed ({etcd_error}; a read gets "
                               f"{READY_TIMEOUT_S:g} s): check the etcd endpoints and their "
                               "health"}
    if leader is None:
        return 503, {"ready": False, "failed": "leader",
                     "detail": f"no controller instance leads job {job} (no leader key): "
                               "one campaigns as it starts; see the controllers' logs"}
    return 200, {"ready": True, "leader": leader.decode()}


def _exit_on_crash(task: asyncio.Task) -> None:
    """A bug in the election loop must not leave a controller that serves but never leads."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("election loop crashed", exc_info=task.exception())
        os._exit(1)


def _check_job(served: str, job: str) -> None:
    try:
        keys.check_id("job", job)
    except keys.InvalidIdError as e:
        raise HTTPException(400, str(e)) from e
    if job != served:
        raise HTTPException(404, f"unknown job {job!r}: this controller manages {served!r}")


async def job_view(store: Store, job: str) -> dict[str, Any]:
    """The job as its users see it: spec, epoch, and every replica an agent supervises."""
    items, _ = await store.get_prefix(keys.job(job) + "/")
    return build_job_view(job, items)


def discovery_targets(job: str, items: dict[str, bytes]) -> list[dict]:
    """Pure: one target group per process that serves metrics (Prometheus HTTP SD format).

    Target labels name the process: ``replica`` and ``node_rank`` for an agent, ``replica`` and
    ``rank`` for a training rank (each rank publishes its endpoint; a replica whose ranks did
    not, an older writer, is found by its registration, as rank 0), and ``host`` for both: the
    machine (the agent's ``--node-id``), as its agent and its ranks recorded it."""
    groups = []

    def add(addr: Any, component: str, instance_id: str, **labels: str | None) -> None:
        if addr and isinstance(addr, str):  # a record's field: anything may be written there
            groups.append({"targets": [addr], "labels": {
                "job": job, "component": component, "instance_id": instance_id,
                **{k: v for k, v in labels.items() if v and isinstance(v, str)}}})

    def under(prefix: str) -> list[tuple[str, dict]]:
        return sorted(objects_under(items, prefix).items())

    for name, record in under(keys.controllers(job)):
        add(record.get("addr"), "controller", name)
    for name, record in under(keys.agents(job)):
        replica, _, node = name.partition("/")
        add(record.get("metrics_addr"), "agent", name, replica=replica,
            node_rank=node.lstrip("0") or "0", host=record.get("node_id"))
    ranked = set()
    for name, record in under(keys.metrics_endpoints(job)):
        replica, _, rank = name.partition("/")
        ranked.add(replica)
        add(record.get("addr"), "replica", name, replica=replica, rank=rank.lstrip("0") or "0",
            host=record.get("node_id"))
    for name, record in under(keys.replicas(job)):
        if name not in ranked:
            add(record.get("metrics_addr"), "replica", name, replica=name, rank="0")
    return groups


async def _refresh_gauges(store: Store, job: str) -> None:
    view = await job_view(store, job)
    counts = {state.value: 0 for state in ReplicaState} | {"restarting": 0, "down": 0}
    for replica in view["replicas"]:
        counts[replica["state"]] = counts.get(replica["state"], 0) + 1
    for state, count in counts.items():
        metrics.REPLICAS.labels(job, state).set(count)
    metrics.REPLICA_STEP.clear()  # a replica gone from the job leaves no series behind
    for replica in view["replicas"]:
        if replica["step"] is not None:
            metrics.REPLICA_STEP.labels(job, replica["id"]).set(replica["step"])
    metrics.EPOCH.labels(job).set(view["epoch"]["number"])
    metrics.EPOCH_MEMBERS.labels(job).set(len(view["epoch"]["members"]))
