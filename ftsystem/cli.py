"""The ``ftsystem`` command line: one entry point, one sub-command per component.

Heavy imports (torch, uvicorn) happen inside the commands that need them, so ``--help`` and
the light commands stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="ftsystem: fault-tolerant training jobs (FT-HSDP, HALoS).")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: each prints a table and writes JSON.")
sim_app = typer.Typer(no_args_is_help=True, help="Simulators for scales that do not fit here.")
chaos_app = typer.Typer(no_args_is_help=True, help="Failure injection.")
app.add_typer(bench_app, name="bench")
app.add_typer(sim_app, name="sim")
app.add_typer(chaos_app, name="chaos")

SIM_EXTRA = ("matplotlib", "simpy")
"""What ``ftsystem sim`` needs beyond the core (the ``[sim]`` extra)."""


@sim_app.callback()
def _sim_needs_its_extra() -> None:
    missing = [name for name in SIM_EXTRA if not _importable(name)]
    if missing:
        typer.echo(f"error: ftsystem sim needs {' and '.join(missing)}, which this install "
                   "lacks: pip install 'ftsystem[sim]' (or '.[sim]' from a checkout)", err=True)
        raise typer.Exit(2)


def _importable(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


ETCD_HELP = "etcd endpoints, comma-separated (e.g. http://127.0.0.1:2379, https:// for TLS)"
# The names the ranks already read (ftsystem.training.runtime.ENV_ETCD, ENV_JOB): one setting for all.
ENV_ETCD, ENV_JOB = "FTSYSTEM_ETCD", "FTSYSTEM_JOB"
# etcd over TLS (ftsystem.control.etcd_tls): what every process reads, and its children inherit.
ETCD_CA = typer.Option(None, "--etcd-ca", envvar="FTSYSTEM_ETCD_CA", help="PEM file of the CA "
                       "that signed etcd's certificate (https:// endpoints)")
ETCD_CERT = typer.Option(None, "--etcd-cert", envvar="FTSYSTEM_ETCD_CERT", help="PEM file of "
                         "the client certificate etcd requires (--client-cert-auth)")
ETCD_KEY = typer.Option(None, "--etcd-key", envvar="FTSYSTEM_ETCD_KEY",
                        help="PEM file of the client certificate's private key")
ADVERTISE_HELP = ("address peers and Prometheus reach this process at (default: "
                  "$POD_IP on Kubernetes, else this host's routable address)")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version
        try:
            typer.echo(f"ftsystem {version('ftsystem')}")
        except PackageNotFoundError:
            typer.echo("ftsystem (not installed: run pip install -e .)")
        raise typer.Exit()


@app.callback()
def _main(_version_flag: bool = typer.Option(False, "--version", callback=_version,
                                             is_eager=True, help="print the version and exit")
          ) -> None:
    """ftsystem: fault-tolerant training jobs (FT-HSDP, HALoS)."""


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)


def _etcd_tls(ca: Optional[Path], cert: Optional[Path], key: Optional[Path]) -> None:
    """Check the client's etcd certificates and set them for this process's clients and its
    children (controllers, agents, ranks)."""
    from ftsystem.control.etcd_tls import EtcdTlsError, export_client_files
    try:
        export_client_files(ca, cert, key)
    except EtcdTlsError as e:
        raise typer.BadParameter(str(e), param_hint="--etcd-ca/--etcd-cert/--etcd-key") from e


def _timeouts(timeout_s: float):
    from ftsystem.control.timeouts import TimeoutConfigError, Timeouts
    try:
        return Timeouts(timeout_s)
    except TimeoutConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--timeout") from e


def _check_id(kind: str, value: str) -> str:
    from ftsystem.control.keys import InvalidIdError, check_id
    try:
        return check_id(kind, value)
    except InvalidIdError as e:
        raise typer.BadParameter(str(e)) from e


@app.command()
def etcd(data_dir: Optional[Path] = typer.Option(None, help="data directory (default: a temp dir)"),
         port: int = typer.Option(2379, help="client port"),
         host: str = typer.Option("127.0.0.1", help="the address clients reach it at: it "
                                  "listens there and on loopback, never on every address"),
         cert: Optional[Path] = typer.Option(None, help="PEM certificate of this etcd (valid "
                                             "for --host): serve https:// only"),
         key: Optional[Path] = typer.Option(None, help="PEM private key of --cert"),
         client_ca: Optional[Path] = typer.Option(None, help="PEM CA whose client "
                                                  "certificates it accepts (no others)")) -> None:
    """Run a single-node etcd until stopped (Ctrl-C), on loopback (and --host); with --cert,
    --key and --client-ca it serves TLS to clients with a certificate of that CA."""
    import signal
    from ftsystem.control.etcd_server import EmbeddedEtcd, EtcdNotInstalledError, EtcdStartError
    from ftsystem.control.etcd_tls import EtcdTlsError, ServerTls
    given = [v is not None for v in (cert, key, client_ca)]
    if any(given) and not all(given):
        raise typer.BadParameter("TLS needs all three: --cert and --key (this etcd's) and "
                                 "--client-ca (whose clients it serves)", param_hint="--cert")
    try:
        tls = ServerTls(cert=cert, key=key, client_ca=client_ca) if all(given) else None
    except EtcdTlsError as e:
        raise typer.BadParameter(str(e), param_hint="--cert/--key/--client-ca") from e
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # delivered to sigwait below
    try:
        server = EmbeddedEtcd(data_dir=data_dir, port=port, host=host, tls=tls).start()
    except (EtcdNotInstalledError, EtcdStartError) as e:
        raise _fail(str(e))
    typer.echo(f"etcd serving at {server.url} (data in {server.data_dir})", err=True)
    try:
        signal.sigwait(stop_signals)
    finally:
        server.stop()


@app.command()
def controller(etcd: str = typer.Option(..., envvar=ENV_ETCD, help=ETCD_HELP),
               job: str = typer.Option(..., envvar=ENV_JOB,
                                       help="the job this controller manages"),
               port: int = typer.Option(8080, help="REST API port"),
               bind: str = typer.Option("127.0.0.1", envvar="FTSYSTEM_BIND",
                                        help="address to listen on: loopback unless given "
                                             "(a pod's or container's: 0.0.0.0)"),
               advertise_address: Optional[str] = typer.Option(
                   None, envvar="FTSYSTEM_ADVERTISE_ADDRESS", help=ADVERTISE_HELP),
               host: Optional[str] = typer.Option(None, hidden=True,
                                                  help="old: --bind and --advertise-address"),
               insecure: bool = typer.Option(False, help="serve without an API token: anyone "
                                             "who reaches the port may read and POST (chaos)"),
               public_read: bool = typer.Option(False, help="serve GET and HEAD (the job's "
                                                "state, the status page, /metrics) without "
                                                "the token; mutations still need it"),
               min_replicas: Optional[int] = typer.Option(
                   None, hidden=True, help="old: the job's spec sets it (ftsystem job create)"),
               instance_id: Optional[str] = typer.Option(None, help="name in leader election"),
               etcd_ca: Optional[Path] = ETCD_CA, etcd_cert: Optional[Path] = ETCD_CERT,
               etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """Run a controller instance: leader election, membership epochs, REST API, /metrics.
    Every request but /healthz and /readyz needs the job's token, FTSYSTEM_API_TOKEN (or
    FTSYSTEM_API_TOKEN_FILE), unless --insecure; reads need none with --public-read."""
    from controller.main import serve
    from ftsystem.control.addresses import default_advertise_address
    from ftsystem.control.store import parse_endpoints
    _check_id("job", job)
    if instance_id is not None:
        _check_id("controller instance", instance_id)
    _etcd_tls(etcd_ca, etcd_cert, etcd_key)
    try:
        parse_endpoints(etcd)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--etcd") from e
    if min_replicas is not None:
        typer.secho("warning: --min-replicas has no effect: the job's spec sets it (ftsystem "
                    "job create --min-replicas)", err=True, fg=typer.colors.YELLOW)
    from ftsystem.control.store import StoreError
    try:
        serve(etcd=etcd, job=job, port=port, bind=host or bind,
              advertise_address=host or advertise_address or default_advertise_address(),
              instance_id=instance_id, insecure=insecure, public_read=public_read)
    except (StoreError, ValueError) as e:  # AuthConfigError, a malformed FTSYSTEM_CHAOS_RATE
        raise _fail(str(e))


@app.command(context_settings={"allow_interspersed_args": False})
def agent(command: List[str] = typer.Argument(..., help="the replica's program, after --"),
          etcd: str = typer.Option(..., envvar=ENV_ETCD, help=ETCD_HELP),
          job: str = typer.Option(..., envvar=ENV_JOB, help="job id"),
          replica_id: str = typer.Option(..., help="the replica this agent supervises a node of"),
          node_rank: Optional[int] = typer.Option(None, min=0, help="this node's place in the "
                                                  "replica, 0..nodes-1 (torchrun's GROUP_RANK);"
                                                  " default 0 for a replica of one node"),
          nodes: int = typer.Option(1, min=1, help="nodes per replica, one agent each"),
          nproc_per_node: int = typer.Option(1, min=1, help="ranks on this node"),
          nproc_per_replica: Optional[int] = typer.Option(
              None, min=1, hidden=True, help="old name of --nproc-per-node (one node)"),
          spare: bool = typer.Option(False, help="a standby agent: takes over the first node "
                                     "rank of the replica that falls free"),
          node_id: Optional[str] = typer.Option(None, help="the machine (default: hostname): an "
                                                "agent restarted on it takes its rank back"),
          peer_timeout: float = typer.Option(1.0, min=0.2, help="seconds of silence after "
                                             "which a peer node counts as dead or cut off"),
          kill_at: List[str] = typer.Option([], help="kill the replica at STEP[:PHASE]"),
          max_restarts: int = typer.Option(20, min=0),
          timeout: Optional[float] = typer.Option(
              None, help="the one timeout: watchdog and lease TTL are a third of it; default: "
                         "the job spec's (ftsystem job create --timeout), which this must match"),
          advertise_address: Optional[str] = typer.Option(
              None, "--advertise-address", "--host", envvar="FTSYSTEM_ADVERTISE_ADDRESS",
              help=ADVERTISE_HELP + "; the replica's ranks listen on it too"),
          bind: Optional[str] = typer.Option(None, envvar="FTSYSTEM_BIND", help="address the "
                                             "metrics endpoints listen on (e.g. 0.0.0.0); "
                                             "default: the advertised address"),
          metrics_port: Optional[int] = typer.Option(
              None, min=1, max=65535, envvar="FTSYSTEM_METRICS_PORT", help="fixed metrics "
              "port: the agent serves on it, the rank of local rank k on PORT+1+k; default: "
              "free ports, found through the controller's /v1/sd/prometheus"),
          gpus: str = typer.Option("", help="one GPU per rank, e.g. 0,1,2,3: rank k sees only "
                                   "the k-th (CUDA_VISIBLE_DEVICES); default: every rank sees "
                                   "the node's GPUs and uses cuda:LOCAL_RANK"),
          insecure: bool = typer.Option(False, help="run the ranks without the job's token: "
                                        "their state servers hand the weights to anyone who "
                                        "reaches them"),
          etcd_ca: Optional[Path] = ETCD_CA, etcd_cert: Optional[Path] = ETCD_CERT,
          etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """Supervise one node of a replica: meet the replica's other agents, launch this node's
    ranks, restart the replica with them when any part of it fails.

    Needs the job's token in FTSYSTEM_API_TOKEN (or FTSYSTEM_API_TOKEN_FILE), unless
    --insecure: its ranks get the state servers' key derived from it, never the token."""
    import os
    from agent.main import run_agent
    from agent.supervisor import AgentConfig, parse_gpus
    from ftsystem.chaos.faults import parse_fault_point
    _check_id("job", job)
    _check_id("replica", replica_id)
    _etcd_tls(etcd_ca, etcd_cert, etcd_key)  # the ranks inherit them
    try:
        points = [parse_fault_point(p) for p in kill_at]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kill-at") from e
    try:
        gpu_list = parse_gpus(gpus)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--gpus") from e
    from ftsystem.control.store import StoreError
    from ftsystem.measure import metrics
    from ftsystem.control.addresses import default_advertise_address
    if timeout is not None:
        _timeouts(timeout)
    host = advertise_address or default_advertise_address()
    # Read by metrics.serve here and in the ranks, which inherit this environment.
    for name, value in ((metrics.ENV_BIND, bind), (metrics.ENV_METRICS_PORT, metrics_port)):
        if value is not None:
            os.environ[name] = str(value)
    if spare and node_rank is not None:
        raise typer.BadParameter("a spare takes whichever node rank falls free: give either "
                                 "--spare or --node-rank", param_hint="--spare")
    if node_rank is None and not spare and nodes > 1:
        raise typer.BadParameter(f"a replica of {nodes} nodes needs each agent's --node-rank "
                                 f"(0..{nodes - 1}), or --spare", param_hint="--node-rank")
    cfg = AgentConfig(etcd=etcd, job=job, replica_id=replica_id, command=command,
                      node_rank=None if spare else (node_rank or 0), nodes=nodes,
                      nproc_per_node=nproc_per_replica or nproc_per_node,
                      max_restarts=max_restarts, peer_timeout_s=peer_timeout,
                      timeout_s=timeout,
                      kill_at=points, host=host, gpus=gpu_list, insecure=insecure,
                      **({"node_id": node_id} if node_id else {}))
    try:
        code = run_agent(cfg)
    except (StoreError, ValueError) as e:
        raise _fail(str(e))
    raise typer.Exit(code)


