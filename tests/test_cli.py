"""Bad input on the command line: a clear message, exit code 2, nothing started."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.control.etcd_server import free_port

runner = CliRunner()


def plain(output: str) -> str:
    """The message without rich's box drawing and line wrapping."""
    return " ".join(output.replace("│", " ").split())


@pytest.mark.parametrize("args, message", [
    (["run", "--replicas", "2", "--kill-at", "5:9"], "replica 9 does not exist"),
    (["run", "--kill-at", "soon"], "expected STEP:REPLICA[:PHASE]"),
    (["run", "--kill-at", "5:1:never"], "PHASE in step, allreduce, fail-allreduce"),
    (["run", "--replicas", "2", "--min-replicas", "3"], "--min-replicas"),
    (["run", "--job", "a/b"], "invalid job id"),
    (["run", "--nproc-per-node", "2", "--tp", "3"], "3 does not divide a replica's 2 ranks"),
    (["agent", "--etcd", "http://127.0.0.1:1", "--job", "j", "--replica-id", "r 1", "--",
      "true"], "invalid replica id"),
    (["agent", "--etcd", "http://127.0.0.1:1", "--job", "j", "--replica-id", "r1",
      "--kill-at", "x", "--", "true"], "malformed fault point"),
    (["controller", "--etcd", "http://nohost", "--job", "j"], "expected host:port"),
])
def test_bad_arguments(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in plain(result.output)


def test_unreachable_etcd_is_named(monkeypatch):
    monkeypatch.setenv("FTSYSTEM_ETCD_RETRY_S", "1")
    url = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["agent", "--etcd", url, "--job", "j", "--replica-id", "r1",
                                 "--", "true"])
    assert result.exit_code == 2
    assert "etcd unreachable" in plain(result.output) and url in plain(result.output)


def test_controller_without_token_or_insecure_refuses_to_start(monkeypatch):
    monkeypatch.delenv("FTSYSTEM_API_TOKEN", raising=False)
    monkeypatch.delenv("FTSYSTEM_API_TOKEN_FILE", raising=False)
    result = runner.invoke(app, ["controller", "--etcd", "http://127.0.0.1:1", "--job", "j"])
    assert result.exit_code == 2
    message = plain(result.output)
    assert "FTSYSTEM_API_TOKEN" in message and "--insecure" in message


def test_etcd_and_job_from_the_environment(monkeypatch):
    """FTSYSTEM_ETCD and FTSYSTEM_JOB, the names the ranks read, stand for --etcd and --job."""
    monkeypatch.setenv("FTSYSTEM_ETCD", "http://nohost")
    monkeypatch.setenv("FTSYSTEM_JOB", "from-env")
    monkeypatch.setenv("FTSYSTEM_API_TOKEN", "t")
    result = runner.invoke(app, ["controller"])
    assert result.exit_code == 2 and "expected host:port" in plain(result.output)
    monkeypatch.setenv("FTSYSTEM_JOB", "a/b")
    result = runner.invoke(app, ["controller"])
    assert result.exit_code == 2 and "invalid job id" in plain(result.output)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("ftsystem 0.")


def test_help_imports_neither_simulators_nor_plots():
    """The core (no ``sim`` extra) runs ``--help`` and every command's registration."""
    probe = ("import sys\nfrom ftsystem.cli import main\nsys.argv = ['ftsystem', '--help']\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & "
             "{'matplotlib', 'simpy'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "Usage" in out and "LOADED []" in out, out


def test_the_agent_starts_without_benchmarks_simulators_or_numpy():
    """An agent starts with every generation of its replica, beside replicas that train: it
    skips the sub-command modules (0.3 s of CPU), all the way to its first etcd call."""
    probe = ("import os, sys\nos.environ['FTSYSTEM_ETCD_RETRY_S'] = '1'\n"
             "from ftsystem.cli import main\n"
             f"sys.argv = ['ftsystem', 'agent', '--etcd', 'http://127.0.0.1:{free_port()}', "
             "'--job', 'j', '--replica-id', 'r1', '--insecure', '--', 'true']\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] == 'numpy' or "
             "m.startswith(('ftsystem.benchmarks', 'ftsystem.sim', 'ftsystem.halos'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert "etcd unreachable" in done.stderr, done.stderr  # it ran up to its first etcd call
    assert "LOADED []" in done.stdout, done.stdout


def _without(modules: tuple[str, ...], program: str) -> subprocess.CompletedProcess:
    """Run ``program`` in a fresh interpreter where ``modules`` cannot be imported, as after
    ``pip install ftsystem`` without the ``[sim]`` extra."""
    probe = ("import sys\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             f"        if name.split('.')[0] in {modules!r}:\n"
             "            raise ImportError(name + ' is not installed')\n"
             "sys.meta_path.insert(0, Block())\n" + program)
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)


def test_sim_without_its_extra_says_what_to_install():
    done = _without(("simpy",), "from ftsystem.cli import main\n"
                                "sys.argv = ['ftsystem', 'sim', 'halos']\nmain()\n")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "ftsystem sim needs simpy" in done.stderr and "ftsystem[sim]" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_core_imports_without_the_sim_extra():
    """What runs a job (CLI, launcher, controller, agent, training) imports with matplotlib and
    simpy unavailable."""
    done = _without(("matplotlib", "simpy"),
                    "import ftsystem.cli, ftsystem.launch.launcher, ftsystem.example.train\n"
                    "ftsystem.cli.register_subcommands()\n"
                    "import ftsystem.training.replica, agent.supervisor, controller.app\n"
                    "print('CORE OK')")
    assert "CORE OK" in done.stdout, done.stderr
