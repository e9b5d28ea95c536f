"""Effective training time ratio (ETTR) from 1K to 200K GPUs: a discrete-event simulation.

Failures arrive as a Poisson process whose rate follows published statistics for the job's size;
three recovery models run against the same failure trace (common random numbers, so their
differences are not noise):

- ``sync``: synchronous training, restart-all from the last checkpoint;
- ``fthsdp``: FT-HSDP as published (arXiv 2602.00277): the whole job stalls briefly, one replica is
  out while it recovers, the others keep training at reduced capacity; the failed replica's
  relaunch is the model ftsystem's uses (``ftsystem.sim.scale_inputs.relaunch_s``);
- ``ftsystem``: the same structure with ftsystem's costs at the job's scale, built from inputs
  measured here, published, modelled or assumed (``ftsystem.sim.scale_inputs``).

ETTR is reported two ways (docs/ettr_simulation.md): time-based, the fraction of wall-clock time in
which the job commits steps that it keeps; work-based, samples kept / (wall-clock x full-capacity
sample rate). They differ when a job trains at reduced capacity.

Recoveries never overlap: a failure that arrives during a recovery is recovered from after it, so
each failure costs the job its full stall. This is the assumption under which
ETTR = 1 - failures x stall / time, the arithmetic behind the paper's 44% and 80%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

if TYPE_CHECKING:  # imported where a simulation runs: the `sim` extra, not the core
    import simpy

HOUR_S = 3600.0
DAY_S = 86400.0

KOKOLIS_MTTF_S = ((1_024, 7.9 * HOUR_S), (16_384, 1.8 * HOUR_S), (131_072, 14 * 60.0))
"""(GPUs, job MTTF): Kokolis et al., "Revisiting Reliability in Large-Scale ML Research
Clusters", HPCA 2025 (the 131,072 point is their projection)."""
LLAMA3_GPUS, LLAMA3_INTERRUPTIONS, LLAMA3_DAYS = 16_384, 419, 54
"""Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days."""

PAPER_GPUS = 98_304
"""The paper's "O(100K) GPUs": 12,288 hosts of 8 GPUs, 12 replicas of REPLICA_GPUS."""
PAPER_ETTR = {"sync": 0.44, "fthsdp": 0.80}
"""FT-HSDP paper, abstract: effective training time at O(100K) GPUs."""
PAPER_TOLERANCE = 0.03
"""How close (absolute) the simulation must come to PAPER_ETTR before it predicts anything."""
SYNC_RESTART_S = 600.0
"""Paper: per-failure stall of synchronous training (10 minutes)."""
FTHSDP_STALL_S = 180.0
"""Paper: per-failure stall of FT-HSDP (3 minutes), for the whole job."""
CHECKPOINT_WRITE_S = 1.0
"""Assumed: blocking part of one asynchronous checkpoint (the device-to-host snapshot; the write
to storage overlaps training)."""
REPLICA_GPUS = 8_192
"""Assumed: GPUs per data-parallel replica (not published; 4,096..16,384 all reproduce the
paper, see docs/ettr_simulation.md)."""
MIN_REPLICAS = 8
"""Smaller jobs are split into this many replicas, so that a replica never exceeds the job."""
SCALES = (1_024, 2_048, 4_096, 8_192, 16_384, 32_768, 65_536, PAPER_GPUS, 131_072, 196_608)
"""Job sizes of the sweep, 1K..200K GPUs."""


def kokolis_mttf_s(gpus: float) -> float:
    """Job MTTF from Kokolis et al.: a power law through each pair of neighbouring published points
    (exact at every point), extended along the first or last segment outside them."""
    (n0, m0), (n1, m1) = KOKOLIS_MTTF_S[:2] if gpus <= KOKOLIS_MTTF_S[1][0] else KOKOLIS_MTTF_S[1:]
    return m0 * (gpus / n0) ** (math.log(m1 / m0) / math.log(n1 / n0))


def llama3_mttf_s(gpus: float) -> float:
    """Job MTTF from Llama 3's interruption rate, with a constant per-GPU failure rate."""
    return LLAMA3_DAYS * DAY_S * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS / gpus


