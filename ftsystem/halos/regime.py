"""``ftsystem bench halos``: the five methods in a tuned regime closer to the paper's.

The bench runs in this order, each stage fixed before the next one runs:

1. **Tuning** on the validation half of the held-out text and a seed of its own
   (``RegimeConfig.tune_seed``), never on what is reported. First sync and a single worker
   (one worker alone, the local batch) at each of ``lrs``; then each local method over a grid of
   inner lrs (the paper's, and the single worker's best if it differs) and outer lrs (the paper's
   times each of ``outer_scales``; HALoS: the LPS's and the GPS's, each scaled). Every method
   keeps the point of its own grid with the lowest final validation loss (``choose``).
2. **Targets** from the tuning runs alone (``targets_from``): round losses that every tuned
   method's tuning run got below, with a margin.
3. **Measured runs** of the five tuned methods on the test half, for every seed.
4. **The ablation** (FedAH, +momentum, +merging, +accumulation = HALoS) and **the K sweep** from
   tuned HALoS, and **the time-model check**: the same methods charged with the trained model's
   own size and its measured step time instead of Pythia-70M's (``time_model_check``).

The JSON gives, per target and method, the virtual time and the tokens to the target, median
with min and max over the seeds, each method's ratio to HALoS (per seed, then summarized), and
every curve. ``summary`` builds it; ``plot`` draws the ratio against the target.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ftsystem.example.workload import TinyGPT
from ftsystem.example.workload import num_params as num_params_of
from ftsystem.halos import experiment, rules, studies
from ftsystem.halos.config import Network, PaperSetup, lps_groups
from ftsystem.halos.experiment import Variant, spread
from ftsystem.halos.runcache import RunCache, run_key
from ftsystem.halos.simulator import (
    METHODS,
    SYNCHRONOUS,
    Curve,
    SimConfig,
    round_steps,
    sync_round_s,
)
from ftsystem.halos.workload import Workload, WorkloadConfig, text_model

LOCAL = ("halos", "diloco", "diloco_dynupd", "async_local_sgd")
"""The methods whose workers run local steps (inner and outer learning rates)."""
SINGLE = "single"
"""One worker alone, training on its local batch (sync on a network of one worker)."""
HYPERPARAMETERS = {
    "sync": ("lr",),
    SINGLE: ("lr",),
    "diloco": ("inner_lr", "outer_lr"),
    "diloco_dynupd": ("inner_lr", "outer_lr"),
    "async_local_sgd": ("inner_lr", "server_lr"),
    "halos": ("inner_lr", "lps_lr", "gps_lr"),
}
"""What the tuning sweeps, per method: ``lr`` is the AdamW peak lr of sync's single
optimizer; ``inner_lr`` the workers' AdamW peak lr; the rest the servers' delayed Nesterov lr."""
TARGET_STEP = 0.05
TARGET_MARGIN = 0.05
TARGET_OFFSETS = (0.3, 0.1, 0.0)
TARGET_RULE = (
    f"m = the highest of the tuned methods' lowest validation losses in their tuning runs; the "
    f"hardest target is m + {TARGET_MARGIN} rounded up to a multiple of {TARGET_STEP}, the "
    f"others that plus {', '.join(f'{o:g}' for o in TARGET_OFFSETS if o)}; fixed before the "
    "measured runs")
CHOICE_RULE = ("per method, the point of its grid with the lowest final held-out loss on the "
               "validation half, tuning seed only")
PLOT_LOSS_SPAN = 1.0
"""The ratio plot covers losses from the hardest target to this much above it."""


@dataclass(kw_only=True, slots=True)
class RegimeConfig:
    """The regime: the model, the budget, the tuning grid and what is measured."""

    model: str = "small"
    """A ``workload.TEXT_MODELS`` name."""
    seq_len: int = 64
    """Context of the character model."""
    local_batch: int = 8
    """Sequences per local step (sync: this times the workers per step)."""
    iters: int = 1536
    """Global iterations per run (the paper: 6144)."""
    eval_points: int = 64
    """Held-out evaluations per run."""
    eval_sequences: int = 256
    """Held-out windows per evaluation (of the validation half in tuning, else of the test)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of the measured runs (data streams and initial model)."""
    tune_seed: int = 100
    """Seed of the tuning runs: other data and another initial model than any measured run."""
    lrs: tuple[float, ...] = (1e-3, 2e-3, 4e-3)
    """AdamW peak lrs tried for sync and for a single worker."""
    outer_scales: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    """Multiples of the paper's outer lrs tried for each local method: reaching well below the
    paper's, since in this regime (batches far below the paper's) HALoS's and DiLoCo's best
    outer lrs lie below it, and a choice at the grid's edge is no optimum."""
    k_values: tuple[int, ...] = (8, 16, 32)
    """Update accumulation K of the K sweep (tuned HALoS otherwise)."""
    noise_every: int = 16
    """Sync measures the gradient noise scale every this many steps (0: never)."""
    step_probe: int = 64
    """Local steps timed to measure the trained model's step time (time-model check)."""
    jobs: int = 1
    """Runs at once, in forked processes."""

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds}: give distinct seeds")
        if self.tune_seed in self.seeds:
            raise ValueError(f"the tuning seed {self.tune_seed} must differ from the measured "
                             f"seeds {self.seeds}")
        if not self.lrs or not self.outer_scales or not self.k_values:
            raise ValueError("lrs, outer_scales and k_values must not be empty")

    def sim(self, split: str) -> SimConfig:
        """One run's settings, its held-out loss measured on ``split``."""
        work = WorkloadConfig(model=text_model(self.model, seq_len=self.seq_len), data="text",
                              local_batch=self.local_batch, eval_sequences=self.eval_sequences,
                              eval_split=split)
        return SimConfig(total_iters=self.iters, eval_points=self.eval_points, workload=work,
                         noise_every=self.noise_every)

    @property
    def tokens_per_step(self) -> int:
        return self.local_batch * self.seq_len


