"""The paper's geo-distributed setup, loaded from YAML into dataclasses.

The YAML (``data/halos_paper_setup.yaml`` beside this module) gives the regions, the bandwidth
matrix, the worker speeds and every method's hyperparameters; the trace
(``data/h200_pythia_steps.json``) gives the parameter count of the Pythia model whose transfers
the time model charges. Both ship as package data; ``data/README.md`` says where they come from.
A malformed file raises ``SetupError`` naming the file and the entry, never a bare ``KeyError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


DATA_DIR = Path(__file__).resolve().with_name("data")
DEFAULT_SETUP = DATA_DIR / "halos_paper_setup.yaml"
DEFAULT_TRACE = DATA_DIR / "h200_pythia_steps.json"


class SetupError(ValueError):
    """The setup or trace file is missing, unreadable or lacks a well-formed entry."""


@dataclass(kw_only=True, slots=True)
class DelayedNesterovConfig:
    """Hyperparameters of the delayed Nesterov optimizer (Liu et al. 2024)."""

    lr: float
    """Step size per pseudo-gradient. The optimizer's own step is ``lr * buffer``, as in the
    authors' scripts (the YAML's "effective lr = lr * buffer"): ``lr`` is what one update moves."""
    beta: float
    """Momentum decay."""
    buffer: int = 1
    """N: pseudo-gradients summed before they enter the momentum together."""
    c: float = 0.0
    """Momentum activation between momentum updates; the paper uses 0."""


@dataclass(kw_only=True, slots=True)
class Network:
    """Regions, the bandwidth between them, and the workers in each."""

    bandwidth_gbps: list[list[float]]
    """Region x region bandwidth in Gbit/s; the diagonal is the bandwidth inside a region."""
    worker_speeds: list[list[float]]
    """Per region, the relative speed of each of its workers."""
    gps_region: int = 0
    """Region of the global parameter server (and of the single Async-Local-SGD server)."""

    @property
    def num_regions(self) -> int:
        return len(self.bandwidth_gbps)

    @property
    def worker_regions(self) -> list[int]:
        """Region of each worker, workers numbered region by region."""
        return [r for r, speeds in enumerate(self.worker_speeds) for _ in speeds]

    @property
    def speeds(self) -> list[float]:
        """Each worker's speed relative to the fastest, which is 1.0 (the authors normalize so)."""
        flat = [s for speeds in self.worker_speeds for s in speeds]
        return [s / max(flat) for s in flat]


@dataclass(kw_only=True, slots=True)
class TimeModel:
    """What virtual time is charged for: transfers of the simulated model and its local steps."""

    num_params: int
    """Parameters of the simulated model (Pythia-70M by default, from the trace)."""
    bytes_per_param: int = 4
    """fp32 weights and pseudo-gradients travel, as in the authors' simulator."""
    local_step_time_s: float
    """One local step of a speed-1.0 worker."""
    tokens_per_local_step: int
    """Local batch x sequence length of the simulated model, for tokens-to-loss."""
    link_sharing: bool = False
    """Concurrent transfers on one link (a region pair, one direction) share its bandwidth
    equally (``timemodel.SharedLink``). Off: every transfer gets the whole link, as in the
    authors' simulator."""

    @property
    def model_bytes(self) -> int:
        return self.num_params * self.bytes_per_param


@dataclass(kw_only=True, slots=True)
class WorkerOptimizer:
    """The workers' AdamW and its schedule."""

    lr: float
    """Peak learning rate."""
    betas: tuple[float, float]
    """AdamW betas."""
    eps: float
    """AdamW epsilon."""
    weight_decay: float
    """Decoupled weight decay, not applied to biases and norms."""
    grad_clip: float
    """Gradient-norm clip per local step."""
    warmup_fraction: float
    """Share of the iterations spent in linear warmup (the paper: 300 of 6144)."""


