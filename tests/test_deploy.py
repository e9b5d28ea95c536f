"""docker/: images, compose file, Prometheus config and Kubernetes manifests.

No container engine runs here, so the files are checked by parsing them and by running what
they run directly on this machine: every ftsystem command line (the image's entrypoint plus the
compose command or the manifest's args, $(VARS) expanded) goes through the real CLI; the etcd
commands start real etcd servers (a 3-member cluster for Kubernetes); the controller runs as the
compose file has it, importing only what its image installs, and a real Prometheus discovers it
with docker/prometheus.yml. Only addresses, ports, paths and intervals are substituted.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import typer.main
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from conftest import wait_for
from ftsystem.cli import app
from ftsystem.etcd_server import etcd_binary, free_port

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
TARGETS = {"controller": ["ftsystem", "controller"], "agent": ["ftsystem", "agent"],
           "worker": ["ftsystem"]}
"""Each image target and the entrypoint it must have."""
CONTROLLER_LEAVES_OUT = {"torch", "torchft", "torchdata"}
API_VERSIONS = {"Namespace": "v1", "ConfigMap": "v1", "Service": "v1", "StatefulSet": "apps/v1",
                "Deployment": "apps/v1", "Job": "batch/v1", "PodDisruptionBudget": "policy/v1"}
POD_FIELDS = {"metadata.name": "ftsystem-controller-7d4b9c8f6d-x2x7k", "status.podIP": "10.1.2.3"}
"""Sample values of the downward API fields the manifests use."""


# --- Dockerfile -------------------------------------------------------------------------------

@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def dockerfile_stages(path: Path = DOCKER / "Dockerfile") -> dict[str, Stage]:
    """The stages of a Dockerfile, in order, with their instructions (continuations joined)."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        logical.append(pending + text)
        pending = ""
    stages: dict[str, Stage] = {}
    build_args: dict[str, str] = {}
    for instruction in logical:
        keyword, _, rest = instruction.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            build_args[name] = default
        elif keyword == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)], rest).split()
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else str(len(stages))
            stages[name] = Stage(name, words[0])
        else:
            list(stages.values())[-1].instructions.append((keyword, rest))
    return stages