Progress = Callable[[Curve, int], None]


def paper_hyperparameters(setup: PaperSetup, method: str) -> dict[str, float]:
    """The setup's (the paper's) values of what the tuning sweeps for ``method``."""
    values = {"lr": setup.worker.lr, "inner_lr": setup.worker.lr,
              "outer_lr": setup.diloco.outer.lr, "server_lr": setup.async_local_sgd.server.lr,
              "lps_lr": setup.halos.lps.lr, "gps_lr": setup.halos.gps.lr}
    return {k: values[k] for k in HYPERPARAMETERS[method]}


def apply(setup: PaperSetup, method: str, hp: dict[str, float]) -> PaperSetup:
    """``setup`` with ``hp`` (names of ``HYPERPARAMETERS[method]``); a single worker's setup
    for ``SINGLE``."""
    unknown = set(hp) - set(HYPERPARAMETERS[method])
    if unknown:
        raise ValueError(f"{method} has no hyperparameters {sorted(unknown)}; it has "
                         f"{', '.join(HYPERPARAMETERS[method])}")
    lr = hp.get("lr", hp.get("inner_lr", setup.worker.lr))
    out = replace(setup, worker=replace(setup.worker, lr=lr))
    if "outer_lr" in hp:
        out = replace(out, diloco=replace(out.diloco, outer=replace(out.diloco.outer,
                                                                    lr=hp["outer_lr"])))
    if "server_lr" in hp:
        a = out.async_local_sgd
        out = replace(out, async_local_sgd=replace(a, server=replace(a.server,
                                                                     lr=hp["server_lr"])))
    if "lps_lr" in hp:
        h = out.halos
        out = replace(out, halos=replace(h, lps=replace(h.lps, lr=hp["lps_lr"]),
                                         gps=replace(h.gps, lr=hp["gps_lr"])))
    return single_worker(out) if method == SINGLE else out


def single_worker(setup: PaperSetup) -> PaperSetup:
    """The setup with one worker of speed 1 in one region: sync there is that worker alone."""
    inside = setup.network.bandwidth_gbps[0][0]
    return replace(setup, network=Network(bandwidth_gbps=[[inside]], worker_speeds=[[1.0]]))


def grid(setup: PaperSetup, method: str, cfg: RegimeConfig,
         inner_lrs: Sequence[float] = ()) -> list[dict[str, float]]:
    """The tuning points of ``method``: ``cfg.lrs`` for sync and a single worker; for a local
    method each of ``inner_lrs`` with the paper's outer lrs times each of ``cfg.outer_scales``
    (HALoS: the LPS's and the GPS's scaled independently)."""
    if method in ("sync", SINGLE):
        return [{"lr": lr} for lr in cfg.lrs]
    paper = paper_hyperparameters(setup, method)
    outer = [k for k in HYPERPARAMETERS[method] if k != "inner_lr"]
    points = [{"inner_lr": lr} for lr in inner_lrs]
    for key in outer:
        points = [p | {key: paper[key] * s} for p in points for s in cfg.outer_scales]
    return points


