"""Run methods over several seeds and compare them at target losses fixed before the runs.

Targets come from synchronous data parallel alone, the reference no method is tuned against:
a target is sync's held-out loss at a fraction of its budget (``TARGET_FRACTIONS``: 50% and
90%), the median over the seeds. Sync runs first for every seed, the targets are printed, then
the other methods run. Time-to-loss is the virtual time of a run's first evaluation at or below
the target; per method and target the JSON gives the median over seeds with min and max, and the
same for the ratio to HALoS (computed per seed). A run that never reaches a target counts as
infinitely slow: its time is ``null``, and a median is ``null`` once half the seeds missed.
``ratio_sweep`` repeats the comparison at sync's loss at every 5% of its budget from 10% (the
plot's left panel): figures that hold at one target only show there.

The ablation follows the paper's (FedAH, then local and global momentum, then model merging,
then update accumulation, which is HALoS): ``ablation_steps`` says what each step changes.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ftsystem.halos.config import HalosConfig, PaperSetup
from ftsystem.halos.runcache import RunCache, run_key
from ftsystem.halos.simulator import Curve, SimConfig, simulate

REFERENCE = "sync"
TARGET_FRACTIONS = (0.5, 0.9)
SWEEP_FRACTIONS = tuple(round(0.05 * i, 2) for i in range(2, 21))
TARGET_RULE = ("sync data parallel's held-out loss at its first evaluation at or past the "
               "fraction of its budget, median over the seeds; fixed before the other runs")
ABLATION = ("fedah", "+momentum", "+merging", "+accumulation")
ABLATION_RULE = {
    "fedah": "hierarchical asynchronous FL: LPS and GPS apply updates without momentum "
             "(beta_l = beta_g = 0, same lr), the LPS takes the global model (alpha = 1) and "
             "sends after every worker update (K = 1)",
    "+momentum": "fedah with the paper's local and global momentum (beta_l 0.9, beta_g 0.5)",
    "+merging": "+momentum with model merging (alpha 0.25)",
    "+accumulation": "+merging with update accumulation (K = 32): HALoS itself",
}


@dataclass(kw_only=True, slots=True)
class Variant:
    """One configuration to run: a method, for the ablation with other HALoS settings."""

    name: str
    """Its name in the JSON."""
    method: str
    """The simulator's method."""
    halos: HalosConfig | None = None
    """HALoS settings replacing the setup's (the ablation), or None."""
    setup: PaperSetup | None = None
    """A whole setup replacing the study's (other workers, link sharing; ``studies``), or None."""
    non_iid: bool | None = None
    """Replaces the study's ``non_iid`` of the data, or None."""


def ablation_variants(setup: PaperSetup) -> list[Variant]:
    """FedAH, +momentum, +merging; +accumulation is HALoS itself and is not run again."""
    h = setup.halos
    fedah = replace(h, lps=replace(h.lps, beta=0.0), gps=replace(h.gps, beta=0.0),
                    merge_alpha=1.0, accumulation_k=1)
    momentum = replace(fedah, lps=h.lps, gps=h.gps)
    merging = replace(momentum, merge_alpha=h.merge_alpha)
    return [Variant(name=n, method="halos", halos=c)
            for n, c in zip(ABLATION, (fedah, momentum, merging))]


@dataclass(kw_only=True, slots=True)
class StudyConfig:
    """Which runs: methods, ablation, seeds, and the per-run simulation."""

    methods: list[str]
    """Methods compared and reported (sync runs in any case: it sets the targets; its curves
    are in the JSON's ``curves``)."""
    seeds: list[int]
    """Seeds of data and initial model; every method runs each."""
    ablation: bool = True
    """Also run the ablation variants (needs halos among the methods)."""
    sim: SimConfig = field(default_factory=SimConfig)
    """One run's budget, evaluations and workload (its seed is replaced by each seed)."""
    jobs: int = 1
    """Runs at once, in forked processes."""


@dataclass(kw_only=True, slots=True)
class Study:
    """Every run's curve, and the targets."""

    curves: dict[str, list[Curve]]
    """Per variant (method or ablation step), one curve per seed in seed order."""
    targets: list[dict]
    """``{fraction, loss, sync_losses}`` per target fraction."""
    budget: int
    """Local steps each run's judged model absorbs."""


