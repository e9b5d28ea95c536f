"""``ftsystem job create|get|outcome|list|delete``: a job's lifecycle, through the controller's API.

Each command is one request to a controller of the job (``--controller``, or
``FTSYSTEM_CONTROLLER``) with the job's token (``FTSYSTEM_API_TOKEN``, or the file
``FTSYSTEM_API_TOKEN_FILE`` or ``--token-file`` names); the controller validates and stores
(``ftsystem.control.jobs``, as for ``ftsystem run``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from ftsystem.cli import _check_id, _fail, app
from ftsystem.control.api_client import (DEFAULT_CONTROLLER, ENV_CONTROLLER, ENV_WAIT,
                                         ApiError, ControllerClient)

job_app = typer.Typer(no_args_is_help=True, help="Create, inspect and delete jobs through the "
                      "controller's API; the leader starts no epoch before a job is created.")
app.add_typer(job_app, name="job")

CONTROLLER = typer.Option(DEFAULT_CONTROLLER, "--controller", envvar=ENV_CONTROLLER,
                          help="the URL of a controller of the job")
TOKEN_FILE = typer.Option(None, "--token-file", help="a file holding the job's token "
                          "(default: FTSYSTEM_API_TOKEN, or the file FTSYSTEM_API_TOKEN_FILE "
                          "names)")
ETCD = typer.Option(None, "--etcd", hidden=True, help="refused: the API stores the job")
STATE_ERROR = 1
"""Exit code of a request refused for the job's state (exists, running, not found): the
command was well formed (usage errors, an unreachable controller and a refused token exit 2)."""
STATE_STATUSES = frozenset({404, 409})


def client(controller: str, token_file: Path | None, *, wait_s: float = 0.0
           ) -> ControllerClient:
    """A client of ``controller`` with the job's token: the file given, else the variables."""
    from ftsystem.control.tokens import AuthConfigError, load_token
    try:
        token = load_token({"FTSYSTEM_API_TOKEN_FILE": str(token_file)} if token_file else None)
    except AuthConfigError as e:
        raise _fail(str(e))
    return ControllerClient(controller, token, wait_s=wait_s)


def request(controller: str, token_file: Path | None,
            send: Callable[[ControllerClient], Any], *, wait_s: float = 0.0) -> Any:
    """One request: an ``ApiError`` becomes its message and an exit code."""
    with client(controller, token_file, wait_s=wait_s) as api:
        try:
            return send(api)
        except ApiError as e:
            raise _refused(str(e)) if e.status in STATE_STATUSES else _fail(str(e))


def _no_etcd(etcd: str | None) -> None:
    if etcd is not None:
        raise typer.BadParameter("ftsystem job goes through the controller's API: give "
                                 f"--controller URL (or {ENV_CONTROLLER}) and the job's token, "
                                 "not --etcd", param_hint="--etcd")


def _refused(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(STATE_ERROR)


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
           wait: float = typer.Option(0.0, min=0.0, envvar=ENV_WAIT, help="seconds to retry "
                                      "while the controller does not answer (a deployment "
                                      "step that may start first)"),
           controller: str = CONTROLLER, token_file: Optional[Path] = TOKEN_FILE,
           etcd: Optional[str] = ETCD) -> None:
    """Create a job: store its spec. Refused if the job exists (delete it first)."""
    from ftsystem.control import jobs
    _check_id("job", job)
    _no_etcd(etcd)
    raw = spec_from_options(spec_file, {
        "replicas": replicas, "min_replicas": min_replicas,
        "nodes_per_replica": nodes_per_replica, "nproc_per_node": nproc_per_node,
        "timeout_s": timeout, "num_steps": steps, "replica_ids": replica_ids,
        "checkpoint_every_steps": checkpoint_every, "checkpoint_dir": checkpoint_dir,
        "checkpoint_keep": checkpoint_keep})
    try:  # checked here too: a malformed spec is refused before any request
        jobs.parse_spec(raw)
    except jobs.JobSpecError as e:
        raise _fail(f"{e}; nothing was stored")
    created = request(controller, token_file, lambda api: api.post(
        f"/v1/jobs/{job}", raw, **({"exist_ok": "true"} if exist_ok else {})), wait_s=wait)
    typer.echo(json.dumps(created, indent=2))


@job_app.command("get")
def get(job: str = typer.Argument(..., help="job id"), controller: str = CONTROLLER,
        token_file: Optional[Path] = TOKEN_FILE, etcd: Optional[str] = ETCD) -> None:
    """Print the job's spec, leader, epoch and replicas (JSON)."""
    _check_id("job", job)
    _no_etcd(etcd)
    view = request(controller, token_file, lambda api: api.get(f"/v1/jobs/{job}"))
    if view["spec"] is None:
        raise _refused(f"no job {job!r}: create it with `ftsystem job create {job} --replicas "
                       "N`")
    typer.echo(json.dumps(view, indent=2))


@job_app.command("outcome")
def outcome(job: str = typer.Argument(..., help="job id"), controller: str = CONTROLLER,
            token_file: Optional[Path] = TOKEN_FILE, etcd: Optional[str] = ETCD) -> None:
    """Whether every replica finished: exit 0, or 1 with a line per replica that did not.
    Read once the agents are gone (the end of docker/slurm/ftsystem.sbatch)."""
    _check_id("job", job)
    _no_etcd(etcd)
    read = request(controller, token_file, lambda api: api.get(f"/v1/jobs/{job}/outcome"))
    if read["unfinished"]:
        raise _refused("; ".join(read["unfinished"]))
    typer.echo(f"job {job}: every replica finished")


@job_app.command("list")
def list_(controller: str = CONTROLLER, token_file: Optional[Path] = TOKEN_FILE,
          etcd: Optional[str] = ETCD) -> None:
    """One line per job with a spec in the controller's etcd: id, replicas, min replicas,
    nodes x ranks, created."""
    _no_etcd(etcd)
    for found in request(controller, token_file, lambda api: api.get("/v1/jobs"))["jobs"]:
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
           controller: str = CONTROLLER, token_file: Optional[Path] = TOKEN_FILE,
           etcd: Optional[str] = ETCD) -> None:
    """Delete every key of the job. Refused while it runs, unless --force."""
    _check_id("job", job)
    _no_etcd(etcd)
    request(controller, token_file, lambda api: api.delete(
        f"/v1/jobs/{job}", **({"force": "true"} if force else {})))
    typer.echo(f"deleted job {job}")