def name_of(method: str, hp: dict[str, float]) -> str:
    return f"{method} " + " ".join(f"{k}={v:g}" for k, v in hp.items())


@dataclass(kw_only=True, slots=True)
class Tuned:
    """One method's tuning: every point tried, its curve, and the choice."""

    points: list[dict[str, float]]
    """The grid, in the order run."""
    curves: list[Curve]
    """Each point's validation curve (tuning seed)."""

    @property
    def best(self) -> int:
        """Index of the point with the lowest final validation loss (a diverged run: never)."""
        finals = [c.final_loss if math.isfinite(c.final_loss) else math.inf for c in self.curves]
        return finals.index(min(finals))

    @property
    def choice(self) -> dict[str, float]:
        return self.points[self.best]

    @property
    def curve(self) -> Curve:
        return self.curves[self.best]


def tune(setup: PaperSetup, cfg: RegimeConfig, progress: Progress,
         cache: RunCache | None) -> dict[str, Tuned]:
    """Sync and a single worker over ``cfg.lrs``; then each local method over its grid, with
    the paper's inner lr and the single worker's best."""
    first = {m: grid(setup, m, cfg) for m in ("sync", SINGLE)}
    tuned = _run_grid(setup, cfg, first, progress, cache)
    inner = sorted({setup.worker.lr, tuned[SINGLE].choice["lr"]})
    second = {m: grid(setup, m, cfg, inner) for m in LOCAL}
    return tuned | _run_grid(setup, cfg, second, progress, cache)


def _run_grid(setup: PaperSetup, cfg: RegimeConfig, grids: dict[str, list[dict]],
              progress: Progress, cache: RunCache | None) -> dict[str, Tuned]:
    sim = cfg.sim("validation")
    tasks = [(apply(setup, m, hp), sim, Variant(name=name_of(m, hp),
                                                method="sync" if m == SINGLE else m),
              cfg.tune_seed) for m, points in grids.items() for hp in points]
    curves = iter(experiment.run_all(tasks, cfg.jobs, progress, cache))
    return {m: Tuned(points=points, curves=[next(curves) for _ in points])
            for m, points in grids.items()}


def targets_from(tuned: dict[str, Tuned]) -> list[float]:
    """``TARGET_RULE``: from the tuned methods' tuning curves, easiest target first."""
    reach = max(min(t.curve.loss) for m, t in tuned.items() if m in METHODS)
    hardest = math.ceil(round((reach + TARGET_MARGIN) / TARGET_STEP, 6)) * TARGET_STEP
    return [round(hardest + o, 4) for o in TARGET_OFFSETS]


def tuned_setups(setup: PaperSetup, tuned: dict[str, Tuned]) -> dict[str, PaperSetup]:
    """Each method's setup with its chosen hyperparameters."""
    return {m: apply(setup, m, tuned[m].choice) for m in METHODS}


@dataclass(kw_only=True, slots=True)
class Measured:
    """What the measured stages ran: per variant, one test curve per seed."""

    curves: dict[str, list[Curve]]
    """Methods, ablation steps (``experiment.ABLATION``), ``K=k`` and the time-model check's
    ``<method> own`` runs."""
    ablation: list[str]
    """Ablation step names, in order (the last is HALoS's curves)."""
    k_sweep: dict[int, str]
    """K -> the curves' name (tuned HALoS's K: ``halos``)."""
    own_setups: dict[str, PaperSetup]
    """The time-model check's setups (trained model's size and step time)."""
    step_s: float
    """The measured CPU seconds of one local step of the trained model."""


OWN = " own"
"""Suffix of a time-model check's curves."""