def stage_chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The target and the stages it is built FROM, the first one first."""
    chain = [stages[target]]
    while chain[0].base in stages:
        chain.insert(0, stages[chain[0].base])
    return chain


def image_argv(target: str) -> tuple[list[str], list[str]]:
    """ENTRYPOINT and CMD of an image, as Docker inherits them (ENTRYPOINT resets CMD)."""
    entrypoint: list[str] = []
    cmd: list[str] = []
    for stage in stage_chain(dockerfile_stages(), target):
        for keyword, rest in stage.instructions:
            if keyword in ("ENTRYPOINT", "CMD"):
                value = json.loads(rest)  # the exec form: ftsystem itself gets SIGTERM
                entrypoint, cmd = (value, []) if keyword == "ENTRYPOINT" else (entrypoint, value)
    return entrypoint, cmd


def run_lines(target: str) -> list[str]:
    return [rest for stage in stage_chain(dockerfile_stages(), target)
            for keyword, rest in stage.instructions if keyword == "RUN"]


def test_dockerfile_targets_have_ftsystem_entrypoints(monkeypatch):
    stages = dockerfile_stages()
    subcommands = set(typer.main.get_command(app).commands)
    for target, entrypoint in TARGETS.items():
        assert stage_chain(stages, target)[0].base.startswith("python:3.11-slim"), target
        got, cmd = image_argv(target)
        assert got == entrypoint, (target, got)
        assert (got + cmd)[1] in subcommands, f"{target}: {(got + cmd)[1]} is no ftsystem command"
        users = [rest for stage in stage_chain(stages, target)
                 for keyword, rest in stage.instructions if keyword == "USER"]
        assert users and users[-1] not in ("root", "0"), f"{target} runs as root"
    entrypoint, cmd = image_argv("worker")
    worker = check_command(entrypoint + cmd, monkeypatch)["cfg"]
    assert str(worker.out_dir).startswith("/data/")  # the directory the image's user owns


def test_dockerfile_copies_exist_and_images_hold_what_they_run():
    stages = dockerfile_stages()
    for stage in stages.values():
        for keyword, rest in stage.instructions:
            if keyword == "COPY" and rest.startswith("--from="):
                source = rest.split()[0].removeprefix("--from=")
                assert source in stages, f"COPY --from={source}: no such stage"
            elif keyword == "COPY":
                for source in rest.split()[:-1]:
                    assert (REPO / source).exists(), f"COPY {source}: not in the build context"
    worker = " && ".join(run_lines("worker"))
    assert "setpriv" in worker and "util-linux" in worker  # the agent wraps children with it
    pinned = re.search(r"pip install -q (torch==\S+)",
                       (REPO / "scripts/install.sh").read_text()).group(1)
    assert re.search(rf"pip install {re.escape(pinned)} --index-url \$\{{TORCH_INDEX\}}", worker)
    assert any("TORCH_INDEX=https://download.pytorch.org/whl/cpu" in rest
               for _, rest in stages["worker"].instructions)
    assert not any("pip install torch" in line for line in run_lines("controller"))


def controller_requirements(directory: Path) -> list[str]:
    """Runs the controller image's RUN lines that write requirements files (with /bin/sh, as
    Docker does); returns the list it installs."""
    shutil.copy(REPO / "pyproject.toml", directory)
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for line in run_lines("controller"):
        if re.search(r">\s*requirements", line):
            subprocess.run(["/bin/sh", "-ec", line], cwd=directory, env=env, check=True)
    return [r for r in (directory / "requirements-controller.txt").read_text().splitlines() if r]


def test_controller_image_leaves_out_only_the_heavy_dependencies(tmp_path):
    declared = {canonicalize_name(Requirement(r).name) for r in
                tomllib.loads((REPO / "pyproject.toml").read_text())
                ["project"]["dependencies"]}
    kept = {canonicalize_name(Requirement(r).name) for r in controller_requirements(tmp_path)}
    assert kept == declared - CONTROLLER_LEAVES_OUT
    assert not installed_closure(kept) & CONTROLLER_LEAVES_OUT


def installed_closure(names: set[str]) -> set[str]:
    """Distributions these need, transitively, as installed here (extras left out)."""
    todo, seen = [Requirement(n) for n in names], set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in importlib.metadata.requires(name) or []]
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


# --- the CLI, as the images' command lines call it ---------------------------------------------

class Started(Exception):
    """Raised in place of starting the component, once the CLI has parsed everything."""


def check_command(argv: list[str], monkeypatch) -> dict:
    """Parse ``ftsystem ...`` with the real CLI; returns the arguments of the component's start.

    Also checks the replica program after ``--`` (``python -m ftsystem.train ...``) with its own
    parser.
    """
    assert argv[0] == "ftsystem", argv
    started: dict = {}

    def capture(*args, **kwargs):
        started.update(kwargs or {"cfg": args[0]})
        raise Started

    monkeypatch.setattr("controller.main.serve", capture)
    monkeypatch.setattr("agent.main.run_agent", capture)
    monkeypatch.setattr("ftsystem.launcher.run_job", capture)
    monkeypatch.setenv("FTSYSTEM_TIMEOUT_S", "30")  # `agent` sets it; restored afterwards
    result = CliRunner().invoke(app, argv[1:])
    assert isinstance(result.exception, Started), f"{argv}:\n{result.output}{result.exception!r}"
    cfg = started.get("cfg")
    if argv[1] == "agent":
        assert cfg.command[:3] == ["python", "-m", "ftsystem.train"], cfg.command
        from ftsystem.train import parse_args
        started["train"] = parse_args(cfg.command[3:])
    return started


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- compose ----------------------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def compose_argv(service: dict) -> list[str]:
    """The whole command line of a service built from docker/Dockerfile."""
    entrypoint, cmd = image_argv(service["build"]["target"])
    return entrypoint + (service.get("command") or cmd)


def agent_services() -> dict[str, dict]:
    return {name: s for name, s in compose()["services"].items()
            if s.get("build", {}).get("target") == "agent"}


def test_compose_has_every_service_and_builds_real_targets():
    services = compose()["services"]
    assert {"etcd", "controller", "prometheus", "grafana"} <= set(services)
    assert len(agent_services()) == 2
    assert services["etcd"]["image"].startswith(("quay.io/coreos/etcd:v3.5.", "bitnami/etcd:"))
    for name, service in services.items():
        if "build" not in service:
            continue
        build = service["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == \
            DOCKER / "Dockerfile", name
        assert build["target"] in dockerfile_stages(), name
        assert service["image"].split(":")[0] == f"ftsystem-{build['target']}", name


def test_compose_commands_are_ftsystem_commands(monkeypatch):
    services = compose()["services"]
    etcd_url = "http://etcd:2379"
    assert f"--advertise-client-urls={etcd_url}" in services["etcd"]["command"]
    argv = compose_argv(services["controller"])
    started = check_command(argv, monkeypatch)
    # The controller advertises --host:--port to Prometheus: it must be its service name.
    assert (started["etcd"], started["host"]) == (etcd_url, "controller")
    shards = {}
    for name, service in agent_services().items():
        argv = compose_argv(service)
        started = check_command(argv, monkeypatch)
        cfg = started["cfg"]
        assert (cfg.etcd, cfg.job) == (etcd_url, option(compose_argv(services["controller"]),
                                                        "--job"))
        assert cfg.host == name, f"{name}: peers reach it by its service name, not {cfg.host}"
        shards[cfg.replica_id] = started["train"].data_shard
        assert any(str(started["train"].out).startswith(v.split(":")[1])
                   for v in service["volumes"]), f"{name}: results outside the volume"
    assert sorted(shards.values()) == list(range(len(shards))), shards


def compose_cli() -> list[str] | None:
    """``docker compose`` (v2), as a Docker CLI plugin or standalone, if installed."""
    for cli in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cli[0]):
            done = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True)
            if done.returncode == 0 and done.stdout.strip().lstrip("v").startswith("2."):
                return cli
    return None


def test_compose_cli_accepts_the_file():
    cli = compose_cli()
    if cli is None:
        pytest.skip("Docker Compose v2 is not installed")
    config = [*cli, "-f", str(DOCKER / "compose.yaml"), "config", "--format", "json"]
    env = {k: v for k, v in os.environ.items() if k != "FTSYSTEM_API_TOKEN"}
    done = subprocess.run(config, capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "FTSYSTEM_API_TOKEN" in done.stderr
    done = subprocess.run(config, capture_output=True, text=True,
                          env=env | {"FTSYSTEM_API_TOKEN": "x"})
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)["services"]
    assert set(resolved) == set(compose()["services"])
    for name, service in agent_services().items():
        assert resolved[name]["command"] == service["command"]


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``."""
    def one(m: re.Match) -> str:
        name, operator, argument = m.groups()
        if env.get(name):
            return env[name]
        assert operator != ":?", f"compose refuses to start without {name}: {argument}"
        return argument or ""
    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value)


