"""The configuration of a HALoS run in real mode, shared by every process through etcd.

The launcher writes one ``RealConfig`` as JSON to ``keys.halos_config(job)``; the GPS, the LPSs and
the workers read it at start, so their command lines carry only who they are. The hyperparameters
come from the paper's setup (``config.load_setup``), the shape (regions, workers, budget) from the
command line.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from ftsystem.halos.config import DelayedNesterovConfig, PaperSetup, WorkerOptimizer
from ftsystem.halos.rules import warmup_cosine_lr
from ftsystem.halos.workload import WorkloadConfig
from ftsystem.example.workload import ModelConfig

GPS = "gps"


def lps_name(region: int) -> str:
    """The node name (agent replica id and etcd key segment) of region ``region``'s LPS."""
    return f"lps{region}"


def worker_name(index: int) -> str:
    return f"w{index}"


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
    """H: local AdamW steps per worker job (no speed rescaling: the workers here are alike)."""
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
    """Emulated duration of one local step: a worker's job of H steps lasts at least H times
    this (the CPU step of the small model is padded with a sleep), as on a slower accelerator.
    0: as fast as the CPU goes."""
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
    def worker_regions(self) -> list[int]:
        """Region of each worker, in worker order (what ``Workload`` takes)."""
        return [i // self.workers_per_region for i in range(self.num_workers)]

    def node_names(self) -> list[str]:
        """Every process of the run, servers first (the order the launcher starts them in)."""
        return [GPS, *map(lps_name, range(self.num_regions)),
                *map(worker_name, range(self.num_workers))]

    @property
    def schedule_steps(self) -> int:
        """Local steps per worker the run is expected to take: the length of the lr schedule.

        Each global update costs K worker jobs of H steps at one LPS, spread over all workers.
        """
        return math.ceil(self.num_updates * self.accumulation_k * self.local_steps
                         / self.num_workers)

    def lrs(self, first_step: int, steps: int) -> list[float]:
        """The learning rates of a worker's local steps ``first_step .. first_step+steps-1``.

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