def measure(setup: PaperSetup, setups: dict[str, PaperSetup], cfg: RegimeConfig,
            progress: Progress, cache: RunCache | None) -> Measured:
    """The tuned methods for every seed on the test half; then the ablation, the K sweep and
    the time-model check, from the same tuned settings."""
    sim = cfg.sim("test")
    main = [(setups[m], sim, Variant(name=m, method=m), s) for m in METHODS for s in cfg.seeds]
    base = setups["halos"]
    steps = [(base, sim, v, s) for v in experiment.ablation_variants(base) for s in cfg.seeds]
    k_names = {k: "halos" if k == base.halos.accumulation_k else f"K={k}"
               for k in cfg.k_values}
    ks = [(base, sim, Variant(name=n, method="halos",
                              halos=studies.with_param(base.halos, "K", k)), s)
          for k, n in k_names.items() if n != "halos" for s in cfg.seeds]
    step_s = _step_s(setup, cfg, cache)
    own = {m: own_time_model(setups[m], cfg, step_s) for m in METHODS}
    checks = [(own[m], sim, Variant(name=m + OWN, method=m), s)
              for m in METHODS if m not in SYNCHRONOUS for s in cfg.seeds]
    tasks = main + steps + ks + checks
    curves: dict[str, list[Curve]] = {}
    for task, curve in zip(tasks, experiment.run_all(tasks, cfg.jobs, progress, cache)):
        curves.setdefault(task[2].name, []).append(curve)
    curves["+accumulation"] = curves["halos"]
    for m in SYNCHRONOUS:  # their losses do not depend on the time model: retimed, not rerun
        factor = _round_s(own[m], m) / _round_s(setups[m], m)
        curves[m + OWN] = [retimed(c, factor) for c in curves[m]]
    return Measured(curves=curves, ablation=list(experiment.ABLATION), k_sweep=k_names,
                    own_setups=own, step_s=step_s)


def _round_s(setup: PaperSetup, method: str) -> float:
    return sync_round_s(setup, round_steps(setup, method))


def retimed(curve: Curve, factor: float) -> Curve:
    """A synchronous method's curve with every round ``factor`` times as long."""
    return replace(curve, time_s=[t * factor for t in curve.time_s],
                   local_steps=list(curve.local_steps), loss=list(curve.loss))


def _step_s(setup: PaperSetup, cfg: RegimeConfig, cache: RunCache | None) -> float:
    """The trained model's measured step time; with a cache, measured once per model."""
    if cache is None:
        return measure_step_s(setup, cfg)
    key = "step-s-" + run_key(setup, cfg.sim("test"), "step")
    return cache.measured(key, lambda: measure_step_s(setup, cfg))


def measure_step_s(setup: PaperSetup, cfg: RegimeConfig) -> float:
    """CPU seconds of one local step of the trained model at the local batch (one thread; the
    median of three timings of ``cfg.step_probe`` steps after one untimed)."""
    work = Workload(cfg.sim("test").workload, [0], setup.worker)
    lrs = [setup.worker.lr] * cfg.step_probe
    work.train(0, work.theta0, lrs[:1])
    times = []
    for _ in range(3):
        start = time.process_time()
        work.train(0, work.theta0, lrs)
        times.append((time.process_time() - start) / cfg.step_probe)
    return statistics.median(times)


def own_time_model(setup: PaperSetup, cfg: RegimeConfig, step_s: float) -> PaperSetup:
    """``setup`` charging the trained model's fp32 bytes and ``step_s`` per local step."""
    num_params = num_params_of(TinyGPT(cfg.sim("test").workload.model))
    return replace(setup, time_model=replace(setup.time_model, num_params=num_params,
                                             local_step_time_s=step_s))


# ---- figures -------------------------------------------------------------------------------


def noise_scale(curves: Sequence[Curve], *, small: int, big: int,
                windows: int = 4) -> list[dict]:
    """The simple gradient noise scale B = tr(Sigma) / |G|^2 of sync's runs, in sequences, per
    ``windows`` equal shares of the budget (McCandlish et al. 2018, appendix A.1).

    Each probe gives ``|g_small|^2`` (mean over workers of their own batch of ``small``) and
    ``|g_big|^2`` (the mean gradient, ``big`` sequences); unbiased estimates of ``|G|^2`` and
    ``tr(Sigma)`` follow from the two, averaged over the window's probes of every seed before
    their ratio is taken (the ratio of means is the stable estimate)."""
    probes = [p for c in curves for p in c.noise]
    if not probes:
        return []
    budget = max(c.local_steps[-1] for c in curves)
    out = []
    for w in range(windows):
        lo, hi = w * budget / windows, (w + 1) * budget / windows
        inside = [p for p in probes if lo <= p[0] < hi]
        if not inside:
            continue
        g_small = statistics.fmean(p[1] for p in inside)
        g_big = statistics.fmean(p[2] for p in inside)
        g2 = (big * g_big - small * g_small) / (big - small)
        trace = (g_small - g_big) / (1 / small - 1 / big)
        losses = [experiment.loss_at(c, hi) for c in curves]
        out.append({"share": [round(lo / budget, 3), round(hi / budget, 3)],
                    "probes": len(inside), "sync_loss_at_end": statistics.median(losses),
                    "b_simple_sequences": trace / g2 if g2 > 0 else None})
    return out


