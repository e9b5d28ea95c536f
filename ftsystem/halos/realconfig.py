"""The configuration of a HALoS run in real mode, shared by every process through etcd.

The launcher writes one ``RealConfig`` as JSON to ``keys.halos_config(job)``; the GPS, the LPSs and
the workers read it at start, so their command lines carry only who they are. The hyperparameters
come from the paper's setup (``config.load_setup``), the shape (regions, workers, budget) from the
command line.

Two optional parts make a run heterogeneous like the paper's setup: ``worker_speeds`` (each
worker's speed, its H rescaled and its emulated step time stretched by it) and
``bandwidth_bps`` (the region x region bandwidths that ``shaping`` enforces with ``tc`` when every
node runs in its own network namespace). Left empty, every worker runs alike and nothing is
shaped.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from ftsystem.halos.config import DelayedNesterovConfig, PaperSetup, WorkerOptimizer
from ftsystem.halos import rules
from ftsystem.halos.rules import warmup_cosine_lr
from ftsystem.halos.workload import WorkloadConfig
from ftsystem.example.workload import ModelConfig

GPS = "gps"


def lps_name(region: int) -> str:
    """The node name (agent replica id and etcd key segment) of region ``region``'s LPS."""
    return f"lps{region}"


def worker_name(index: int) -> str:
    return f"w{index}"


def speeds_of_regions(worker_speeds: list[list[float]], num_regions: int,
                      workers_per_region: int) -> list[float]:
    """The paper's per-region speeds for a run of ``num_regions x workers_per_region``: the
    first workers of the setup's first regions, normalized to the fastest of them (1.0)."""
    if num_regions > len(worker_speeds) or any(
            workers_per_region > len(row) for row in worker_speeds[:num_regions]):
        raise ValueError(f"the setup has {len(worker_speeds)} regions of "
                         f"{[len(r) for r in worker_speeds]} workers: {num_regions} x "
                         f"{workers_per_region} do not fit; use fewer regions or workers, or "
                         "leave the speeds out (all alike)")
    chosen = [s for row in worker_speeds[:num_regions] for s in row[:workers_per_region]]
    return [s / max(chosen) for s in chosen]