def test_compose_controller_requires_an_api_token():
    from controller.auth import ENV_TOKEN, ENV_TOKEN_FILE
    environment = compose()["services"]["controller"]["environment"]
    assert set(environment) <= {ENV_TOKEN, ENV_TOKEN_FILE}
    with pytest.raises(AssertionError, match="refuses to start"):
        for value in environment.values():
            interpolate(value, {})


def test_prometheus_config_discovers_through_the_controller():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "config", str(DOCKER / "prometheus.yml")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    services = compose()["services"]
    argv = compose_argv(services["controller"])
    urls = [sd["url"] for job in prometheus_config()["scrape_configs"]
            for sd in job.get("http_sd_configs", [])]
    assert urls == [f"http://{option(argv, '--host')}:{option(argv, '--port')}/v1/sd/prometheus"]
    mounts = services["prometheus"]["volumes"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def prometheus_config() -> dict:
    return yaml.safe_load((DOCKER / "prometheus.yml").read_text())


def test_grafana_mounts_match_the_provisioning():
    provisioning = REPO / "dashboards/provisioning"
    if not provisioning.is_dir():
        pytest.skip("dashboards/provisioning does not exist yet")
    mounts = dict(v.split(":")[:2] for v in compose()["services"]["grafana"]["volumes"])
    assert mounts["../dashboards/provisioning"] == "/etc/grafana/provisioning"
    for path in (provisioning / "dashboards").glob("*.y*ml"):
        for provider in yaml.safe_load(path.read_text())["providers"]:
            assert provider["options"]["path"] == mounts["../dashboards"], path
    prometheus_port = compose()["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    for path in (provisioning / "datasources").glob("*.y*ml"):
        for source in yaml.safe_load(path.read_text())["datasources"]:
            if source["type"] == "prometheus":
                assert source["url"] == f"http://prometheus:{prometheus_port}", path


# --- running the same commands here -----------------------------------------------------------

def localize(text: str, addresses: dict[str, str]) -> str:
    """Replace every host:port of ``text`` by its local address; unknown ones are an error."""
    return re.sub(r"(?<![\w.-])([A-Za-z0-9][\w.-]*:\d+)(?!\d)", lambda m: addresses[m.group(1)],
                  text)


def start_etcd(args: list[str], directory: Path) -> subprocess.Popen:
    directory.mkdir(parents=True)
    args = [re.sub(r"^--data-dir=.*", f"--data-dir={directory / 'data'}", a) for a in args]
    with open(directory / "etcd.log", "wb") as log:
        return subprocess.Popen([etcd_binary(), *args], stdout=log, stderr=subprocess.STDOUT)


def etcd_healthy(client: str) -> bool:
    try:
        return httpx.get(f"http://{client}/health", timeout=1).json()["health"] == "true"
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_compose_etcd_command_serves(tmp_path):
    command = compose()["services"]["etcd"]["command"]
    client, peer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = [localize(a, {"0.0.0.0:2379": client, "etcd:2379": client,
                         "0.0.0.0:2380": peer, "etcd:2380": peer}) for a in command[1:]]
    procs = [start_etcd(args, tmp_path / "etcd")]
    try:
        wait_for(lambda: etcd_healthy(client), 20, f"etcd ({tmp_path}/etcd/etcd.log)")
    finally:
        stop(procs)


CONTROLLER_IMAGE_PYTHON = r"""
import importlib.abc, json, os, sys
left_out = set(json.loads(os.environ.pop("FTSYSTEM_TEST_LEFT_OUT")))
class NotInImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in left_out:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
sys.meta_path.insert(0, NotInImage())
sys.argv[0] = "ftsystem"
from ftsystem.cli import main
main()
"""
"""Runs the ftsystem CLI with the modules of every distribution the image lacks unimportable."""


def modules_left_out(installed: set[str]) -> list[str]:
    """Top-level modules that only distributions outside ``installed`` provide."""
    owners = importlib.metadata.packages_distributions()
    return sorted(module for module, dists in owners.items()
                  if not {canonicalize_name(d) for d in dists} & installed)


API_TOKEN = "test-token-0123456789"


@pytest.fixture(scope="module")
def compose_controller(etcd, tmp_path_factory):
    """The compose file's controller command, run here as its image would run it."""
    directory = tmp_path_factory.mktemp("controller")
    argv = compose_argv(compose()["services"]["controller"])
    port = free_port()
    argv = [localize(a, {"etcd:2379": etcd.url.removeprefix("http://")}) for a in argv]
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    # The project itself is installed with --no-deps; pip, setuptools and wheel come with the
    # base image.
    image = installed_closure({canonicalize_name(Requirement(r).name) for r in
                               controller_requirements(directory)}) | {
        "ftsystem", "pip", "setuptools", "wheel"}
    environment = {k: interpolate(v, {"FTSYSTEM_API_TOKEN": API_TOKEN})
                   for k, v in compose()["services"]["controller"].get("environment", {}).items()}
    env = os.environ | environment | {
        "FTSYSTEM_TEST_LEFT_OUT": json.dumps(modules_left_out(image))}
    log = directory / "controller.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", CONTROLLER_IMAGE_PYTHON, *argv[1:]],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or _get(f"http://127.0.0.1:{port}/healthz"), 60,
                 "the controller to serve")
        assert proc.poll() is None, log.read_text()
        yield {"address": f"127.0.0.1:{port}", "job": option(argv, "--job"), "etcd": etcd,
               "log": log}
    finally:
        stop([proc])


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