def _at(curves: dict[str, list[Curve]], names: Sequence[str], loss: float,
        tokens_per_step: int, base: str | None) -> dict:
    study = experiment.Study(curves=curves, targets=[], budget=0)
    return experiment.at_target(study, names, loss, tokens_per_step=tokens_per_step,
                                base=base or "")


def _entry(curves: dict[str, list[Curve]], names: Sequence[str], loss: float, tps: int,
           base: str) -> dict:
    """Time and tokens to ``loss`` per name, and the ratios to ``base`` (keys without it)."""
    at = _at(curves, names, loss, tps, base)
    return {"loss": loss, "time_to_loss_s": at["time_to_loss_s"],
            "tokens_to_loss": at["tokens_to_loss"], "time_vs_base": at["time_vs_" + base],
            "tokens_vs_base": at["tokens_vs_" + base]}


def ranking(entry: dict) -> list[str]:
    """Methods by median time to the target, fastest first (a method that misses: last)."""
    times = entry["time_to_loss_s"]
    return sorted(times, key=lambda m: (times[m]["median"] is None,
                                        times[m]["median"] or 0.0))


def exchanges_per_lps(setup: PaperSetup, iters: int) -> float:
    """HALoS's expected LPS-GPS exchanges per LPS in ``iters`` iterations, from rates alone:
    worker w does a share of the local steps proportional to its speed, in pushes of its H, and
    an LPS sends every K pushes (transfer times and the pushes that land during an exchange
    neglected)."""
    speeds, h = setup.network.speeds, setup.halos
    steps = iters * len(speeds)
    pushes = [steps * s / sum(speeds) / rules.scaled_local_steps(h.local_steps, s, max(speeds))
              for s in speeds]
    groups = lps_groups(h, setup.network)
    return statistics.fmean(sum(pushes[w] for w in g) / h.accumulation_k for g in groups)


def regime_figures(setup: PaperSetup, cfg: RegimeConfig, num_params: int,
                   measured: Measured) -> dict:
    """How the regime compares with the paper's: tokens per parameter, outer steps, batches."""
    workers = len(setup.network.speeds)
    tokens = cfg.iters * workers * cfg.tokens_per_step
    p, pythia = setup.paper_training, setup.time_model
    halos, sync = measured.curves["halos"], measured.curves["sync"]
    lps = len(lps_groups(setup.halos, setup.network))
    return {
        "local_steps_per_run": cfg.iters * workers, "tokens_per_run": tokens,
        "tokens_per_param": round(tokens / num_params, 1),
        "local_batch_tokens": cfg.tokens_per_step,
        "sync_batch_tokens": cfg.tokens_per_step * workers,
        "diloco_rounds": statistics.median(c.updates for c in measured.curves["diloco"]),
        "halos_gps_updates": spread([c.updates for c in halos]),
        "halos_exchanges_per_lps": statistics.median(c.updates for c in halos) / lps,
        "halos_exchanges_per_lps_expected": round(exchanges_per_lps(setup, cfg.iters), 1),
        "async_server_updates": spread([c.updates for c in measured.curves["async_local_sgd"]]),
        "gradient_noise_scale": noise_scale(sync, small=cfg.local_batch,
                                            big=cfg.local_batch * workers),
        "paper": {"model": "pythia-70m", "params": pythia.num_params,
                  "iterations": p.iterations, "tokens": p.tokens,
                  "tokens_per_param": round(p.tokens / pythia.num_params, 1),
                  "diloco_rounds": p.iterations // setup.diloco.local_steps,
                  "halos_exchanges_per_lps_expected": round(
                      exchanges_per_lps(setup, p.iterations), 1),
                  "local_batch_tokens": p.local_batch * p.seq_len,
                  "global_batch_tokens": p.global_batch * p.seq_len},
    }


def tuning_figures(setup: PaperSetup, tuned: dict[str, Tuned]) -> dict:
    return {m: {"hyperparameters": t.choice, "paper": paper_hyperparameters(setup, m),
                "sweep": [{"hyperparameters": hp, "final_loss": c.final_loss,
                           "min_loss": min(c.loss), "wall_s": round(c.wall_s, 1)}
                          for hp, c in zip(t.points, t.curves)]}
            for m, t in tuned.items()}