@app.command()
def run(replicas: int = typer.Option(4, min=1, help="data-parallel replicas"),
        steps: int = typer.Option(300, min=1, help="committed steps to train"),
        nodes_per_replica: int = typer.Option(1, min=1, help="nodes per replica, one agent each "
                                              "(with --netns, each in its own namespace)"),
        nproc_per_node: int = typer.Option(1, min=1, help="ranks per node: the model is "
                                           "sharded over all ranks of a replica with FSDP2"),
        nproc_per_replica: Optional[int] = typer.Option(None, min=1, hidden=True,
                                                        help="old name of --nproc-per-node"),
        tp: int = typer.Option(1, min=1, help="tensor-parallel degree inside each replica, a "
                               "divisor of its ranks: they form a (dp_shard, tp) mesh"),
        min_replicas: int = typer.Option(1, min=1, help="pause below this many replicas"),
        kill_at: List[str] = typer.Option(
            [], help="inject a fault: STEP:REPLICA[:PHASE], PHASE step (SIGKILL between "
                     "steps, default), allreduce (SIGKILL mid-all-reduce) or fail-allreduce"),
        etcd: Optional[str] = typer.Option(None, envvar=ENV_ETCD,
                                           help=ETCD_HELP + "; default: embedded"),
        job: str = typer.Option("job", envvar=ENV_JOB, help="job id"),
        out: Path = typer.Option(Path("runs/latest"), help="results, logs and summary"),
        model_params: int = typer.Option(0, help="approximate model size (0: small default)"),
        sleep_per_step: float = typer.Option(0.0, help="extra seconds per step"),
        timeout: float = typer.Option(30.0, help="the one timeout (FTSYSTEM_TIMEOUT_S)"),
        port: int = typer.Option(0, help="controller REST port (0: free port)"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write the summary here"),
        chaos: Optional[Path] = typer.Option(None, help="a chaos spec (YAML/JSON) to inject"),
        netns: bool = typer.Option(False, help="run each node's agent in its own network "
                                   "namespace (root; needed by partition and host actions)"),
        etcd_members: int = typer.Option(1, min=1, help="members of the embedded etcd "
                                         "(3 for etcd-member-kill)"),
        checkpoint_every: int = typer.Option(0, min=0, help="disk checkpoints every N steps "
                                             "in OUT/checkpoints, for a whole-job restart"),
        mtbf: Optional[str] = typer.Option(None, help="kill a random replica with this mean "
                                                      "time between failures, e.g. 30s"),
        etcd_ca: Optional[Path] = ETCD_CA, etcd_cert: Optional[Path] = ETCD_CERT,
        etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """Run a fault-tolerant training job here, inject failures, and report."""
    from ftsystem.launch.launcher import RunConfig, parse_replica_kill, run_job
    from ftsystem.measure.report import print_table, write_json
    _check_id("job", job)
    _timeouts(timeout)
    _etcd_tls(etcd_ca, etcd_cert, etcd_key)  # for the --etcd given: the embedded one is plain
    if min_replicas > replicas:
        raise typer.BadParameter(f"{min_replicas} > --replicas {replicas}",
                                 param_hint="--min-replicas")
    try:
        kills = [parse_replica_kill(k, replicas) for k in kill_at]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kill-at") from e
    from ftsystem.chaos.spec import ChaosSpecError, parse_specs, spec_from_mapping
    try:
        specs = parse_specs(chaos.read_text()) if chaos else [spec_from_mapping(
            {"action": "kill", "schedule": {"mtbf": mtbf}, "horizon": "24h"})] if mtbf else []
    except (OSError, ChaosSpecError) as e:
        raise typer.BadParameter(str(e), param_hint="--chaos/--mtbf") from e
    ranks = nodes_per_replica * (nproc_per_replica or nproc_per_node)
    if ranks % tp:
        raise typer.BadParameter(f"{tp} does not divide a replica's {ranks} ranks "
                                 "(--nodes-per-replica x --nproc-per-node)", param_hint="--tp")
    train_args = ["--model-params", str(model_params), "--sleep-per-step", str(sleep_per_step),
                  *(["--tp", str(tp)] if tp > 1 else [])]
    cfg = RunConfig(chaos=specs, num_replicas=replicas, num_steps=steps, min_replicas=min_replicas,
                    nodes_per_replica=nodes_per_replica,
                    nproc_per_node=nproc_per_replica or nproc_per_node,
                    etcd=etcd, job=job, kills=kills, out_dir=out, train_args=train_args,
                    timeout_s=timeout, controller_ports=[port], netns=netns,
                    etcd_members=etcd_members, checkpoint_every=checkpoint_every)
    from ftsystem.control.etcd_server import EtcdNotInstalledError, EtcdStartError
    from ftsystem.launch.netns import NetnsError
    from ftsystem.control.store import StoreError
    import signal
    import sys
    # A SIGTERM unwinds like Ctrl-C, so that namespaces and processes are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        summary = run_job(cfg)
    except (StoreError, EtcdNotInstalledError, EtcdStartError, NetnsError, ValueError) as e:
        raise _fail(str(e))
    print_table(f"job {job}: failures", FAILURE_COLUMNS, failure_rows(summary["failures"]))
    print_table(f"job {job}: summary", ["steps", "failures", "median stall (s)",
                                        "median step (s)", "ETTR time", "ETTR work",
                                        "eval loss", "bitwise identical"],
                [(summary["steps"], len(summary["failures"]), summary["stall_s"]["median"],
                  summary["step_time_s"]["median"], summary["ettr_time"], summary["ettr_work"],
                  ", ".join(f"{x:.4f}" for x in summary["eval_loss"]),
                  summary["bitwise_identical"])])
    write_json(json_out, summary)
    if not (summary["bitwise_identical"] and summary["agents_ok"]):
        raise typer.Exit(1)


FAILURE_COLUMNS = ("replica", "at step", "reason", "survivor stall (s)",
                   "former measure, whole steps (s)", "resolution (s)")
"""The failures table of ``ftsystem run``: the stall (``ftsystem.measure.stall``) beside the
whole-step measure that earlier reports quoted, and the noise under which a stall is jitter."""


def failure_rows(failures: List[dict]) -> List[tuple]:
    """One row of ``FAILURE_COLUMNS`` per failure record; "-" where nothing was measured."""
    return [(f["replica"], f["step"], f["reason"],
             *("-" if f.get(k) is None else f[k]
               for k in ("stall_s", "whole_steps_s", "resolution_s"))) for f in failures]


@chaos_app.command("apply")
def chaos_apply(spec_file: Path = typer.Argument(..., help="chaos spec, YAML or JSON"),
                etcd: str = typer.Option(..., envvar=ENV_ETCD, help=ETCD_HELP),
                job: str = typer.Option(..., envvar=ENV_JOB, help="job id"),
                etcd_ca: Optional[Path] = ETCD_CA, etcd_cert: Optional[Path] = ETCD_CERT,
                etcd_key: Optional[Path] = ETCD_KEY) -> None:
    """Validate chaos specs (one or several YAML documents) and store their orders directly in
    etcd. This bypasses the controller's API and its token: it needs etcd credentials. The
    validation and the rate limit (FTSYSTEM_CHAOS_RATE) are the API's. Through the API: POST
    /v1/jobs/{job}/chaos with the bearer token."""
    import asyncio
    import time
    from ftsystem.chaos import rate as chaos_rate
    from ftsystem.chaos.spec import ChaosSpecError, parse_specs, submit
    from ftsystem.control.store import Store, StoreError
    _check_id("job", job)
    _etcd_tls(etcd_ca, etcd_cert, etcd_key)
    try:
        limit, window_s = chaos_rate.configured_rate()
    except ValueError as e:
        raise _fail(str(e))
    try:
        specs = parse_specs(spec_file.read_text())
    except (OSError, ChaosSpecError) as e:
        raise _fail(f"{spec_file}: {e}; nothing was stored")
    typer.secho("note: chaos apply writes to etcd directly, bypassing the controller's API "
                "and its token; it needs etcd credentials. With a controller running, prefer "
                "POST /v1/jobs/<job>/chaos.", err=True, fg=typer.colors.YELLOW)

    async def store_orders():
        async with Store(etcd) as store:
            await chaos_rate.take(store, job, limit, window_s)
            return await submit(store, job, specs, f"cli-{int(time.time() * 1000)}",
                                now=time.time())
    try:
        orders = asyncio.run(store_orders())
    except (StoreError, ValueError, chaos_rate.ChaosRateError) as e:  # ValueError: specs, TLS
        raise _fail(f"{e}; nothing was stored")
    for order in orders:
        typer.echo(f"{order.id}\t{order.action}\t{order.replica}\tat {order.at:.1f}")


SUBCOMMAND_MODULES = (
    "ftsystem.benchmarks.controller.command", "ftsystem.benchmarks.failover",
    "ftsystem.benchmarks.overhead", "ftsystem.benchmarks.rejoin", "ftsystem.benchmarks.ettr_bench",
    "ftsystem.benchmarks.gradsum", "ftsystem.benchmarks.soak", "ftsystem.benchmarks.fingerprint",
    "ftsystem.benchmarks.campaign",
    "ftsystem.sim.ettr_cli", "ftsystem.halos.cli", "ftsystem.control.jobs_cli",
    "ftsystem.control.status_cli")
"""Modules that register their sub-commands (``bench``, ``sim``, ``halos``, ``job``, ``status``,
``watch``) on the apps
above when imported. Together they import numpy, the launcher and the simulators: 0.3 s of CPU."""
LEAN_COMMANDS = frozenset({"etcd", "controller", "agent", "run", "chaos"})
"""The commands of this module, which need none of those: ``main`` skips them there. An agent
starts with every generation of its replica, on a host where other replicas train."""


def register_subcommands() -> None:
    """Load every sub-command onto ``app`` (what ``main`` does unless the command is lean), for
    a program that drives the whole CLI itself, e.g. with a test runner."""
    import importlib
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name)


def _command_named(argv: List[str]) -> Optional[str]:
    """The sub-command ``argv`` names: its first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main() -> None:
    import sys
    if _command_named(sys.argv[1:]) not in LEAN_COMMANDS:
        register_subcommands()
    app()


if __name__ == "__main__":
    # ``python -m ftsystem.cli`` runs this file as ``__main__``, a second module beside the
    # ``ftsystem.cli`` the sub-command modules register on: run that one's app.
    from ftsystem.cli import main as registered_main
    registered_main()
