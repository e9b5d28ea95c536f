"""docker/ for real: the images built with Podman and the compose job run, one agent's container
killed.

Builds docker/Dockerfile's images (etcd-debian, controller, agent) on a Debian base made with
mmdebstrap, since registry images cannot be pulled on the machines this project is tested on;
pip inside the builds uses this machine's pip configuration, mounted read-only, never copied.
Then podman-compose runs etcd, both controllers, the job and the three agents of
docker/compose.yaml with docker/compose.podman.yaml (host networking), `podman kill`s one
agent's container (the agent and its replica's rank at once, as a lost node), starts it again,
and waits, on the controller's REST API, for the replica to leave the epoch, come back and
finish bitwise identical to the others (the state hashes of the results in the volume). A test
override only shortens the training and leaves out compose.yaml's own kill.

Everything lives in a Podman storage of its own, removed at the end. Skipped only where Podman
is not installed or cannot run a container at all; a failure of the images or the compose files
fails.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import wait_for

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE_FILES = (DOCKER / "compose.yaml", DOCKER / "compose.podman.yaml")
PROJECT = "ftsystem-test"
STEPS = 300
"""Steps the test's replicas train (compose.yaml's 3000 take minutes)."""
KILL_AFTER_STEP = 60
KILLED = "agent-1"
SERVICES = ("etcd", "controller", "controller-1", "job", "agent-0", "agent-1", "agent-2")
"""What the test runs: all of compose.yaml but Prometheus and Grafana, whose images cannot be
pulled here."""
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
IMAGES = {"etcd-debian": "localhost/ftsystem-etcd:dev",
          "controller": "localhost/ftsystem-controller:dev",
          "agent": "localhost/ftsystem-agent:dev"}
"""Each target built, and its tag: compose.yaml's image names (and FTSYSTEM_ETCD_IMAGE's)."""
HOST_PORTS = (2379, 2380, 8080, 8081)
"""What compose.podman.yaml listens on, on the host's loopback."""
STARTUP_S = 600
"""Generous deadlines: CI's machine may be loaded."""
FINISH_S = 900


# --- compose.podman.yaml, read without Podman ----------------------------------------------------

class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's `!reset` (drop what a file below set)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load_compose(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def test_podman_override_keeps_compose_commands():
    """The override changes networking and listen addresses only: every service of compose.yaml
    is on the host network with every service name resolving to loopback, and etcd's command is
    compose.yaml's with its listen URLs on loopback."""
    base, podman = (load_compose(path)["services"] for path in COMPOSE_FILES)
    assert set(podman) == set(base)
    for name, service in podman.items():
        assert service["network_mode"] == "host", name
        assert set(service["extra_hosts"]) == {f"{s}:127.0.0.1" for s in base}, name
    loopback = [a.replace("http://0.0.0.0:", "http://127.0.0.1:") for a in base["etcd"]["command"]]
    assert podman["etcd"]["command"] == loopback
    assert "FTSYSTEM_BIND" in podman["controller"]["environment"]
    assert {"command", "entrypoint", "image"}.isdisjoint(podman["controller"])


# --- Podman -----------------------------------------------------------------------------------

@dataclass
class Podman:
    """The podman CLI on a storage of its own (images, containers, volumes), with the project's
    containers.conf."""
    root: Path
    env: dict[str, str]

    def __call__(self, *args: str, timeout: float = 300,
                 check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["podman", *args], env=self.env, capture_output=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout.decode(errors='replace')[-3000:]}"
                                 f"{done.stderr.decode(errors='replace')[-3000:]}")
        return done

    def text(self, *args: str, **kwargs) -> str:
        return self(*args, **kwargs).stdout.decode().strip()