def tuning_summary(setup: PaperSetup, cfg: RegimeConfig, tuned: dict[str, Tuned],
                   targets: list[float]) -> dict:
    """The tuning alone (what ``--tune-only`` writes)."""
    return {"rule": CHOICE_RULE, "split": "validation (the held-out text's even blocks)",
            "seed": cfg.tune_seed, "iterations": cfg.iters,
            "grid": {"lrs": list(cfg.lrs), "outer_scales": list(cfg.outer_scales)},
            "methods": tuning_figures(setup, tuned), "targets": targets,
            "target_rule": TARGET_RULE,
            "curves": {m: [{"hyperparameters": hp, "time_s": c.time_s,
                            "local_steps": c.local_steps, "loss": c.loss}
                           for hp, c in zip(t.points, t.curves)] for m, t in tuned.items()}}


def summary(setup: PaperSetup, cfg: RegimeConfig, *, tuned: dict[str, Tuned],
            targets: list[float], measured: Measured, corpus: dict, num_params: int,
            model: str) -> dict:
    """The bench's JSON figures (without the machine, which the caller adds)."""
    tps, curves = cfg.tokens_per_step, measured.curves
    entries = [_entry(curves, list(METHODS), t, tps, "halos") for t in targets]
    out = {
        "corpus": corpus, "model": model, "model_params": num_params,
        "iterations": cfg.iters, "seeds": cfg.seeds,
        "regime": regime_figures(setup, cfg, num_params, measured),
        "tuned": tuning_summary(setup, cfg, tuned, targets),
        "target_rule": TARGET_RULE,
        "targets": [{"loss": e["loss"], "time_to_loss_s": e["time_to_loss_s"],
                     "tokens_to_loss": e["tokens_to_loss"]} for e in entries],
        "all_reached": all(s["reached"] == len(cfg.seeds) for e in entries
                           for s in e["time_to_loss_s"].values()),
        "ratios_vs_halos": [{"loss": e["loss"], "time": e["time_vs_base"],
                             "tokens": e["tokens_vs_base"]} for e in entries],
        "tokens_vs_sync": [{"loss": t, **_at(curves, list(METHODS), t, tps, "sync")[
            "tokens_vs_sync"]} for t in targets],
        "final_loss": {m: spread([c.final_loss for c in curves[m]]) for m in METHODS},
        "virtual_time_s": {m: spread([c.time_s[-1] for c in curves[m]]) for m in METHODS},
        "ablation": _ablation(setup, curves, measured, targets, tps),
        "k_sweep": _k_sweep(curves, measured, targets, tps),
        "time_model_check": _time_model_check(setup, curves, measured, targets, entries),
        "ratio_curve": _ratio_curve(curves, targets, tps),
        "paper": experiment.paper_figures(setup, "pythia_70m"),
        "config": {"model": cfg.model, "seq_len": cfg.seq_len, "local_batch": cfg.local_batch,
                   "eval_points": cfg.eval_points, "eval_sequences": cfg.eval_sequences,
                   "eval_split": "test (the held-out text's odd blocks)",
                   "workers": len(setup.network.speeds), "noise_every": cfg.noise_every,
                   "time_model": dataclasses.asdict(setup.time_model)},
        "wall_s": {n: round(sum(c.wall_s for c in cs), 1) for n, cs in curves.items()
                   if n not in _reused(measured)},
        "cpu_s": {n: round(sum(c.cpu_s for c in cs), 1) for n, cs in curves.items()
                  if n not in _reused(measured)},
        "tuning_cpu_s": round(sum(c.cpu_s for t in tuned.values() for c in t.curves), 1),
        "curves": {n: [{"seed": s, "time_s": c.time_s, "local_steps": c.local_steps,
                        "loss": c.loss, "updates": c.updates} for s, c in zip(cfg.seeds, cs)]
                   for n, cs in curves.items() if n not in _reused(measured)},
    }
    return out


def _reused(measured: Measured) -> set[str]:
    """Curve names that are other runs' curves (not run again)."""
    return {"+accumulation"} | {m + OWN for m in SYNCHRONOUS}