@dataclass(kw_only=True, slots=True)
class RealConfig:
    """One real-mode run: its shape, its budget, the HALoS hyperparameters, the workload."""

    num_regions: int = 2
    """Regions, one LPS each."""
    workers_per_region: int = 2
    """Workers per region; worker ``i`` belongs to region ``i // workers_per_region``."""
    num_updates: int = 16
    """Global updates (LPS deltas applied by the GPS) after which the run ends."""
    local_steps: int
    """H: local AdamW steps per job of a speed-1.0 worker; a slower worker's H is rescaled to
    ``ceil(H * speed / max_speed)`` (dynamic local updates, ``local_steps_of``)."""
    accumulation_k: int
    """Worker updates an LPS applies before it sends its delta to the GPS."""
    merge_alpha: float
    """Weight of the returned global model when an LPS merges it."""
    lps: DelayedNesterovConfig
    """Local momentum."""
    gps: DelayedNesterovConfig
    """Global momentum."""
    worker: WorkerOptimizer
    """The workers' AdamW and schedule."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """The small model and data, as in the simulator."""
    local_step_s: float = 0.0
    """Emulated duration of one local step of a speed-1.0 worker: a worker of speed ``s`` takes
    ``local_step_s / s`` per step, and its job of ``H_s`` steps lasts at least ``H_s`` times that
    (the CPU step of the small model is padded with a sleep), as on a slower accelerator.
    0: as fast as the CPU goes (speeds then only rescale H)."""
    worker_speeds: list[float] = field(default_factory=list)
    """Each worker's speed relative to the fastest of the run (1.0), in worker order; empty:
    every worker at 1.0, the same H and step time for all. ``speeds_of_regions`` takes them
    from the paper's setup (``worker_speeds``, per region)."""
    bandwidth_bps: list[list[float]] = field(default_factory=list)
    """Region x region link bandwidth in bit/s (the diagonal: inside a region), already scaled
    to this run's model and step time (``shaping.scaled_bandwidths``); a worker talks to its
    LPS at its region's diagonal entry, LPS ``r`` to the GPS at ``[gps_region][r]``. Empty:
    unshaped (loopback, or namespaces without ``tc``)."""
    gps_region: int = 0
    """The region the GPS runs in (the paper's setup: region 0)."""
    peer_wait_s: float = 120.0
    """How long a node waits for a peer (its LPS, the GPS) to come (back) before it gives up;
    long enough for a restart with backoff and a cold ``import torch`` on a loaded machine."""
    request_timeout_s: float = 30.0
    """HTTP timeout of one request between nodes."""
    state_dir: str = ""
    """Where the GPS and the LPSs keep their checkpoints (a restarted one resumes); empty: none."""

    def __post_init__(self) -> None:
        if min(self.num_regions, self.workers_per_region, self.num_updates, self.local_steps,
               self.accumulation_k) < 1:
            raise ValueError("regions, workers per region, updates, local steps (H) and "
                             "accumulation K must all be >= 1")
        if self.local_step_s < 0:
            raise ValueError(f"local step time {self.local_step_s} must be >= 0")
        if not 0 <= self.merge_alpha <= 1:
            raise ValueError(f"merge alpha {self.merge_alpha} must lie in [0, 1]")
        if self.worker_speeds and (len(self.worker_speeds) != self.num_workers
                                   or min(self.worker_speeds) <= 0):
            raise ValueError(f"worker speeds {self.worker_speeds}: need {self.num_workers} "
                             "speeds > 0, one per worker")
        n = self.num_regions
        if self.bandwidth_bps and (len(self.bandwidth_bps) != n
                                   or any(len(row) != n for row in self.bandwidth_bps)
                                   or min(map(min, self.bandwidth_bps)) <= 0):
            raise ValueError(f"bandwidths: need a {n} x {n} matrix of rates > 0 (bit/s)")
        if not 0 <= self.gps_region < n:
            raise ValueError(f"GPS region {self.gps_region}: the run has regions 0..{n - 1}")

    @classmethod
    def from_setup(cls, setup: PaperSetup, **overrides) -> RealConfig:
        """The paper's HALoS hyperparameters; ``overrides`` set any field (shape, budget, H, K)."""
        h = setup.halos
        values = {"local_steps": h.local_steps, "accumulation_k": h.accumulation_k,
                  "merge_alpha": h.merge_alpha, "lps": h.lps, "gps": h.gps,
                  "worker": setup.worker}
        values.update((k, v) for k, v in overrides.items() if v is not None)
        return cls(**values)

    @property
    def num_workers(self) -> int:
        return self.num_regions * self.workers_per_region

    @property
    def model_bytes(self) -> int:
        """The model's fp32 bytes: what a transfer carries (the wire format adds about 1 KB)."""
        from ftsystem.example.workload import TinyGPT, num_params  # torch: only when asked

        return 4 * num_params(TinyGPT(self.workload.model))

    @property
    def worker_regions(self) -> list[int]:
        """Region of each worker, in worker order (what ``Workload`` takes)."""
        return [i // self.workers_per_region for i in range(self.num_workers)]

    def node_names(self) -> list[str]:
        """Every process of the run, servers first (the order the launcher starts them in)."""
        return [GPS, *map(lps_name, range(self.num_regions)),
                *map(worker_name, range(self.num_workers))]

    def speed_of(self, index: int) -> float:
        """Worker ``index``'s speed relative to the fastest (1.0 when all are alike)."""
        return self.worker_speeds[index] / max(self.worker_speeds) if self.worker_speeds else 1.0

    def local_steps_of(self, index: int) -> int:
        """Worker ``index``'s H: ``ceil(H * speed / max_speed)`` (the paper's dynamic local
        updates), H itself when all are alike."""
        return rules.scaled_local_steps(self.local_steps, self.speed_of(index), 1.0)

    def step_s_of(self, index: int) -> float:
        """Worker ``index``'s emulated seconds per local step: ``local_step_s / speed``."""
        return self.local_step_s / self.speed_of(index)

    @property
    def mean_local_steps(self) -> float:
        """The workers' mean H: one job of each advances the schedule by this much per worker."""
        return sum(map(self.local_steps_of, range(self.num_workers))) / self.num_workers

    def schedule_position(self, pushes: int) -> int:
        """Where in the lr schedule a worker's job starts after ``pushes`` acknowledged jobs.

        As in the simulator (and the authors'), the schedule follows the work handed out in
        all: a job advances it by the mean H whatever the worker's own H, so a fast worker
        does not run ahead of a slow one. With equal speeds this is the worker's own steps.
        """
        return round(pushes * self.mean_local_steps)

    @property
    def schedule_steps(self) -> int:
        """Local steps per worker the run is expected to take: the length of the lr schedule.

        Each global update costs K worker jobs (of mean H steps) at one LPS, spread over all
        workers.
        """
        return math.ceil(self.num_updates * self.accumulation_k * self.mean_local_steps
                         / self.num_workers)

    def lrs(self, first_step: int, steps: int) -> list[float]:
        """The learning rates of local steps ``first_step .. first_step+steps-1`` of the
        schedule (``schedule_position`` gives a job's first).

        The schedule is stepped before each step (as the authors' worker does): step ``k``
        runs at schedule position ``k + 1``, so no step runs at the warmup's lr of 0.
        """
        total = self.schedule_steps
        warmup = round(self.worker.warmup_fraction * total)
        return [warmup_cosine_lr(first_step + j + 1, max_lr=self.worker.lr, warmup=warmup,
                                 total=total) for j in range(steps)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: bytes | str) -> RealConfig:
        raw = json.loads(data)
        workload, worker = raw.pop("workload"), raw.pop("worker")
        workload["model"] = ModelConfig(**workload["model"])
        worker["betas"] = tuple(worker["betas"])
        lps, gps = (DelayedNesterovConfig(**raw.pop(k)) for k in ("lps", "gps"))
        return cls(**raw, lps=lps, gps=gps, worker=WorkerOptimizer(**worker),
                   workload=WorkloadConfig(**workload))