def resolve(setup: PaperSetup, sim: SimConfig, variant: Variant,
            seed: int) -> tuple[PaperSetup, SimConfig]:
    """The setup and simulation settings ``variant`` runs with for ``seed``."""
    setup = variant.setup or setup
    if variant.halos is not None:
        setup = replace(setup, halos=variant.halos)
    non_iid = sim.workload.non_iid if variant.non_iid is None else variant.non_iid
    return setup, replace(sim, workload=replace(sim.workload, seed=seed, non_iid=non_iid))


def _run(task: tuple[PaperSetup, SimConfig, Variant, int]) -> Curve:
    setup, sim, variant, seed = task
    curve = simulate(*resolve(setup, sim, variant, seed), variant.method)
    curve.method = variant.name
    return curve


def run_all(tasks: list, jobs: int, progress: Callable[[Curve, int], None],
            cache: RunCache | None = None) -> list[Curve]:
    """Run ``(setup, sim, variant, seed)`` tasks, ``jobs`` at once; their curves in order.

    With ``cache``, a task it holds is not run again, and each finished run is stored as soon
    as it ends: a run stopped halfway redoes only the runs it had not finished.
    """
    keys = [_key(t) for t in tasks] if cache is not None else [None] * len(tasks)
    done = {i: c for i, k in enumerate(keys) if k and (c := cache.get(k)) is not None}
    for i, c in done.items():
        c.method = tasks[i][2].name
    todo = [i for i in range(len(tasks)) if i not in done]
    for i, curve in zip(todo, _imap([tasks[i] for i in todo], jobs)):
        if cache is not None:
            cache.put(keys[i], curve)
        done[i] = _keep(progress, curve, tasks[i][3])
    return [done[i] for i in range(len(tasks))]


def _key(task: tuple[PaperSetup, SimConfig, Variant, int]) -> str:
    setup, sim, variant, seed = task
    return run_key(*resolve(setup, sim, variant, seed), variant.method)


def _imap(tasks: list, jobs: int) -> Iterator[Curve]:
    """The tasks' curves in order, as each finishes; ``jobs`` forked processes at once."""
    if jobs <= 1 or len(tasks) <= 1:
        yield from map(_run, tasks)
        return
    with multiprocessing.get_context("fork").Pool(min(jobs, len(tasks))) as pool:
        yield from pool.imap(_run, tasks)


def _keep(progress: Callable[[Curve, int], None], curve: Curve, seed: int) -> Curve:
    progress(curve, seed)
    return curve


def loss_at(curve: Curve, steps: float) -> float:
    """The held-out loss at the curve's first evaluation at or past ``steps`` local steps."""
    return next((l for s, l in zip(curve.local_steps, curve.loss) if s >= steps), curve.loss[-1])


def reference_targets(sync: Sequence[Curve], budget: int,
                      fractions: Sequence[float]) -> list[dict]:
    """Per fraction, sync's loss there in each seed and their median (the target)."""
    out = []
    for f in fractions:
        losses = [loss_at(c, f * budget) for c in sync]
        out.append({"fraction": f, "loss": statistics.median(losses), "sync_losses": losses})
    return out


def run_study(setup: PaperSetup, cfg: StudyConfig,
              progress: Callable[[Curve, int], None] = lambda c, s: None,
              on_targets: Callable[[list[dict]], None] = lambda t: None) -> Study:
    """Sync for every seed, the targets, then every other method and ablation step."""
    variants = [Variant(name=m, method=m) for m in cfg.methods if m != REFERENCE]
    if cfg.ablation and "halos" in cfg.methods:
        variants += ablation_variants(setup)
    sync = run_all([(setup, cfg.sim, Variant(name=REFERENCE, method=REFERENCE), s)
                     for s in cfg.seeds], cfg.jobs, progress)
    budget = cfg.sim.total_iters * len(setup.network.speeds)
    targets = reference_targets(sync, budget, TARGET_FRACTIONS)
    on_targets(targets)
    rest = run_all([(setup, cfg.sim, v, s) for v in variants for s in cfg.seeds], cfg.jobs,
                    progress)
    curves = {REFERENCE: sync}
    for i, v in enumerate(variants):
        curves[v.name] = rest[i * len(cfg.seeds):(i + 1) * len(cfg.seeds)]
    if "+merging" in curves:
        curves["+accumulation"] = curves["halos"]
    return Study(curves=curves, targets=targets, budget=budget)