def _ablation(setup: PaperSetup, curves: dict, measured: Measured, targets: list[float],
              tps: int) -> dict:
    steps = measured.ablation
    paper = setup.paper_ablation.get("pythia_70m", {})
    halos_b = paper.get("plus_accumulation")
    return {
        "steps": {v: experiment.ABLATION_RULE[v] for v in steps},
        "targets": [_entry(curves, steps, t, tps, "+accumulation") for t in targets],
        "final_loss": {v: spread([c.final_loss for c in curves[v]]) for v in steps},
        "paper_tokens_to_loss_B": paper,
        "paper_tokens_vs_halos": {v: round(paper[k] / halos_b, 2) for v in steps
                                  if (k := v.replace("+", "plus_")) in paper and halos_b},
    }


def _k_sweep(curves: dict, measured: Measured, targets: list[float], tps: int) -> dict:
    names = list(measured.k_sweep.values())
    rename = {n: f"K={k}" for k, n in measured.k_sweep.items()}
    entries = []
    for t in targets:
        e = _entry(curves, names, t, tps, "halos")
        entries.append({key: ({rename[n]: v for n, v in e[key].items()}
                              if isinstance(e[key], dict) else e[key]) for key in e})
    return {"values": list(measured.k_sweep), "targets": entries,
            "final_loss": {rename[n]: spread([c.final_loss for c in curves[n]])
                           for n in names},
            "paper": "the paper's K sweep (its Figure 5) is not quoted in the shipped setup; "
                     "it uses K = 32"}


def _time_model_check(setup: PaperSetup, curves: dict, measured: Measured,
                      targets: list[float], pythia: list[dict]) -> dict:
    own = {m: curves[m + OWN] for m in METHODS}
    entries, flips = [], []
    for t, p in zip(targets, pythia):
        e = _entry(own, list(METHODS), t, 0, "halos")
        order = ranking(e)
        entries.append({"loss": t, "time_to_loss_s": e["time_to_loss_s"],
                        "ratio_vs_halos": e["time_vs_base"], "ranking": order,
                        "ranking_pythia_70m": ranking(p)})
        if order != ranking(p):
            flips.append(t)
    tm = measured.own_setups["halos"].time_model
    return {
        "time_model": {"num_params": tm.num_params, "bytes_per_param": tm.bytes_per_param,
                       "local_step_time_s": measured.step_s,
                       "measured": "CPU seconds of one local step of the trained model at the "
                                   "local batch, one thread, median of 3 timings"},
        "pythia_70m": {"num_params": setup.time_model.num_params,
                       "local_step_time_s": setup.time_model.local_step_time_s},
        "rerun": [m for m in METHODS if m not in SYNCHRONOUS],
        "retimed": {m: "losses independent of the time model; every round "
                       f"{_round_s(measured.own_setups[m], m):.4g} s instead of "
                       f"{_round_s(_pythia_setup(setup, measured, m), m):.4g} s"
                    for m in SYNCHRONOUS},
        "targets": entries,
        "ranking_flips_at": flips,
    }


def _pythia_setup(setup: PaperSetup, measured: Measured, method: str) -> PaperSetup:
    return replace(measured.own_setups[method], time_model=setup.time_model)


def _ratio_curve(curves: dict, targets: list[float], tps: int) -> dict:
    """Time ratios to HALoS (and under the own time model) over a fine grid of losses."""
    hardest = min(targets)
    losses = [round(hardest + i * TARGET_STEP, 4)
              for i in range(round(PLOT_LOSS_SPAN / TARGET_STEP) + 1)]
    own = {m: curves[m + OWN] for m in METHODS}
    return {"losses": losses,
            "time_vs_halos": {m: [_at(curves, list(METHODS), x, tps, "halos")[
                "time_vs_halos"][m] for x in losses] for m in METHODS},
            "time_vs_halos_own": {m: [_at(own, list(METHODS), x, tps, "halos")[
                "time_vs_halos"][m] for x in losses] for m in METHODS}}


# ---- tables and plot -----------------------------------------------------------------------


def table_rows(out: dict) -> list[list]:
    paper = out["paper"]["time_to_loss_vs_halos"]
    rows = []
    for t, r, k in zip(out["targets"], out["ratios_vs_halos"], out["tokens_vs_sync"]):
        for m in METHODS:
            rows.append([m, f"{t['loss']:.2f}", experiment.fmt(t["time_to_loss_s"][m], 3600, 3),
                         experiment.fmt(r["time"][m]),
                         "1" if m == "halos" else f"{paper[m]:g}" if m in paper else "-",
                         experiment.fmt(t["tokens_to_loss"][m], 1e6), experiment.fmt(k[m])])
    return rows


TABLE_COLUMNS = ["method", "target", "h to loss [min, max]", "x HALoS", "paper x HALoS",
                 "M tokens", "x sync tokens"]


