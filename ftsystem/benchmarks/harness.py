"""One run specification for every system a bench compares, and what each system makes of it.

A bench compares ftsystem with baselines (torchft 0.2.0, plain DDP, synchronous restart-all)
training the same thing. :class:`RunSpec` says once what that is: model, batch, learning rate,
data, steps (or a duration), emulated compute, replicas and timeout. This module alone turns a
spec into each system's launch:

- ftsystem: ``RunConfig`` for ``run_job`` (:func:`ftsystem_config`), whose agents start the
  example program ``ftsystem.example.train`` with :func:`ftsystem_train_args`;
- torchft: the keyword arguments of ``torchft_scenario.run_torchft_failover`` and
  ``run_torchft_rejoin`` (:func:`torchft_training`), passed on as the replica program's options;
- DDP: a rank's command line (:func:`ddp_rank_command`);
- restart-all: ``RestartAllConfig`` for ``run_restart_all`` (:func:`restart_all_config`).

Every training program takes the spec's options under the same names (:func:`training_args`), so
no system can be handed settings of its own: a baseline trained at another batch or learning rate
than ftsystem would win or lose for it. Each system's result records the spec it ran with
(:func:`ran_with`), and :func:`spec_mismatches` lists where recorded specs differ.

Also here, the one reader of the commit files a run leaves (:func:`read_timelines`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ftsystem.measure.stall import Timeline, read_timeline

if TYPE_CHECKING:
    from ftsystem.baselines.restart_all import RestartAllConfig
    from ftsystem.launch.launcher import RunConfig

Launcher = Literal["ftsystem", "torchft", "ddp", "restart_all"]
"""How a system is launched, which decides the files its run leaves."""

DDP_PROGRAM = "ftsystem.benchmarks.overhead"
"""The module a DDP rank runs (``python -m``)."""
DURATION_STEP_MARGIN = 1.1
"""ftsystem trains a step count: for a spec of a duration, this many times the steps that fit
in it at the expected step time, so that it still trains when the duration is over."""
LOOPS = ("plain", "real")
"""The training loops a spec can name (:attr:`RunSpec.loop`)."""
UNLIMITED_STEPS = 10**9
"""The restart-all baseline's step count for a spec of a duration: it stops at the duration."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """What every system of a bench trains, and how long."""

    num_replicas: int
    """Data-parallel replicas (a rejoin bench's members: its joiner is one more)."""
    model_params: int = 0
    """Approximate parameter count of the example workload's TinyGPT (0: its small default)."""
    batch_size: int = 16
    """Sequences per replica and step: the example program's default."""
    lr: float = 3e-3
    """AdamW's learning rate: the example program's default."""
    seed: int = 0
    """Seeds the model's initial weights and the synthetic language (the data)."""
    steps: int = 0
    """Committed steps to train (0: for ``duration_s``)."""
    duration_s: float = 0.0
    """Seconds to train, from launch, instead of a step count (0: ``steps``)."""
    sleep_per_step: float = 0.0
    """Emulated compute per step (s): a slower accelerator."""
    timeout_s: float = 30.0
    """ftsystem's one timeout (``RunConfig.timeout_s``, its default). Restart-all's only
    detector, its Gloo collective timeout, gets the third of it that ftsystem's detectors get
    (``RestartAllConfig.collective_timeout_s``). torchft runs at its own lighthouse and Manager
    timing (a torchft run's ``settings``), DDP at a long collective timeout: it meets no
    failure."""
    loop: str = "plain"
    """The training loop: ``plain`` (averaged gradients, then ``optimizer.step()``; every
    system has it) or ``real`` (the example program's: LR schedule, gradient scaler,
    clipping, dropout, a shuffling stateful loader; ftsystem and DDP only)."""

    def __post_init__(self) -> None:
        if (self.steps > 0) == (self.duration_s > 0):
            raise ValueError(f"a run trains for steps or for a duration, exactly one of them: "
                             f"steps={self.steps}, duration_s={self.duration_s}")
        for name in ("num_replicas", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("model_params", "sleep_per_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, not {getattr(self, name)}")
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {', '.join(LOOPS)}, not {self.loop!r}")
        if self.lr <= 0 or self.timeout_s <= 0:
            raise ValueError(f"lr and timeout_s must be positive, not {self.lr} and "
                             f"{self.timeout_s}")


def ran_with(system: str, spec: RunSpec) -> dict:
    """What a system's result records of its run: the system, and the spec it trained."""
    return {"system": system, "spec": dataclasses.asdict(spec)}


def spec_mismatches(results: Iterable[Mapping]) -> list[str]:
    """Where the specs that ``results`` record (:func:`ran_with`) differ from the first's
    (pure): one line per system and field; none when every system ran the same spec."""
    results = list(results)
    if not results:
        return []
    first = results[0]
    return [f"{result['system']} ran {field}={result['spec'].get(field)!r}, "
            f"{first['system']} {field}={value!r}"
            for result in results[1:] for field, value in first["spec"].items()
            if result["spec"].get(field) != value]


@contextlib.contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` in this process's environment for the block, as they were after it:
    ``run_job`` hands its environment to every agent and replica it starts."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- each system's launch ------------------------------------------------------------------

def training_args(spec: RunSpec) -> list[str]:
    """What to train, as options of every training program a bench starts: ftsystem's example
    program, the torchft replica, the restart-all worker and the DDP rank take these names."""
    return ["--model-params", str(spec.model_params), "--batch-size", str(spec.batch_size),
            "--lr", str(spec.lr), "--seed", str(spec.seed),
            "--sleep-per-step", str(spec.sleep_per_step)]


def ftsystem_train_args(spec: RunSpec, variant: Sequence[str] = ()) -> list[str]:
    """The example program's options: the spec's, its loop (the plain one, averaged gradients
    then ``optimizer.step()``, is what every baseline runs), then those of a ``variant`` of
    ftsystem (``--overlap on``)."""
    return [*training_args(spec), "--loop", spec.loop, *variant]


def plain_loop_only(spec: RunSpec, system: str) -> None:
    """Refuse a spec of the real loop for a system that has only the plain one."""
    if spec.loop != "plain":
        raise ValueError(f"{system} runs the plain loop only, not --loop {spec.loop}: run it "
                         "with --loop plain, or leave it out of --systems")


def ftsystem_steps(spec: RunSpec, step_s: float = 0.0) -> int:
    """The steps ftsystem trains: the spec's, or for a duration, those that fit in it at
    ``step_s`` a step (0: the emulated compute alone), with :data:`DURATION_STEP_MARGIN`."""
    if spec.steps:
        return spec.steps
    step_s = step_s or spec.sleep_per_step
    if step_s <= 0:
        raise ValueError("a run of a duration on ftsystem needs the step time it can expect: "
                         "pass step_s, or train with sleep_per_step")
    return math.ceil(DURATION_STEP_MARGIN * spec.duration_s / step_s)


def ftsystem_config(spec: RunSpec, *, variant: Sequence[str] = (), step_s: float = 0.0,
                    **options) -> RunConfig:
    """``run_job``'s configuration for ``spec``; ``options`` are ``RunConfig``'s other fields
    (where the run goes, chaos, namespaces), ``variant`` and ``step_s`` as in
    :func:`ftsystem_train_args` and :func:`ftsystem_steps`."""
    from ftsystem.launch.launcher import RunConfig
    return RunConfig(num_replicas=spec.num_replicas, num_steps=ftsystem_steps(spec, step_s),
                     timeout_s=spec.timeout_s, train_args=ftsystem_train_args(spec, variant),
                     show_progress=False, **options)


def torchft_training(spec: RunSpec) -> dict:
    """The keyword arguments of ``torchft_scenario.run_torchft_failover`` and
    ``run_torchft_rejoin`` that say what to train."""
    if spec.duration_s:
        raise ValueError("the torchft baseline trains a step count, not a duration")
    plain_loop_only(spec, "torchft")
    return {"num_replicas": spec.num_replicas, "steps": spec.steps,
            "model_params": spec.model_params, "batch_size": spec.batch_size, "lr": spec.lr,
            "seed": spec.seed, "sleep_per_step": spec.sleep_per_step}


def ddp_rank_command(spec: RunSpec, rank: int, out: Path) -> list[str]:
    """A DDP rank's arguments to ``python``: it trains ``spec`` and writes to ``out``."""
    if spec.duration_s:
        raise ValueError("the DDP baseline trains a step count, not a duration")
    return ["-m", DDP_PROGRAM, "--rank", str(rank), "--world-size", str(spec.num_replicas),
            "--steps", str(spec.steps), "--out", str(out), "--loop", spec.loop,
            *training_args(spec)]


def restart_all_config(spec: RunSpec, **options) -> RestartAllConfig:
    """``run_restart_all``'s configuration for ``spec``; ``options`` are
    ``RestartAllConfig``'s other fields (where the run goes, checkpoints, deadline)."""
    from ftsystem.baselines.restart_all import RestartAllConfig
    plain_loop_only(spec, "the restart-all baseline")
    return RestartAllConfig(num_nodes=spec.num_replicas, num_steps=spec.steps or UNLIMITED_STEPS,
                            duration_s=spec.duration_s, timeout_s=spec.timeout_s,
                            train_args=training_args(spec), **options)


# --- what a run leaves ---------------------------------------------------------------------

def read_timelines(launcher: Launcher, run_dir: Path) -> dict[str, Timeline]:
    """Each replica's commits ``(step, unix_time)``, of every generation it had, from the
    files a run left in ``run_dir`` (``RunConfig.out_dir``, or the baseline's working
    directory); restart-all's, of the lineage that survived its restarts."""
    if launcher == "ftsystem":
        return ftsystem_timelines(run_dir / "results")[0]
    if launcher == "torchft":
        from ftsystem.baselines.torchft_scenario import commit_timelines
        return commit_timelines(run_dir)
    if launcher == "ddp":
        return {p.stem: json.loads(p.read_text())["commits"]
                for p in sorted(run_dir.glob("rank*.json"))}
    if launcher == "restart_all":
        from ftsystem.baselines.restart_all import final_lineage
        return {p.stem: final_lineage(read_timeline(p)) for p in sorted(run_dir.glob("*.commits"))}
    raise ValueError(f"unknown launcher {launcher!r}")


def ftsystem_timelines(results: Path) -> tuple[dict[str, Timeline], str]:
    """Each ftsystem replica's commits in ``results``, and whether they span all its
    generations.

    The example program appends every commit to ``<replica>.commits`` (``step unix_time``),
    over all generations; a replica's result JSON holds its last generation's only. Where a
    replica has no progress file (another replica program), its JSON's commits stand in:
    once every replica has been restarted, the job timeline built from them starts at the
    latest first restart.
    """
    timelines = {p.stem: read_timeline(p) for p in sorted(results.glob("*.commits"))}
    complete = True
    for path in sorted(results.glob("*.json")):
        result = json.loads(path.read_text())
        if result["replica"] not in timelines:
            timelines[result["replica"]] = result["commits"]
            complete = False
    return timelines, "all generations" if complete else "last generation only"
