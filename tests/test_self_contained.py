"""The repository stands alone: a copy of its files, with nothing beside it, runs the HALoS and
ETTR simulators and their tests, and no file points at the reference folder next to the checkout.

The copy holds what a fresh clone would (tracked files plus untracked ones git does not ignore),
and its processes import the copy's package, not the installed one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The folder beside the checkout the project was specified from; written so that this file does
# not match itself.
OUTSIDE = re.compile(rb"(\.\./|/work/)" + rb"shared\b")
# The tests of the HALoS setup, its trace and both simulators (about 25 s on 2 cores).
SIMULATOR_TESTS = ["tests/test_halos_sim.py", "tests/test_sim_ettr.py"]
# ``python -m ftsystem.cli`` runs cli.py as __main__, a second module beside the ftsystem.cli that
# the sub-command modules register on, so it lacks ``sim halos``: call main() as the script does.
FTSYSTEM = [sys.executable, "-c", "from ftsystem.cli import main; main()"]


def _repo_files() -> list[str]:
    """What a clone holds: tracked files (not deleted) and untracked ones git does not ignore."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: cannot tell the repository's files")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout
    return sorted({f for f in listed.decode().split("\0") if f and (REPO / f).is_file()})


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> Path:
    """A copy of the repository in an otherwise empty folder."""
    copy = tmp_path_factory.mktemp("alone") / "repo"
    for name in _repo_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, copy / name)
    return copy


def _run(copy: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    return subprocess.run(args, cwd=copy, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_no_file_points_outside_the_repository() -> None:
    offenders = [name for name in _repo_files() if OUTSIDE.search((REPO / name).read_bytes())]
    assert not offenders, f"these files refer to the reference folder beside the checkout, " \
        f"which a clone does not have; copy what they need into the repository: {offenders}"


def test_the_copy_imports_its_own_package_and_data(alone: Path) -> None:
    done = _run(alone, sys.executable, "-c", "import ftsystem.halos.config as c; "
                "print(c.__file__); print(c.DEFAULT_SETUP); print(c.DEFAULT_TRACE)", timeout=60)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.split():
        assert Path(line).is_relative_to(alone) and Path(line).is_file(), done.stdout


def test_simulator_tests_pass_in_the_copy(alone: Path) -> None:
    done = _run(alone, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                *SIMULATOR_TESTS, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_sim_halos_runs_on_its_defaults_in_the_copy(alone: Path, tmp_path: Path) -> None:
    out = tmp_path / "halos.json"
    done = _run(alone, *FTSYSTEM, "sim", "halos", "--iters", "8", "--methods", "halos",
                "--eval-points", "2", "--local-batch", "2", "--json", str(out),
                "--plot", str(tmp_path / "halos.png"), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(out.read_text())["final_loss"].keys() == {"halos"}


def test_sim_ettr_reads_the_copys_benchmarks(alone: Path, tmp_path: Path) -> None:
    done = _run(alone, *FTSYSTEM, "sim", "ettr", "--reproduce-paper", "--quick",
                "--json", str(tmp_path / "ettr.json"), "--png", str(tmp_path / "ettr.png"),
                timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # bench/results of the copy were found: no input fell back to an assumption.
    missing = json.loads((tmp_path / "ettr.json").read_text())["assumptions"]["ftsystem"]["missing"]
    assert missing == [], done.stdout