def time_to_loss(curve: Curve, loss: float) -> float | None:
    i = curve.first_reaching(loss)
    return None if i is None else curve.time_s[i]


def steps_to_loss(curve: Curve, loss: float) -> int | None:
    i = curve.first_reaching(loss)
    return None if i is None else curve.local_steps[i]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing (a miss) or b is 0."""
    return None if a is None or not b else a / b


def spread(values: Sequence[float | None]) -> dict:
    """Median, min and max over seeds; a miss (None) counts as infinite and shows as None."""
    xs = sorted(math.inf if v is None else v for v in values)
    finite = lambda x: None if math.isinf(x) else x  # noqa: E731
    return {"median": finite(statistics.median(xs)), "min": finite(xs[0]),
            "max": finite(xs[-1]), "reached": sum(v is not None for v in values)}


def at_target(study: Study, names: Sequence[str], loss: float, *, tokens_per_step: int,
              base: str = "halos") -> dict:
    """Time, tokens and ratio to ``base`` (per seed) of each of ``names`` at ``loss``."""
    times = {n: [time_to_loss(c, loss) for c in study.curves[n]] for n in names}
    tokens = {n: [None if s is None else s * tokens_per_step
                  for s in (steps_to_loss(c, loss) for c in study.curves[n])] for n in names}
    out = {"time_to_loss_s": {n: spread(times[n]) for n in names},
           "tokens_to_loss": {n: spread(tokens[n]) for n in names}}
    if base in study.curves:
        base_t = [time_to_loss(c, loss) for c in study.curves[base]]
        base_k = [None if s is None else s * tokens_per_step
                  for s in (steps_to_loss(c, loss) for c in study.curves[base])]
        out["time_vs_" + base] = {n: spread([ratio(a, b) for a, b in zip(times[n], base_t)])
                                  for n in names}
        out["tokens_vs_" + base] = {n: spread([ratio(a, b) for a, b in zip(tokens[n], base_k)])
                                    for n in names}
    return out


def closest_paper_model(setup: PaperSetup, trace_params: dict[str, int], num_params: int) -> str:
    """The reported Pythia size nearest ours in log(parameters)."""
    sizes = {k: trace_params[k.replace("_", "-")] for k in setup.paper_ratios
             if k.replace("_", "-") in trace_params}
    return min(sizes, key=lambda k: abs(math.log(sizes[k] / num_params)), default="pythia_70m")


def summary(study: Study, setup: PaperSetup, cfg: StudyConfig, *, corpus: dict, num_params: int,
            model: str, paper_model: str) -> dict:
    """The JSON figures of a study (without the machine, which the caller adds)."""
    tps = cfg.sim.workload.local_batch * cfg.sim.workload.model.seq_len
    methods = [m for m in study.curves if m in cfg.methods]
    ablation = [v for v in ABLATION if v in study.curves]
    targets = []
    for t in study.targets:
        entry = {"name": f"sync_{round(100 * t['fraction'])}pct", **t,
                 **at_target(study, methods, t["loss"], tokens_per_step=tps)}
        entry["ratio_vs_halos"] = entry.pop("time_vs_halos", {})
        entry.pop("tokens_vs_halos", None)
        targets.append(entry)
    sweep = reference_targets(study.curves[REFERENCE], study.budget, SWEEP_FRACTIONS)
    swept = [at_target(study, methods, s["loss"], tokens_per_step=tps) for s in sweep]
    out = {
        "corpus": corpus,
        "model": model,
        "model_params": num_params,
        "seeds": cfg.seeds,
        "target_rule": TARGET_RULE,
        "targets": targets,
        "final_loss": {m: spread([c.final_loss for c in study.curves[m]]) for m in methods},
        "virtual_time_s": {m: spread([c.time_s[-1] for c in study.curves[m]]) for m in methods},
        "ratio_sweep": {"fractions": list(SWEEP_FRACTIONS), "losses": [s["loss"] for s in sweep],
                        "ratio_vs_halos": {m: [w.get("time_vs_halos", {}).get(m) for w in swept]
                                           for m in methods},
                        "time_to_loss_s": {m: [w["time_to_loss_s"][m] for w in swept]
                                           for m in methods}},
        "paper": paper_figures(setup, paper_model),
        "config": _config(setup, cfg, tokens_per_step=tps),
        "wall_s": {n: round(sum(c.wall_s for c in cs), 1) for n, cs in study.curves.items()
                   if n != "+accumulation"},  # the halos runs, not run again
        "cpu_s": {n: round(sum(c.cpu_s for c in cs), 1) for n, cs in study.curves.items()
                  if n != "+accumulation"},
        "curves": {n: [{"seed": s, "time_s": c.time_s, "local_steps": c.local_steps,
                        "loss": c.loss} for s, c in zip(cfg.seeds, cs)]
                   for n, cs in study.curves.items()},
    }
    if ablation:
        swept = [at_target(study, ablation, s["loss"], tokens_per_step=tps, base="+accumulation")
                 for s in sweep]
        out["ablation"] = {
            "steps": {v: ABLATION_RULE[v] for v in ablation},
            "targets": [{"name": t["name"], "loss": t["loss"],
                         **at_target(study, ablation, t["loss"], tokens_per_step=tps,
                                     base="+accumulation")} for t in targets],
            "final_loss": {v: spread([c.final_loss for c in study.curves[v]]) for v in ablation},
            "sweep_tokens_to_loss": {v: [w["tokens_to_loss"][v] for w in swept]
                                     for v in ablation}}
    return out


def paper_figures(setup: PaperSetup, model: str) -> dict:
    """What the paper reports for ``model`` (a ``reported_results`` key), with the source."""
    return {"model": model.replace("_", "-"),
            "source": "HALoS (Kim et al., ICML 2025) as quoted in reported_results of the "
                      "shipped setup (ftsystem/halos/data/halos_paper_setup.yaml)",
            "time_to_loss_vs_halos": setup.paper_ratios.get(model, {}),
            "ablation_tokens_to_loss_B": setup.paper_ablation.get(model, {}),
            "other_sizes": {k.replace("_", "-"): v for k, v in setup.paper_ratios.items()
                            if k != model}}


def _config(setup: PaperSetup, cfg: StudyConfig, *, tokens_per_step: int) -> dict:
    w, m = cfg.sim.workload, cfg.sim.workload.model
    return {"total_iters": cfg.sim.total_iters, "eval_points": cfg.sim.eval_points,
            "workers": len(setup.network.speeds), "regions": setup.network.num_regions,
            "non_iid": w.non_iid, "data": w.data, "local_batch": w.local_batch,
            "seq_len": m.seq_len, "tokens_per_local_step": tokens_per_step,
            "eval_sequences": w.eval_sequences, "methods": cfg.methods,
            "time_model": {"num_params": setup.time_model.num_params,
                           "bytes_per_param": setup.time_model.bytes_per_param,
                           "local_step_time_s": setup.time_model.local_step_time_s}}


def fmt(stats: dict, scale: float = 1.0, digits: int = 2) -> str:
    """``median [min, max]`` of a ``spread``, divided by ``scale``."""
    if stats["median"] is None:
        return f"- ({stats['reached']} reached)"
    low = "-" if stats["min"] is None else f"{stats['min'] / scale:.{digits}f}"
    high = "inf" if stats["max"] is None else f"{stats['max'] / scale:.{digits}f}"
    return f"{stats['median'] / scale:.{digits}f} [{low}, {high}]"


TABLE_COLUMNS = ["method", "target", "h to loss [min, max]", "x HALoS [min, max]", "paper",
                 "M tokens", "final loss"]


def table_rows(out: dict) -> list[list]:
    paper = out["paper"]["time_to_loss_vs_halos"]
    rows = []
    for t in out["targets"]:
        for m, stats in t["time_to_loss_s"].items():
            rows.append([m, f"{t['loss']:.4f}", fmt(stats, 3600, 3),
                         fmt(t["ratio_vs_halos"][m]) if m in t["ratio_vs_halos"] else "-",
                         "1" if m == "halos" else f"{paper[m]:g}" if m in paper else "-",
                         fmt(t["tokens_to_loss"][m], 1e6), fmt(out["final_loss"][m], 1, 4)])
    return rows


ABLATION_COLUMNS = ["step", "target", "M tokens [min, max]", "x HALoS tokens", "paper B tokens",
                    "h to loss"]


def ablation_rows(out: dict) -> list[list]:
    paper = out["paper"]["ablation_tokens_to_loss_B"]
    rows = []
    for t in out.get("ablation", {}).get("targets", []):
        for v, stats in t["tokens_to_loss"].items():
            key = v.replace("+", "plus_")
            rows.append([v, f"{t['loss']:.4f}", fmt(stats, 1e6),
                         fmt(t["tokens_vs_+accumulation"][v]),
                         f"{paper[key]:g}" if key in paper else "-",
                         fmt(t["time_to_loss_s"][v], 3600, 3)])
    return rows


def band(stats: list[dict | None], scale: float = 1.0) -> tuple[list, list, list]:
    """Median, min and max lines of a list of ``spread``s (NaN where missing), over ``scale``."""
    def get(s: dict | None, key: str) -> float:
        return math.nan if s is None or s[key] is None else s[key] / scale
    return ([get(s, "median") for s in stats], [get(s, "min") for s in stats],
            [get(s, "max") for s in stats])


def plot(out: dict, path: str | Path, title: str) -> None:
    """Against the target loss: the ratio to HALoS and the time to reach it (median line,
    min-max band over seeds); and every run's loss curve in virtual time."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(17, 4.8), layout="constrained")
    by_ratio, by_target, by_time = fig.subplots(1, 3)
    sweep, colors, drawn = out["ratio_sweep"], {}, {by_ratio: False, by_target: False}
    for m in sweep["time_to_loss_s"]:
        for ax, key, scale in [(by_target, "time_to_loss_s", 3600),
                               (by_ratio, "ratio_vs_halos", 1)]:
            med, low, high = band(sweep[key].get(m, []), scale)
            line, = ax.plot(sweep["losses"][:len(med)], med, marker=".", color=colors.get(m),
                            label=m)
            colors[m] = line.get_color()
            ax.fill_between(sweep["losses"][:len(med)], low, high, color=colors[m], alpha=0.15)
            drawn[ax] |= any(math.isfinite(y) for y in med + low + high)
    for ax, ylabel in [(by_ratio, "time to target / HALoS's (per seed)"),
                       (by_target, "virtual time to target (h)")]:
        for t in out["targets"]:
            ax.axvline(t["loss"], color="gray", linestyle="--", linewidth=1)
        ax.invert_xaxis()
        if drawn[ax]:
            ax.set_yscale("log")  # not with nothing to draw: matplotlib refuses
        ax.set_xlabel("target held-out loss (sync's at 10%..100% of its budget; dashed: the "
                      "fixed targets)", fontsize=8)
        ax.set_ylabel(ylabel + ", median and min-max over seeds", fontsize=8)
    for name, runs in out["curves"].items():
        if name not in colors:
            continue
        for i, run in enumerate(runs):
            by_time.plot([t / 3600 for t in run["time_s"]], run["loss"], color=colors[name],
                         linewidth=1, alpha=0.8, label=name if i == 0 else None)
    for t in out["targets"]:
        by_time.axhline(t["loss"], color="gray", linestyle="--", linewidth=1)
    by_time.set_xscale("symlog", linthresh=0.01)  # linear near 0, where every curve starts
    by_time.set_xlim(left=0)
    by_time.set_xlabel("virtual time (h, log)")
    by_time.set_ylabel("held-out loss (every seed)")
    for ax in (by_ratio, by_target, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