@pytest.mark.slow
def test_compose_controller_runs_with_its_image_dependencies_only(compose_controller):
    base = f"http://{compose_controller['address']}"
    health = httpx.get(f"{base}/healthz").json()
    assert health["status"] == "ok" and health["job"] == compose_controller["job"]
    groups = wait_for(lambda: httpx.get(f"{base}/v1/sd/prometheus").json(), 10,
                      "the controller to list itself for discovery")
    assert isinstance(groups, list)
    assert {"targets": [compose_controller["address"]], "labels": {
        "job": compose_controller["job"], "component": "controller",
        "instance_id": "controller-0"}} in groups
    assert httpx.get(f"{base}/metrics").status_code == 200
    chaos = f"{base}/v1/jobs/{compose_controller['job']}/chaos"
    assert httpx.post(chaos, json={}).status_code == 401
    # The token is taken; the (empty) spec is then refused, so nothing is injected.
    refused = httpx.post(chaos, json={}, headers={"Authorization": f"Bearer {API_TOKEN}"})
    assert refused.status_code in (400, 422), refused.text
    assert httpx.get(chaos).json()["orders"] == []
    healthcheck = compose()["services"]["controller"]["healthcheck"]["test"]
    assert healthcheck[:2] == ["CMD", "python"]
    probe = [localize(a, {"controller:8080": compose_controller["address"]})
             for a in healthcheck[2:]]
    assert subprocess.run([sys.executable, *probe], timeout=30).returncode == 0
    assert "Traceback" not in compose_controller["log"].read_text()