@dataclass(kw_only=True, slots=True)
class HalosConfig:
    """HALoS: workers -> local parameter servers -> global parameter server."""

    local_steps: int
    """H, before rescaling by worker speed."""
    workers_per_lps: int
    """Workers served by one LPS; an LPS's workers must share a region."""
    lps: DelayedNesterovConfig
    """Local momentum."""
    gps: DelayedNesterovConfig
    """Global momentum."""
    accumulation_k: int
    """Worker updates an LPS applies before it sends its delta to the GPS."""
    merge_alpha: float
    """Weight of the global model when an LPS merges it."""
    lps_groups: list[list[int]] | None = None
    """The workers each LPS serves, by worker index, groups of any size within one region;
    None: consecutive groups of ``workers_per_lps`` (the YAML's). ``lps_groups`` checks it."""


def lps_groups(halos: HalosConfig, network: Network) -> list[list[int]]:
    """The LPS groups of ``halos`` on ``network``: every worker in exactly one group, every
    group inside one region. Raises ``SetupError`` saying which group is wrong."""
    n = len(network.speeds)
    groups = halos.lps_groups or [list(range(i, min(i + halos.workers_per_lps, n)))
                                  for i in range(0, n, halos.workers_per_lps)]
    flat = sorted(w for g in groups for w in g)
    _require(all(groups) and flat == list(range(n)),
             f"halos: the LPS groups {groups} must be non-empty and hold each of the {n} "
             "workers exactly once")
    regions = network.worker_regions
    for g in groups:
        spans = sorted({regions[w] for w in g})
        _require(len(spans) == 1, f"halos: LPS of workers {g} spans regions {spans}; an LPS "
                 "serves the workers of its own region")
    return groups


def heterogeneous_network(network: Network, counts: list[int]) -> Network:
    """``network`` with ``counts[r]`` workers in region ``r``.

    Worker ``j`` of region ``r`` gets the ``j mod len``-th of the region's published speeds:
    fewer workers keep the first ones, more repeat them in order (so a region keeps its own
    mix of fast and slow workers; the paper gives no speeds for other counts).
    """
    _require(len(counts) == network.num_regions and all(c >= 1 for c in counts),
             f"workers per region {counts}: need one count >= 1 for each of the "
             f"{network.num_regions} regions")
    speeds = [[row[j % len(row)] for j in range(c)]
              for row, c in zip(network.worker_speeds, counts)]
    return Network(bandwidth_gbps=network.bandwidth_gbps, worker_speeds=speeds,
                   gps_region=network.gps_region)


@dataclass(kw_only=True, slots=True)
class DilocoConfig:
    """DiLoCo: synchronous rounds of H local steps, outer Nesterov SGD."""

    local_steps: int
    """H for every worker (DiLoCo) or before rescaling (DiLoCo + dynamic local updates)."""
    outer: DelayedNesterovConfig
    """Outer SGD with Nesterov momentum (buffer 1)."""


@dataclass(kw_only=True, slots=True)
class AsyncLocalSgdConfig:
    """Async-Local-SGD: one server that applies each worker's pseudo-gradient on arrival."""

    local_steps: int
    """H before rescaling."""
    dynamic_local_updates: bool
    """Rescale H by worker speed."""
    server: DelayedNesterovConfig
    """The server's delayed Nesterov momentum."""


@dataclass(kw_only=True, slots=True)
class PaperTraining:
    """The paper's Pythia-70M run (the YAML's ``pythia_70m``): what a scaled-down regime is
    compared with."""

    iterations: int
    """Global iterations of the run."""
    global_batch: int
    """Sequences per iteration, over all workers."""
    local_batch: int
    """Sequences per local step of one worker."""
    seq_len: int
    """Tokens per sequence."""

    @property
    def tokens(self) -> int:
        return self.iterations * self.global_batch * self.seq_len


@dataclass(kw_only=True, slots=True)
class PaperSetup:
    """Everything the YAML and the trace say."""

    network: Network
    """Regions, bandwidths, workers."""
    time_model: TimeModel
    """The cost model of virtual time."""
    worker: WorkerOptimizer
    """Local optimizer of every method."""
    halos: HalosConfig
    """HALoS hyperparameters."""
    diloco: DilocoConfig
    """DiLoCo hyperparameters (also DiLoCo + dynamic local updates)."""
    async_local_sgd: AsyncLocalSgdConfig
    """Async-Local-SGD hyperparameters."""
    paper_ratios: dict[str, dict[str, float]]
    """Reported time-to-loss relative to HALoS, per Pythia size."""
    paper_ablation: dict[str, dict[str, float]]
    """Reported ablation (billions of tokens to the target loss), per Pythia size."""
    paper_training: PaperTraining
    """The paper's Pythia-70M run: iterations, batches, sequence length."""