FAILURE_MODELS: dict[str, Callable[[float], float]] = {"kokolis": kokolis_mttf_s,
                                                       "llama3": llama3_mttf_s}


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncRecovery:
    """Synchronous training: any failure stops the job, which restarts from its last checkpoint."""

    restart_s: float
    """Whole-job stall per failure: relaunch, communicator init, checkpoint load."""
    checkpoint_write_s: float
    """Blocking part of one checkpoint; training stops for it."""
    checkpoint_interval_s: float
    """Training time between two checkpoints; the work since the last one is lost on a failure."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaRecovery:
    """Replica-level fault tolerance (FT-HSDP, ftsystem): a failure takes out one replica."""

    stall_s: float
    """Whole-job stall per failure: detection, reconfiguration of the cross-replica all-reduce."""
    relaunch_s: float
    """Failed replica, from the failure until its processes run again; the others keep training."""
    catchup_s: float
    """Failed replica, from relaunch until it holds the current state (non-blocking catch-up)."""
    join_stall_s: float
    """Whole-job stall when the recovered replica joins (one reconfiguration)."""
    replica_gpus: int
    """GPUs per replica: the unit a failure takes out."""
    throughput: float = 1.0
    """Samples per second while training, as a fraction of the full-capacity rate: what per-step
    costs (ftsystem's votes) leave. Work-based ETTR only: time-based counts the steps' time."""

    def __post_init__(self) -> None:
        if not 0.0 < self.throughput <= 1.0:
            raise ValueError(f"throughput must lie in (0, 1], got {self.throughput}")


@dataclass(frozen=True, slots=True)
class Failures:
    """A failure trace: arrival times, and where each failure hit, as a position in [0, 1) along
    the job's GPUs (which replica that is depends on the layout)."""

    times_s: np.ndarray
    where: np.ndarray


@dataclass(frozen=True, slots=True)
class Outcome:
    """ETTR of one simulated run."""

    time: float
    """Time-based: fraction of wall-clock time in which the job commits steps that it keeps."""
    work: float
    """Work-based: samples kept / (wall-clock x full-capacity sample rate)."""


def young_daly_interval_s(write_s: float, mttf_s: float) -> float:
    """Checkpoint interval that minimises checkpoint plus rollback waste, sqrt(2 W M) (Young 1974):
    operators tune the interval to the failure rate, so it shrinks as the job grows."""
    return math.sqrt(2.0 * write_s * mttf_s)


def sync_recovery(mttf_s: float) -> SyncRecovery:
    """The paper's synchronous baseline at a scale with this MTTF."""
    return SyncRecovery(restart_s=SYNC_RESTART_S, checkpoint_write_s=CHECKPOINT_WRITE_S,
                        checkpoint_interval_s=young_daly_interval_s(CHECKPOINT_WRITE_S, mttf_s))


def fthsdp_recovery(relaunch_s: float, replica_gpus: int = REPLICA_GPUS) -> ReplicaRecovery:
    """FT-HSDP as published: a 3-minute stall per failure; catch-up is non-blocking with "minimal
    stall", modelled as free, and so is the join. The paper gives no relaunch time for one
    replica: ``relaunch_s`` is the model shared with ftsystem."""
    return ReplicaRecovery(stall_s=FTHSDP_STALL_S, relaunch_s=relaunch_s, catchup_s=0.0,
                           join_stall_s=0.0, replica_gpus=replica_gpus)


def num_replicas(gpus: int, replica_gpus: int) -> int:
    """How many replicas a job of ``gpus`` has: whole replicas of ``replica_gpus``, but at least
    MIN_REPLICAS (smaller jobs use smaller replicas)."""
    return max(MIN_REPLICAS, round(gpus / replica_gpus))


def checkpointed_progress(elapsed_s: float, recovery: SyncRecovery) -> tuple[float, float]:
    """Split the training progress made in ``elapsed_s`` of wall-clock since training resumed
    into (saved by completed checkpoints, made since the last one). Training alternates
    ``checkpoint_interval_s`` of progress with ``checkpoint_write_s`` of blocking write; a
    checkpoint saves only once its write completes."""
    period = recovery.checkpoint_interval_s + recovery.checkpoint_write_s
    done = math.floor(elapsed_s / period)
    in_flight = min(elapsed_s - done * period, recovery.checkpoint_interval_s)
    return done * recovery.checkpoint_interval_s, in_flight


def poisson_failures(mttf_s: float, horizon_s: float, rng: np.random.Generator) -> Failures:
    """A Poisson failure trace on [0, horizon): a Poisson count, then uniform arrival times."""
    count = rng.poisson(horizon_s / mttf_s)
    return Failures(np.sort(rng.uniform(0.0, horizon_s, count)), rng.uniform(0.0, 1.0, count))


def _arrivals(env: simpy.Environment, failures: Failures,
              on_failure: Callable[[float], object]) -> Iterator[simpy.Event]:
    """The failure process: calls ``on_failure(where)`` at each failure time."""
    for time_s, where in zip(failures.times_s, failures.where):
        yield env.timeout(time_s - env.now)
        on_failure(where)


@dataclass(slots=True)
class _SyncState:
    kept_s: float = 0.0
    """Training progress saved by checkpoints (seconds at full capacity)."""
    resumed_at: float | None = 0.0
    """When training last resumed; None while the job restarts."""


def _sync_job(env: simpy.Environment, recovery: SyncRecovery, failures: simpy.Store,
              state: _SyncState) -> Iterator[simpy.Event]:
    """Train until a failure, keep what was checkpointed, restart; repeat. Failures that arrive
    during a restart wait in ``failures`` and cost another restart right after it."""
    while True:
        state.resumed_at = env.now
        yield failures.get()
        state.kept_s += checkpointed_progress(env.now - state.resumed_at, recovery)[0]
        state.resumed_at = None
        yield env.timeout(recovery.restart_s)


def simulate_sync(recovery: SyncRecovery, failures: Failures, horizon_s: float) -> Outcome:
    """ETTR of synchronous training with restart-all under ``failures`` over ``horizon_s``."""
    import simpy
    env = simpy.Environment()
    queue = simpy.Store(env)
    state = _SyncState()
    env.process(_arrivals(env, failures, queue.put))
    env.process(_sync_job(env, recovery, queue, state))
    env.run(until=horizon_s)
    kept = state.kept_s
    if state.resumed_at is not None:
        # The job holds the work since its last checkpoint when the horizon ends.
        kept += sum(checkpointed_progress(horizon_s - state.resumed_at, recovery))
    return Outcome(time=kept / horizon_s, work=kept / horizon_s)


class _Meter:
    """Integrates over virtual time how long the job trains and at what capacity."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.healthy = replicas
        self.stalled = False
        self.last_s = 0.0
        self.train_s = 0.0
        self.work_s = 0.0

    def change(self, now_s: float, *, healthy: int = 0, stalled: bool | None = None) -> None:
        """Account for the time since the last change, then apply this one."""
        if not self.stalled and self.healthy > 0:
            self.train_s += now_s - self.last_s
            self.work_s += (now_s - self.last_s) * self.healthy / self.replicas
        self.last_s = now_s
        self.healthy += healthy
        if stalled is not None:
            self.stalled = stalled


def _stall(env: simpy.Environment, meter: _Meter, control: simpy.Resource,
           seconds: float) -> Iterator[simpy.Event]:
    """Stop the whole job for ``seconds``, after any stall in progress (one reconfiguration at a
    time: ``control`` has capacity 1)."""
    with control.request() as turn:
        yield turn
        meter.change(env.now, stalled=True)
        yield env.timeout(seconds)
        meter.change(env.now, stalled=False)


def _replica_failure(env: simpy.Environment, recovery: ReplicaRecovery, meter: _Meter,
                     control: simpy.Resource, down: set[int],
                     replica: int) -> Iterator[simpy.Event]:
    """One replica's failure: the job stalls while the failure is detected and the others
    reconfigure without the replica; then the replica relaunches and catches up while they train,
    and joins at one more reconfiguration."""
    down.add(replica)
    meter.change(env.now, healthy=-1)
    yield from _stall(env, meter, control, recovery.stall_s)
    yield env.timeout(recovery.relaunch_s + recovery.catchup_s)
    yield from _stall(env, meter, control, recovery.join_stall_s)
    down.discard(replica)
    meter.change(env.now, healthy=+1)


def simulate_replicas(recovery: ReplicaRecovery, replicas: int, failures: Failures,
                      horizon_s: float) -> Outcome:
    """ETTR of replica-level fault tolerance with ``replicas`` replicas under ``failures``.
    A failure that hits a replica already recovering costs nothing more: that replica's hosts are
    being replaced anyway."""
    import simpy
    env = simpy.Environment()
    meter = _Meter(replicas)
    control = simpy.Resource(env, capacity=1)
    down: set[int] = set()

    def strike(where: float) -> None:
        replica = int(where * replicas)
        if replica not in down:
            env.process(_replica_failure(env, recovery, meter, control, down, replica))

    env.process(_arrivals(env, failures, strike))
    env.run(until=horizon_s)
    meter.change(horizon_s)
    return Outcome(time=meter.train_s / horizon_s,
                   work=meter.work_s * recovery.throughput / horizon_s)


def simulate(recovery: SyncRecovery | ReplicaRecovery, gpus: int, failures: Failures,
             horizon_s: float) -> Outcome:
    """ETTR of one run of either recovery model on a job of ``gpus``."""
    if isinstance(recovery, SyncRecovery):
        return simulate_sync(recovery, failures, horizon_s)
    return simulate_replicas(recovery, num_replicas(gpus, recovery.replica_gpus), failures,
                             horizon_s)


def _traces(gpus: int, *, failure_model: str, failures: int, seeds: int,
            seed: int) -> Iterator[tuple[Failures, float]]:
    """The failure traces of one scale, ``seeds`` of them, each over ``failures`` MTTFs of
    virtual time: (trace, horizon). The same arguments give the same traces."""
    mttf_s = FAILURE_MODELS[failure_model](gpus)
    horizon_s = failures * mttf_s
    for k in range(seeds):
        yield poisson_failures(mttf_s, horizon_s, np.random.default_rng((seed, gpus, k))), horizon_s


def mean_ettr(recovery: SyncRecovery | ReplicaRecovery, gpus: int, *, failure_model: str,
              failures: int, seeds: int, seed: int) -> dict:
    """Mean ETTR of one recovery model at one scale over the traces of ``_traces``:
    {"work", "time", and across seeds (work-based) "sd", "min", "max"}."""
    runs = [simulate(recovery, gpus, trace, horizon_s)
            for trace, horizon_s in _traces(gpus, failure_model=failure_model,
                                            failures=failures, seeds=seeds, seed=seed)]
    work = [o.work for o in runs]
    return {"work": float(np.mean(work)), "time": float(np.mean([o.time for o in runs])),
            "sd": float(np.std(work)), "min": float(min(work)), "max": float(max(work))}


def ettr_at_scale(gpus: int, ftsystem: Callable[[int], ReplicaRecovery],
                  fthsdp: Callable[[int], ReplicaRecovery], *, failure_model: str,
                  failures: int, seeds: int, seed: int) -> dict:
    """Mean ETTR of the three recovery models at one scale, over ``seeds`` runs of about
    ``failures`` failures each, all on the same traces. ``ftsystem`` and ``fthsdp`` give their
    recoveries at a job size. Returns {"gpus", "mttf_min", "sync", "fthsdp", "ftsystem"
    (work-based), "time_based", and across seeds (work-based) "sd" and "range" ([min, max])}."""
    mttf_s = FAILURE_MODELS[failure_model](gpus)
    models = {"sync": sync_recovery(mttf_s), "fthsdp": fthsdp(gpus), "ftsystem": ftsystem(gpus)}
    means = {name: mean_ettr(model, gpus, failure_model=failure_model, failures=failures,
                             seeds=seeds, seed=seed) for name, model in models.items()}
    row: dict = {"gpus": gpus, "mttf_min": mttf_s / 60.0}
    row.update({name: m["work"] for name, m in means.items()})
    row["time_based"] = {name: m["time"] for name, m in means.items()}
    row["sd"] = {name: m["sd"] for name, m in means.items()}
    row["range"] = {name: [m["min"], m["max"]] for name, m in means.items()}
    return row


def paper_reproduced(row: dict) -> bool:
    """Whether a row of ``ettr_at_scale`` at PAPER_GPUS matches the paper within PAPER_TOLERANCE
    (work-based ETTR: the paper's FT-HSDP trains at reduced capacity while a replica recovers)."""
    return all(abs(row[name] - published) <= PAPER_TOLERANCE
               for name, published in PAPER_ETTR.items())


def model_assumptions(failure_model: str, fthsdp: ReplicaRecovery) -> dict:
    """The inputs of the sync and FT-HSDP models (``fthsdp`` at the paper's scale) and of the
    failure process, with their sources, for the report's ``assumptions``."""
    mttf_s = FAILURE_MODELS[failure_model](PAPER_GPUS)
    points = [(gpus, round(m / 60, 1)) for gpus, m in KOKOLIS_MTTF_S]
    curves = {
        "kokolis": f"job MTTF: power law through each pair of neighbouring published points "
                   f"{points} (GPUs, minutes), extended along the end segments "
                   "(Kokolis et al., HPCA 2025)",
        "llama3": f"constant per-GPU rate from Llama 3: {LLAMA3_INTERRUPTIONS} unexpected "
                  f"interruptions in {LLAMA3_DAYS} days on {LLAMA3_GPUS:,} GPUs",
    }
    return {
        "failures": {
            "model": failure_model,
            "curve": curves[failure_model],
            "process": "Poisson in wall-clock time at rate 1/MTTF(GPUs); each failure costs its "
                       "full recovery; recoveries never overlap (one after another)",
            "paper_scale_gpus": PAPER_GPUS,
            "mttf_min_at_paper_scale": mttf_s / 60,
            "per_gpu_failures_per_hour_at_paper_scale": HOUR_S / (mttf_s * PAPER_GPUS),
        },
        "sync": {
            "restart_s": SYNC_RESTART_S, "restart_source": "paper: 10-minute stall per failure",
            "checkpoint_write_s": CHECKPOINT_WRITE_S,
            "checkpoint_write_source": "assumed: blocking device-to-host snapshot of an "
                                       "asynchronous checkpoint",
            "checkpoint_interval": "Young/Daly optimum sqrt(2 x write x MTTF) at each scale",
            "checkpoint_interval_s_at_paper_scale":
                young_daly_interval_s(CHECKPOINT_WRITE_S, mttf_s),
            "lost_work": "training since the last completed checkpoint",
        },
        "fthsdp": {
            "stall_s": FTHSDP_STALL_S, "stall_source": "paper: 3-minute stall per failure, "
                                                       "whole job",
            "relaunch_s": fthsdp.relaunch_s,
            "relaunch_source": "model shared with ftsystem: replacement host wait (assumed) + "
                               "NCCL init of one replica's communicators (model); the paper "
                               "gives no per-replica relaunch time",
            "catchup_s": fthsdp.catchup_s, "join_stall_s": fthsdp.join_stall_s,
            "catchup_source": "paper: non-blocking catch-up, minimal stall (modelled as free)",
            "replica_gpus": REPLICA_GPUS, "min_replicas": MIN_REPLICAS,
            "replica_source": "assumed: not published",
            "replicas_at_paper_scale": num_replicas(PAPER_GPUS, REPLICA_GPUS),
        },
        "ettr": {
            "headline": "work-based",
            "time_based": "fraction of wall-clock time in which the job commits steps it keeps",
            "work_based": "samples kept / (wall-clock x full-capacity sample rate)",
            "paper_target": PAPER_ETTR, "paper_tolerance": PAPER_TOLERANCE,
        },
    }