def tuning_rows(out: dict) -> list[list]:
    rows = []
    for m, t in out["methods"].items():
        for s in t["sweep"]:
            mark = "*" if s["hyperparameters"] == t["hyperparameters"] else ""
            rows.append([m, " ".join(f"{k}={v:g}" for k, v in s["hyperparameters"].items()),
                         f"{s['final_loss']:.4f}{mark}", f"{s['min_loss']:.4f}"])
    return rows


TUNING_COLUMNS = ["method", "point", "final val loss (* chosen)", "lowest val loss"]


def ablation_rows(out: dict) -> list[list]:
    paper = out["ablation"]["paper_tokens_to_loss_B"]
    rows = []
    for t in out["ablation"]["targets"]:
        for v, stats in t["tokens_to_loss"].items():
            key = v.replace("+", "plus_")
            rows.append([v, f"{t['loss']:.2f}", experiment.fmt(stats, 1e6),
                         experiment.fmt(t["tokens_vs_base"][v]),
                         f"{paper[key]:g}" if key in paper else "-",
                         out["ablation"]["paper_tokens_vs_halos"].get(v, "-")])
    return rows


ABLATION_COLUMNS = ["step", "target", "M tokens [min, max]", "x HALoS tokens",
                    "paper B tokens", "paper x HALoS"]


def k_rows(out: dict) -> list[list]:
    rows = []
    for t in out["k_sweep"]["targets"]:
        for k, stats in t["tokens_to_loss"].items():
            rows.append([k, f"{t['loss']:.2f}", experiment.fmt(stats, 1e6),
                         experiment.fmt(t["time_to_loss_s"][k], 3600, 3),
                         experiment.fmt(t["time_vs_base"][k])])
    return rows


K_COLUMNS = ["K", "target", "M tokens", "h to loss", "x HALoS time"]


def time_check_rows(out: dict) -> list[list]:
    check = out["time_model_check"]
    rows = []
    for t, p in zip(check["targets"], out["ratios_vs_halos"]):
        for m in METHODS:
            rows.append([m, f"{t['loss']:.2f}", experiment.fmt(t["time_to_loss_s"][m], 1, 2),
                         experiment.fmt(t["ratio_vs_halos"][m]), experiment.fmt(p["time"][m])])
    return rows


TIME_CHECK_COLUMNS = ["method", "target", "s to loss (own model)", "x HALoS (own)",
                      "x HALoS (Pythia-70M)"]


def plot(out: dict, path: str | Path, title: str) -> None:
    """The time ratio to HALoS against the target loss under Pythia-70M's time model and
    under the trained model's own (median line, min-max band over seeds; dashed: the fixed
    targets), and every measured run's loss curve in virtual time."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(17, 4.8), layout="constrained")
    axes = fig.subplots(1, 3)
    curve, colors = out["ratio_curve"], {}
    for ax, key, label in [(axes[0], "time_vs_halos", "Pythia-70M's time model"),
                           (axes[1], "time_vs_halos_own", "the trained model's own")]:
        for m, stats in curve[key].items():
            med, low, high = experiment.band(stats)
            line, = ax.plot(curve["losses"], med, marker=".", color=colors.get(m), label=m)
            colors[m] = line.get_color()
            ax.fill_between(curve["losses"], low, high, color=colors[m], alpha=0.15)
        for t in out["targets"]:
            ax.axvline(t["loss"], color="gray", linestyle="--", linewidth=1)
        ax.invert_xaxis()
        ax.set_yscale("log")
        ax.set_xlabel("target held-out loss (nats/char; dashed: the fixed targets)")
        ax.set_ylabel("time to target / HALoS's, per seed: median, min-max", fontsize=8)
        ax.set_title(label, fontsize=9)
    for name, runs in out["curves"].items():
        if name in colors:
            for i, run in enumerate(runs):
                axes[2].plot([t / 3600 for t in run["time_s"]], run["loss"], color=colors[name],
                             linewidth=1, alpha=0.8, label=name if i == 0 else None)
    for t in out["targets"]:
        axes[2].axhline(t["loss"], color="gray", linestyle="--", linewidth=1)
    axes[2].set_xscale("symlog", linthresh=0.01)
    axes[2].set_xlim(left=0)
    axes[2].set_xlabel("virtual time (h, Pythia-70M's time model; log)")
    axes[2].set_ylabel("held-out (test) loss, every seed")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