@pytest.fixture(scope="session")
def podman(tmp_path_factory):
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/install.sh --test installs it)")
    root = tmp_path_factory.mktemp("podman")
    (root / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{root}/graph"\nrunroot = "{root}/run"\n')
    env = os.environ | {"CONTAINERS_CONF": str(DOCKER / "containers.conf"),
                        "CONTAINERS_STORAGE_CONF": str(root / "storage.conf")}
    cli = Podman(root, env)
    yield cli
    # Whatever a failed test left; a storage that cannot be removed fails the teardown.
    cli("rm", "--all", "--force", "--time", "0", timeout=120, check=False)
    cli("volume", "rm", "--all", "--force", timeout=120, check=False)
    cli("rmi", "--all", "--force", timeout=300, check=False)
    shutil.rmtree(root)


def apt_sources() -> list[str]:
    """This machine's Debian 12 sources, for mmdebstrap (its own default mirrors where none)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    return [str(f) for f in files if f.suffix in (".list", ".sources") and f.is_file()
            and "bookworm" in f.read_text()]


@pytest.fixture(scope="session")
def base_image(podman) -> str:
    """A Debian 12 image with Python 3.11 and venv, made once per session (registry images
    cannot be pulled here): mmdebstrap from this machine's apt sources, then `podman import`."""
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is not installed (scripts/install.sh --test installs it)")
    image = "localhost/ftsystem-test-base:bookworm"
    rootfs = podman.root / "rootfs.tar"
    done = subprocess.run(
        ["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
         "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
         "--dpkgopt=path-exclude=/usr/share/locale/*", "--aptopt=Acquire::Languages \"none\"",
         "bookworm", str(rootfs), *apt_sources()],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    podman("import", str(rootfs), image, timeout=600)
    rootfs.unlink()
    trivial = podman("run", "--rm", "--network", "host", image, "python3", "-c", "import venv",
                     check=False, timeout=120)
    if trivial.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {trivial.stderr.decode()[-500:]}")
    return image


# --- the images ---------------------------------------------------------------------------------

def is_index(key: str) -> bool:
    return key.lower().replace("_", "-").endswith("index-url")


def pip_settings() -> tuple[list[str], str]:
    """What pip on this machine reads, to mount read-only into builds at the same paths (config
    files, and every file or folder they or PIP_* name: CA bundle, constraints, wheel folders,
    local indexes with the folder beside them that their pages link to), and its index."""
    debug = subprocess.run([sys.executable, "-m", "pip", "config", "debug"], capture_output=True,
                           text=True, check=True).stdout
    paths = set(re.findall(r"^\s+(/\S+), exists: True$", debug, re.MULTILINE))
    index = "https://pypi.org/simple"
    for key, value in re.findall(r"^\s+([\w.-]+)(?::|=) ?'?(.*?)'?$", debug, re.MULTILINE):
        for word in value.split():
            path = Path(word.removeprefix("file://"))
            if path.is_absolute() and path.exists():
                paths.add(str(path.parent if is_index(key) else path))
        if key.lower() in ("global.index-url", "pip_index_url"):
            index = value
    return sorted(paths), index


@pytest.fixture(scope="module")
def images(podman, base_image) -> dict[str, float]:
    """docker/Dockerfile's images, built from the base; the seconds each build took."""
    mounts, index = pip_settings()
    args = ["build", "--network", "host", "--pull=never", "-f", str(DOCKER / "Dockerfile"),
            "--ignorefile", str(DOCKER / "Dockerfile.dockerignore"),
            "--build-arg", f"BASE_IMAGE={base_image}",
            "--build-arg", f"ETCD_IMAGE={IMAGES['etcd-debian']}",
            "--build-arg", f"TORCH_INDEX={index}"]
    for path in mounts:
        args += ["-v", f"{path}:{path}:ro"]
    took = {}
    for target, tag in IMAGES.items():  # etcd first: the others copy etcd from it
        start = time.monotonic()
        podman(*args, "--target", target, "-t", tag, str(REPO), timeout=1800)
        took[target] = time.monotonic() - start
    return took


# --- the compose job ---------------------------------------------------------------------------

def shortened(path: Path) -> Path:
    """The agents of compose.yaml, training STEPS steps and without compose.yaml's own kill."""
    services = {}
    for name, service in load_compose(COMPOSE_FILES[0])["services"].items():
        if service.get("build", {}).get("target") != "agent":
            continue
        command = list(service["command"])
        command[command.index("--steps") + 1] = str(STEPS)
        while "--kill-at" in command:
            del command[command.index("--kill-at"):command.index("--kill-at") + 2]
        services[name] = {"command": command}
    path.write_text(yaml.safe_dump({"services": services}))
    return path


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class ComposeJob:
    podman: Podman
    api: str
    job: str
    token: str
    names: dict[str, str] = field(default_factory=dict)

    def container(self, service: str) -> str:
        if service not in self.names:
            self.names[service] = self.podman.text(
                "ps", "--all", "--format", "{{.Names}}",
                "--filter", f"label=com.docker.compose.project={PROJECT}",
                "--filter", f"label=com.docker.compose.service={service}")
        return self.names[service]

    def state(self) -> dict | None:
        try:
            return httpx.get(f"{self.api}/v1/jobs/{self.job}", timeout=3,
                             headers={"Authorization": f"Bearer {self.token}"}).json()
        except (httpx.HTTPError, ValueError):
            return None

    def replica(self, rid: str) -> dict:
        state = self.state() or {"replicas": []}
        return next((r for r in state["replicas"] if r["id"] == rid), {})

    def members(self) -> list[str]:
        return ((self.state() or {}).get("epoch") or {}).get("members", [])

    def exited(self, service: str) -> int | None:
        status, code = self.podman.text("inspect", "--format", "{{.State.Status}} "
                                        "{{.State.ExitCode}}", self.container(service)).split()
        return int(code) if status == "exited" else None

    def logs(self) -> str:
        out = []
        for service in SERVICES:
            done = self.podman("logs", "--tail", "25", self.container(service), check=False)
            out.append(f"--- {service}\n{(done.stdout + done.stderr).decode(errors='replace')}")
        return "\n".join(out)


@pytest.fixture
def compose_job(podman, images, tmp_path):
    taken = [port for port in HOST_PORTS if not port_free(port)]
    assert not taken, f"compose.podman.yaml needs host ports {taken}, which are taken"
    files = [*COMPOSE_FILES, shortened(tmp_path / "compose.test.yaml")]
    compose = [sys.executable, "-m", "podman_compose", "-p", PROJECT,
               *(a for f in files for a in ("-f", str(f)))]
    token = secrets.token_hex(16)
    env = podman.env | {"FTSYSTEM_API_TOKEN": token, "FTSYSTEM_ETCD_IMAGE": IMAGES["etcd-debian"]}
    base = load_compose(COMPOSE_FILES[0])["services"]
    api = "http://" + base["controller"]["ports"][0].rsplit(":", 1)[0]
    job = ComposeJob(podman, api, base["job"]["command"][1], token)
    try:
        up = subprocess.run([*compose, "up", "--detach", "--no-build", *SERVICES], env=env,
                            capture_output=True, text=True, timeout=STARTUP_S)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield job
    finally:
        down = subprocess.run([*compose, "down", "--volumes", "--timeout", "5"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert down.returncode == 0, down.stderr[-3000:]


def wait_with_logs(job: ComposeJob, predicate, timeout: float, what: str):
    try:
        return wait_for(predicate, timeout, what, poll=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}\njob: {json.dumps(job.state())}\n{job.logs()}") from None


@pytest.mark.containers
@pytest.mark.timeout(3600)
def test_compose_job_recovers_from_a_killed_agent_container(compose_job, images, podman):
    job, rid = compose_job, "r1"
    agents = [s for s in SERVICES if s.startswith("agent-")]
    started = time.monotonic()
    wait_with_logs(job, lambda: len(job.members()) == len(agents)
                   and (job.replica(rid).get("step") or 0) >= KILL_AFTER_STEP,
                   STARTUP_S, f"{len(agents)} replicas training, {rid} past step {KILL_AFTER_STEP}")
    killed_at = job.replica(rid)["step"]
    podman("kill", job.container(KILLED))  # SIGKILL: the agent and its rank at once
    assert wait_for(lambda: job.exited(KILLED), 60, f"{KILLED}'s container to exit") == 137
    wait_with_logs(job, lambda: rid not in job.members(), 120, f"{rid} out of the epoch")
    # Podman, like Docker, does not restart a container its user killed: start it, as a node
    # coming back would be.
    podman("start", job.container(KILLED))
    back = wait_with_logs(job, lambda: rid in job.members() and job.replica(rid), FINISH_S,
                          f"{rid} back in the epoch")
    assert back["generation"] >= 1 and back["restarts"] >= 1, back
    wait_with_logs(job, lambda: all(job.exited(s) is not None for s in agents), FINISH_S,
                   "every agent's container to exit")
    codes = {s: job.exited(s) for s in agents}
    assert set(codes.values()) == {0}, f"{codes}\n{job.logs()}"

    volume = podman.text("volume", "inspect", "--format", "{{.Mountpoint}}", f"{PROJECT}_results")
    results = {r["replica"]: r for r in (json.loads(p.read_text())
                                         for p in sorted(Path(volume, "results").glob("*.json")))}
    assert set(results) == {"r0", "r1", "r2"}
    assert {r["step"] for r in results.values()} == {STEPS}
    assert len({r["state_hash"] for r in results.values()}) == 1, \
        {k: r["state_hash"] for k, r in results.items()}
    assert results[rid]["generation"] >= 1 and results[rid]["catchup"]["donors"]
    print(f"\nbuilds {', '.join(f'{t} {s:.0f} s' for t, s in images.items())}; job "
          f"{time.monotonic() - started:.0f} s; {rid} killed at step {killed_at}, rejoined "
          f"at step {back['step']} from {results[rid]['catchup']['donors']}")