@pytest.mark.slow
def test_prometheus_scrapes_what_the_controller_lists(compose_controller, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    config = prometheus_config()
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            sd["refresh_interval"] = "1s"
    listen = f"127.0.0.1:{free_port()}"
    path = tmp_path / "prometheus.yml"
    path.write_text(localize(yaml.safe_dump(config), {
        "controller:8080": compose_controller["address"], "localhost:9090": listen,
        "etcd:2379": compose_controller["etcd"].url.removeprefix("http://")}))
    with open(tmp_path / "prometheus.log", "wb") as log:
        procs = [subprocess.Popen([prometheus, f"--config.file={path}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address={listen}"],
                                  stdout=log, stderr=subprocess.STDOUT)]
    try:
        wanted = {compose_controller["job"], "etcd", "prometheus"}
        wait_for(lambda: _up_jobs(listen) >= wanted, 30,
                 f"Prometheus to scrape the controller, etcd and itself ({tmp_path})")
        # honor_labels: the series keep ftsystem's own job label, without an exported_job copy.
        series = wait_for(lambda: _query(listen, "ftsystem_controller_is_leader"), 10,
                          "the controller's series")
        assert [s["metric"].get("job") for s in series] == [compose_controller["job"]]
        assert not any("exported_job" in s["metric"] for s in series)
    finally:
        stop(procs)


def _query(listen: str, expr: str) -> list[dict]:
    return httpx.get(f"http://{listen}/api/v1/query", params={"query": expr}).json()["data"][
        "result"]


def _up_jobs(listen: str) -> set[str]:
    reply = _get(f"http://{listen}/api/v1/targets")
    if reply is None or reply.status_code != 200:
        return set()
    return {t["labels"]["job"] for t in reply.json()["data"]["activeTargets"]
            if t["health"] == "up"}


# --- Kubernetes -------------------------------------------------------------------------------

def k8s_documents() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def k8s(kind: str) -> list[dict]:
    return [doc for doc in k8s_documents() if doc["kind"] == kind]


def pod_owners() -> list[dict]:
    return [d for d in k8s_documents() if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def test_k8s_manifests_are_listed_and_well_formed():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    for doc in k8s_documents():
        assert API_VERSIONS.get(doc["kind"]) == doc["apiVersion"], (doc["kind"], doc["apiVersion"])
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    kinds = {doc["kind"] for doc in k8s_documents()}
    assert {"StatefulSet", "Deployment", "Job", "Service"} <= kinds


def test_k8s_selectors_match_pod_templates():
    templates = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
                 for d in pod_owners()}
    for owner in pod_owners():
        if owner["kind"] == "Job":
            assert "selector" not in owner["spec"]  # generated by the Job controller
        else:
            assert owner["spec"]["selector"]["matchLabels"].items() <= \
                templates[owner["metadata"]["name"]].items(), owner["metadata"]["name"]
    for selecting in k8s("Service") + k8s("PodDisruptionBudget"):
        selector = selecting["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        chosen = [name for name, labels in templates.items() if selector.items() <= labels.items()]
        assert len(chosen) == 1, (selecting["metadata"]["name"], chosen)
        owner = next(d for d in pod_owners() if d["metadata"]["name"] == chosen[0])
        ports = {p["name"] for c in owner["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in selecting["spec"].get("ports", []):
            assert port["targetPort"] in ports, (selecting["metadata"]["name"], port)
    for statefulset in k8s("StatefulSet"):
        service = next(s for s in k8s("Service")
                       if s["metadata"]["name"] == statefulset["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True


def test_k8s_agents_are_an_indexed_job():
    (job,) = k8s("Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 1
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    args = container["args"]
    assert "$(JOB_COMPLETION_INDEX)" in option(args, "--replica-id")
    assert option(args, "--data-shard") == "$(JOB_COMPLETION_INDEX)"
    assert option(args, "--host") == "$(POD_IP)"
    env = {e["name"]: e.get("valueFrom", {}) for e in container["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["JOB_COMPLETION_INDEX"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def expand(args: list[str], container: dict, pod_fields: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's args with its env."""
    config = {k: v for cm in k8s("ConfigMap") for k, v in cm["data"].items()}
    env = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            env[var["name"]] = pod_fields[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            env[var["name"]] = config[source["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = var["value"]
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]
    assert not any("$(" in a for a in expanded), expanded
    return expanded


def test_k8s_commands_are_ftsystem_commands(monkeypatch):
    (deployment,) = k8s("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert deployment["spec"]["replicas"] >= 2
    entrypoint = image_argv(container["image"].split(":")[0].removeprefix("ftsystem-"))[0]
    started = check_command(entrypoint + expand(container["args"], container, POD_FIELDS),
                            monkeypatch)
    assert (started["instance_id"], started["host"]) == (POD_FIELDS["metadata.name"],
                                                         POD_FIELDS["status.podIP"])
    assert started["port"] == container["ports"][0]["containerPort"]
    from controller.auth import ENV_TOKEN_FILE
    token_file = Path(next(e["value"] for e in container["env"] if e["name"] == ENV_TOKEN_FILE))
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == token_file.parent)
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] and "optional" not in volume["secret"]
    (job,) = k8s("Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    entrypoint = image_argv(container["image"].split(":")[0].removeprefix("ftsystem-"))[0]
    replicas = {}
    for index in range(job["spec"]["completions"]):
        fields = POD_FIELDS | {
            "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index)}
        started = check_command(entrypoint + expand(container["args"], container, fields),
                                monkeypatch)
        assert (started["cfg"].job, started["cfg"].etcd) == (started_job(), etcd_endpoints())
        replicas[started["cfg"].replica_id] = started["train"].data_shard
    assert sorted(replicas.values()) == list(range(job["spec"]["completions"])), replicas


def started_job() -> str:
    return k8s("ConfigMap")[0]["data"]["JOB_ID"]


def etcd_endpoints() -> str:
    return k8s("ConfigMap")[0]["data"]["ETCD_ENDPOINTS"]


@pytest.mark.slow
def test_k8s_etcd_members_form_a_cluster(tmp_path):
    """The StatefulSet's members, run here with their DNS names mapped to loopback ports."""
    (statefulset,) = k8s("StatefulSet")
    name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    members = [f"{name}-{i}" for i in range(statefulset["spec"]["replicas"])]
    ports = {m: (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}") for m in members}
    assert etcd_endpoints().split(",") == [f"http://{m}.{service}:2379" for m in members]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    procs = []
    try:
        for member in members:
            args = expand(container["args"], container,
                          POD_FIELDS | {"metadata.name": member})
            addresses = {f"{m}.{service}:{p}": local for m in members
                         for p, local in zip((2379, 2380), ports[m])}
            addresses |= {"0.0.0.0:2379": ports[member][0], "0.0.0.0:2380": ports[member][1]}
            procs.append(start_etcd([localize(a, addresses) for a in args], tmp_path / member))
        for member in members:
            client = ports[member][0]
            wait_for(lambda: etcd_healthy(client), 30,  # noqa: B023 (called right here)
                     f"etcd member {member} to join a healthy cluster ({tmp_path})")
    finally:
        stop(procs)


def test_kustomize_builds_the_manifests():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert len(built) == len(k8s_documents())
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert all(d["metadata"].get("namespace") == namespace for d in built
               if d["kind"] != "Namespace")