def load_setup(path: str | Path = DEFAULT_SETUP, *, trace: str | Path = DEFAULT_TRACE,
               model: str = "pythia-70m", step_time_ms: float | None = None) -> PaperSetup:
    """Read the paper's setup; ``model`` picks the trace entry the time model charges.

    The local step time is the YAML's (measured by the authors) when the YAML has a section for
    ``model``, else the trace's H200 time scaled to the local batch; ``step_time_ms`` overrides.
    """
    doc = _read_yaml(Path(path))
    try:
        return _build(doc, _read_json(Path(trace)), model, step_time_ms)
    except SetupError as err:
        raise SetupError(f"{path}: {err}") from None
    except KeyError as err:
        raise SetupError(f"{path}: missing entry {err}; compare it with {DEFAULT_SETUP}") from None
    except (TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as err:
        raise SetupError(f"{path}: malformed setup ({type(err).__name__}: {err}); "
                         f"compare it with {DEFAULT_SETUP}") from None


def trace_params(path: str | Path = DEFAULT_TRACE) -> dict[str, int]:
    """Parameters of each model of the trace (``pythia-70m``: 70,426,624, ...)."""
    try:
        return {k: int(v["params"]) for k, v in _read_json(Path(path))["models"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise SetupError(f"{path}: no models with params ({err})") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SetupError(f"cannot read the setup file {path}: {err.strerror}; "
                         "pass --setup PATH") from None
    except yaml.YAMLError as err:
        raise SetupError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise SetupError(f"{path}: expected a mapping at the top level, got {type(doc).__name__}")
    return doc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise SetupError(f"cannot read the trace {path}: {err.strerror}; "
                         "pass --trace PATH") from None
    except json.JSONDecodeError as err:
        raise SetupError(f"{path} is not valid JSON: {err}") from None


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SetupError(message)


def _build(doc: dict, trace: dict, model: str, step_time_ms: float | None) -> PaperSetup:
    network = _network(doc)
    halos = _halos(doc["halos"])
    _require(halos.workers_per_lps * doc["halos"]["num_lps"] == len(network.speeds),
             "halos: num_lps x workers_per_lps must equal the number of workers")
    lps_groups(halos, network)
    return PaperSetup(network=network, time_model=_time_model(doc, trace, model, step_time_ms),
                      worker=_worker(doc), halos=halos, diloco=_diloco(doc["diloco"]),
                      async_local_sgd=_async(doc["async_local_sgd"]),
                      paper_ratios=_paper_ratios(doc.get("reported_results", {})),
                      paper_ablation=_paper_ablation(doc.get("reported_results", {})),
                      paper_training=_paper_training(doc["pythia_70m"]))


def _network(doc: dict) -> Network:
    bw = [[float(x) for x in row] for row in doc["network_bandwidth_gbps"]]
    speeds = [[float(x) for x in row] for row in doc["worker_speeds"]]
    n = int(doc.get("num_regions", len(bw)))
    _require(len(bw) == n and all(len(row) == n for row in bw),
             f"network_bandwidth_gbps must be a {n} x {n} matrix (num_regions = {n})")
    _require(all(x > 0 for row in bw for x in row),
             "network_bandwidth_gbps: all entries must be > 0")
    _require(len(speeds) == n, f"worker_speeds must list the workers of each of the {n} regions")
    _require(all(s > 0 for row in speeds for s in row) and any(speeds),
             "worker_speeds: every speed must be > 0 and there must be workers")
    return Network(bandwidth_gbps=bw, worker_speeds=speeds)


def _time_model(doc: dict, trace: dict, model: str, step_time_ms: float | None) -> TimeModel:
    _require(model in trace.get("models", {}),
             f"the trace has no model {model!r}; it has {sorted(trace.get('models', {}))}")
    entry, section = trace["models"][model], doc["pythia_70m"]
    own = doc.get(model.replace("-", "_"), {})
    if step_time_ms is None:
        step_time_ms = own.get("local_step_time_ms") or \
            1e3 * entry["mb16x2048"]["step_s_median"] * section["local_batch"] / 16
    _require(step_time_ms > 0, "the local step time must be > 0")
    return TimeModel(num_params=int(entry["params"]), local_step_time_s=float(step_time_ms) / 1e3,
                     tokens_per_local_step=int(section["local_batch"]) * int(section["seq_len"]))


def _paper_training(section: dict) -> PaperTraining:
    return PaperTraining(iterations=int(section["total_iters"]),
                         global_batch=int(section["global_batch"]),
                         local_batch=int(section["local_batch"]), seq_len=int(section["seq_len"]))


def _worker(doc: dict) -> WorkerOptimizer:
    opt, sched = doc["worker_optimizer"], doc["pythia_70m"]
    betas = tuple(float(b) for b in opt["betas"])
    _require(len(betas) == 2, "worker_optimizer.betas must have two entries")
    return WorkerOptimizer(lr=float(opt["lr"]), betas=betas, eps=float(opt["eps"]),
                           weight_decay=float(opt["weight_decay"]),
                           grad_clip=float(opt.get("grad_clip", 0.0)),
                           warmup_fraction=sched["warmup_iters"] / sched["total_iters"])


def _nesterov(section: dict, beta_key: str = "beta") -> DelayedNesterovConfig:
    cfg = DelayedNesterovConfig(lr=float(section["lr"]), beta=float(section[beta_key]),
                                buffer=int(section.get("buffer", 1)),
                                c=float(section.get("c", 0.0)))
    _require(cfg.buffer >= 1 and 0 <= cfg.beta < 1 and cfg.lr > 0,
             f"bad delayed Nesterov settings {section}: need lr > 0, 0 <= beta < 1, buffer >= 1")
    return cfg


def _halos(section: dict) -> HalosConfig:
    cfg = HalosConfig(local_steps=int(section["local_steps_H"]),
                      workers_per_lps=int(section["workers_per_lps"]),
                      lps=_nesterov(section["lps"], "beta_l"),
                      gps=_nesterov(section["gps"], "beta_g"),
                      accumulation_k=int(section["accumulation_K"]),
                      merge_alpha=float(section["merge_alpha"]))
    _require(0 <= cfg.merge_alpha <= 1, "halos.merge_alpha must lie in [0, 1]")
    _require(cfg.local_steps >= 1 and cfg.accumulation_k >= 1 and cfg.workers_per_lps >= 1,
             "halos: local_steps_H, accumulation_K and workers_per_lps must be >= 1")
    return cfg


def _diloco(section: dict) -> DilocoConfig:
    _require("nesterov" in str(section.get("outer", "sgd nesterov")),
             "diloco.outer: only 'sgd nesterov' is implemented")
    outer = DelayedNesterovConfig(lr=float(section["outer_lr"]),
                                  beta=float(section["outer_momentum"]))
    return DilocoConfig(local_steps=int(section["local_steps_H"]), outer=outer)


def _async(section: dict) -> AsyncLocalSgdConfig:
    return AsyncLocalSgdConfig(local_steps=int(section["local_steps_H"]),
                               dynamic_local_updates=bool(section["dynamic_local_updates"]),
                               server=_nesterov(section))


def _paper_ratios(reported: dict) -> dict[str, dict[str, float]]:
    """The numeric time-to-loss ratios of ``reported_results`` (HALoS = 1), per model."""
    return {name: {k: float(v) for k, v in entry.items() if isinstance(v, (int, float))}
            for name, entry in reported.items()
            if name.startswith("pythia_") and isinstance(entry, dict)}


def _paper_ablation(reported: dict) -> dict[str, dict[str, float]]:
    """``ablation_<model>_tokens_to_loss_B`` entries of ``reported_results``, per model."""
    prefix, suffix = "ablation_", "_tokens_to_loss_B"
    return {name[len(prefix):-len(suffix)]: {k: float(v) for k, v in entry.items()}
            for name, entry in reported.items()
            if name.startswith(prefix) and name.endswith(suffix) and isinstance(entry, dict)}
