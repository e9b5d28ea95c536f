"""``ftsystem job create|get|list|delete``: a job's lifecycle, straight in etcd.

The same code path as the REST API (``ftsystem.control.jobs``); these commands bypass the
controller's API and its token, so they need etcd credentials.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ftsystem.cli import (ENV_ETCD, ETCD_CA, ETCD_CERT, ETCD_HELP, ETCD_KEY, _check_id,
                          _etcd_tls, _fail, app)

job_app = typer.Typer(no_args_is_help=True, help="Create, inspect and delete jobs (their spec "
                      "in etcd); the leader starts no epoch before a job is created.")
app.add_typer(job_app, name="job")

ETCD = typer.Option(..., envvar=ENV_ETCD, help=ETCD_HELP)
BYPASS_NOTE = ("note: this writes to etcd directly, bypassing the controller's API and its "
               "token; it needs etcd credentials. With a controller running, the API does the "
               "same: {method} /v1/jobs/<job> with the bearer token.")
STATE_ERROR = 1
"""Exit code of a request refused for the job's state (exists, running, not found): the
command was well formed (usage errors exit 2)."""


def _run(coro_fn, etcd: str, tls: tuple[Path | None, Path | None, Path | None]) -> Any:
    """``coro_fn(store)`` on a store of ``etcd``, with the client certificates ``tls`` (CA,
    certificate, key: ``--etcd-ca``, ``--etcd-cert``, ``--etcd-key``)."""
    from ftsystem.control.store import Store, StoreError
    _etcd_tls(*tls)
    try:
        store = Store(etcd)
    except ValueError as e:  # a malformed endpoint, certificates that cannot work
        raise typer.BadParameter(str(e), param_hint="--etcd") from e

    async def with_store():
        async with store:
            return await coro_fn(store)
    try:
        return asyncio.run(with_store())
    except StoreError as e:
        raise _fail(str(e))


def _refused(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(STATE_ERROR)


def _note(method: str) -> None:
    typer.secho(BYPASS_NOTE.format(method=method), err=True, fg=typer.colors.YELLOW)


def spec_from_options(spec_file: Path | None, options: dict[str, Any]) -> dict[str, Any]:
    """The raw spec: the file's fields (JSON or YAML), then the options given on the command
    line over them. Validation is ``jobs.parse_spec``'s, as for the API."""
    raw: dict[str, Any] = {}
    if spec_file is not None:
        import yaml
        try:
            loaded = yaml.safe_load(spec_file.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise _fail(f"--spec {spec_file}: {e}")
        if not isinstance(loaded, dict):
            raise _fail(f"--spec {spec_file}: a job spec is a mapping, e.g. 'replicas: 4'")
        raw = loaded
    given = {k: v for k, v in options.items() if v is not None}
    checkpoint = {k.removeprefix("checkpoint_"): given.pop(k)
                  for k in ("checkpoint_every_steps", "checkpoint_dir", "checkpoint_keep")
                  if k in given}
    if checkpoint:
        raw["checkpoint"] = (raw.get("checkpoint") or {}) | checkpoint
    if "replica_ids" in given:
        given["replica_ids"] = [r for r in given["replica_ids"].split(",") if r]
    return raw | given


@job_app.command("create")
def create(job: str = typer.Argument(..., help="job id"),
           replicas: Optional[int] = typer.Option(None, help="data-parallel replicas: the job's "
                                                  "capacity (required, here or in --spec)"),
           min_replicas: Optional[int] = typer.Option(None, help="pause below this many (1)"),
           nodes_per_replica: Optional[int] = typer.Option(None, help="nodes per replica (1)"),
           nproc_per_node: Optional[int] = typer.Option(None, help="ranks per node (1)"),
           timeout: Optional[float] = typer.Option(None, "--timeout", help="the one timeout in "
                                                   "seconds (30); every agent takes it"),
           checkpoint_every: Optional[int] = typer.Option(None, help="disk checkpoints every N "
                                                          "steps (0: none)"),
           checkpoint_dir: Optional[str] = typer.Option(None, help="where every node writes "
                                                        "them (shared storage)"),
           checkpoint_keep: Optional[int] = typer.Option(None, help="complete checkpoints "
                                                         "kept (3)"),
           steps: Optional[int] = typer.Option(None, help="steps to train (informational)"),
           replica_ids: Optional[str] = typer.Option(None, help="the only replica ids allowed, "
                                                     "comma-separated, e.g. r0,r1"),
           spec_file: Optional[Path] = typer.Option(None, "--spec", help="the spec as a JSON or "
                                                    "YAML file; options override its fields"),
           exist_ok: bool = typer.Option(False, help="succeed if the job exists with this very "
                                         "spec (a deployment step run again); a different "
                                         "spec is still refused"),
           etcd: str = ETCD, etcd_ca: Optional[Path] = ETCD_CA,
           etcd_cert: Optional[Path] = ETCD_CERT, etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """Create a job: store its spec. Refused if the job exists (delete it first)."""
    from ftsystem.control import jobs
    _check_id("job", job)
    raw = spec_from_options(spec_file, {
        "replicas": replicas, "min_replicas": min_replicas,
        "nodes_per_replica": nodes_per_replica, "nproc_per_node": nproc_per_node,
        "timeout_s": timeout, "num_steps": steps, "replica_ids": replica_ids,
        "checkpoint_every_steps": checkpoint_every, "checkpoint_dir": checkpoint_dir,
        "checkpoint_keep": checkpoint_keep})
    try:
        spec = jobs.parse_spec(raw)
    except jobs.JobSpecError as e:
        raise _fail(f"{e}; nothing was stored")
    _note("POST")
    try:
        stored = _run(lambda store: jobs.create_job(store, job, spec, now=time.time(),
                                                    exist_ok=exist_ok), etcd,
                      (etcd_ca, etcd_cert, etcd_key))
    except jobs.JobExistsError as e:
        raise _refused(f"{e}; nothing was changed")
    typer.echo(json.dumps({"job": job, "spec": stored.to_json()}, indent=2))


@job_app.command("get")
def get(job: str = typer.Argument(..., help="job id"), etcd: str = ETCD,
        etcd_ca: Optional[Path] = ETCD_CA, etcd_cert: Optional[Path] = ETCD_CERT,
        etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """Print the job's spec and whether agents or replicas run it (JSON)."""
    from ftsystem.control import jobs
    _check_id("job", job)
    try:
        found = _run(lambda store: jobs.get_job(store, job), etcd, (etcd_ca, etcd_cert, etcd_key))
    except jobs.JobNotFoundError as e:
        raise _refused(str(e))
    typer.echo(json.dumps(found, indent=2))


@job_app.command("list")
def list_(etcd: str = ETCD, etcd_ca: Optional[Path] = ETCD_CA,
          etcd_cert: Optional[Path] = ETCD_CERT, etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """One line per job with a spec: id, replicas, min replicas, nodes x ranks, created."""
    from ftsystem.control import jobs
    for found in _run(jobs.list_jobs, etcd, (etcd_ca, etcd_cert, etcd_key)):
        spec = found["spec"] or {}
        created = spec.get("created_at")
        typer.echo("\t".join(map(str, (
            found["job"], spec.get("replicas"), spec.get("min_replicas"),
            f"{spec.get('nodes_per_replica', 1)}x{spec.get('nproc_per_node', 1)}",
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)) if created else "-"))))


@job_app.command("delete")
def delete(job: str = typer.Argument(..., help="job id"),
           force: bool = typer.Option(False, help="delete even while agents or replicas are "
                                      "registered (they then fail)"),
           etcd: str = ETCD, etcd_ca: Optional[Path] = ETCD_CA,
           etcd_cert: Optional[Path] = ETCD_CERT, etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """Delete every key of the job. Refused while it runs, unless --force."""
    from ftsystem.control import jobs
    _check_id("job", job)
    _note("DELETE")
    try:
        _run(lambda store: jobs.delete_job(store, job, force=force), etcd,
             (etcd_ca, etcd_cert, etcd_key))
    except (jobs.JobRunningError, jobs.JobNotFoundError) as e:
        raise _refused(f"{e}; nothing was changed")
    typer.echo(f"deleted job {job}")
