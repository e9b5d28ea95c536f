"""The paper's further experiments on HALoS, at targets fixed from sync before the runs.

- ``grouping``: heterogeneous regions (by default 2, 4, 4, 6 workers, ``HETEROGENEOUS``), with
  one LPS per region (groups of unequal size), with LPSs of workers of similar speed
  (consistent grouping) and with LPSs of the same sizes filled in worker order (naive).
- ``sweep``: K, alpha, beta_l and beta_g, one at a time, around the paper's values (``SWEEP``).
- ``non-iid``: each region trains on its own quarter of the text, with global momentum
  (beta_g 0.5) and without (0); the same two on i.i.d. data for reference.
- ``link-sharing``: HALoS and Async-Local-SGD with the transfers in flight on a link sharing
  its bandwidth, against the same without.

Every variant runs for every seed; its figures are the median and min/max over the seeds of
its final held-out loss, next-character accuracy and time to each target. The targets are
``experiment``'s: sync's held-out loss at 50% and 90% of its budget on the paper's setup
(i.i.d. data, no link sharing), the median over the seeds. Variants shared by several studies
(HALoS itself, beta_g 0) run once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ftsystem.halos import experiment
from ftsystem.halos.config import (
    HalosConfig,
    Network,
    PaperSetup,
    heterogeneous_network,
)
from ftsystem.halos.experiment import Variant, spread
from ftsystem.halos.simulator import Curve, SimConfig

STUDIES = ("grouping", "sweep", "non-iid", "link-sharing")
BASE = "halos"
HETEROGENEOUS = (2, 4, 4, 6)
"""Workers per region of the paper's heterogeneous experiment."""
GROUP_SIZE = 2
"""Workers per LPS in the consistent and naive groupings (fewer where a region has fewer)."""
SWEEP: dict[str, tuple[float, ...]] = {
    "K": (8, 16, 32, 64),
    "alpha": (0.1, 0.25, 0.5),
    "beta_l": (0.8, 0.9, 0.95),
    "beta_g": (0.0, 0.5, 0.9),
}
"""Values swept, one parameter at a time; the paper's (K 32, alpha 0.25, beta_l 0.9, beta_g
0.5) is HALoS itself."""
PAPER = {
    "grouping": "naive grouping of heterogeneous workers per LPS diverged; consistent grouping "
                "1.7x faster",
    "non-iid": "global momentum lowered next-character accuracy 50.0% -> 46.9%",
    "source": "HALoS (Kim et al., ICML 2025) as quoted in reported_results of the shipped "
              "setup (ftsystem/halos/data/halos_paper_setup.yaml); the paper's model and data "
              "for these two are not in the YAML",
}


def with_param(halos: HalosConfig, param: str, value: float) -> HalosConfig:
    """``halos`` with one of ``SWEEP``'s parameters set to ``value``."""
    if param == "K":
        return replace(halos, accumulation_k=int(value))
    if param == "alpha":
        return replace(halos, merge_alpha=float(value))
    if param == "beta_l":
        return replace(halos, lps=replace(halos.lps, beta=float(value)))
    if param == "beta_g":
        return replace(halos, gps=replace(halos.gps, beta=float(value)))
    raise ValueError(f"unknown parameter {param!r}; choose from {', '.join(SWEEP)}")


def param_value(halos: HalosConfig, param: str) -> float:
    """The value of one of ``SWEEP``'s parameters in ``halos``."""
    return {"K": halos.accumulation_k, "alpha": halos.merge_alpha, "beta_l": halos.lps.beta,
            "beta_g": halos.gps.beta}[param]


def sweep_name(halos: HalosConfig, param: str, value: float) -> str:
    """``halos`` for the paper's value, else e.g. ``K=8``."""
    return BASE if value == param_value(halos, param) else f"{param}={value:g}"


def speed_groups(network: Network, size: int) -> list[list[int]]:
    """Consistent grouping: per region its workers by speed, cut into LPSs of ``size``."""
    return _cut(network, size, key=lambda w: (network.speeds[w], w))


def index_groups(network: Network, size: int) -> list[list[int]]:
    """Naive grouping: per region its workers in index order, cut into LPSs of ``size``."""
    return _cut(network, size, key=lambda w: w)


def region_groups(network: Network) -> list[list[int]]:
    """One LPS per region: groups as large as the regions."""
    return _cut(network, len(network.speeds), key=lambda w: w)


def _cut(network: Network, size: int, *, key: Callable[[int], object]) -> list[list[int]]:
    regions = network.worker_regions
    groups = []
    for r in range(network.num_regions):
        workers = sorted((w for w, wr in enumerate(regions) if wr == r), key=key)
        groups += [sorted(workers[i:i + size]) for i in range(0, len(workers), size)]
    return groups


GROUPINGS = {
    "by region": ("one LPS per region (LPSs of unequal size)", region_groups),
    "consistent": ((f"LPSs of up to {GROUP_SIZE} workers of similar speed: per region the "
                    "workers sorted by speed, cut in that order"),
                   lambda net: speed_groups(net, GROUP_SIZE)),
    "naive": ("LPSs of the same sizes, per region the workers in index order (mixed speeds)",
              lambda net: index_groups(net, GROUP_SIZE)),
}


@dataclass(kw_only=True, slots=True)
class StudiesConfig:
    """Which studies, over which seeds, with which per-run simulation."""

    studies: list[str]
    """Names from ``STUDIES``."""
    seeds: list[int]
    """Seeds of data and initial model; every variant runs each."""
    sim: SimConfig = field(default_factory=SimConfig)
    """One run's budget, evaluations and workload (i.i.d.; the non-iid study sets its own)."""
    workers_per_region: list[int] = field(default_factory=lambda: list(HETEROGENEOUS))
    """The grouping study's workers per region."""
    jobs: int = 1
    """Runs at once, in forked processes."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.studies) - set(STUDIES))
        if unknown or not self.studies:
            raise ValueError(f"unknown studies {unknown or '(none)'}; choose from "
                             f"{', '.join(STUDIES)}")


@dataclass(kw_only=True, slots=True)
class Row:
    """One line of a study: a label and the variant it reports."""

    label: str
    variant: Variant
    definition: str


def study_rows(setup: PaperSetup, cfg: StudiesConfig) -> dict[str, list[Row]]:
    """Per chosen study, its rows in order."""
    h = setup.halos
    base = Row(label="HALoS (paper's values)", variant=Variant(name=BASE, method="halos"),
               definition="the setup's workers and HALoS values (the paper's: 4 regions x "
                          "4 workers, K 32, alpha 0.25, beta_l 0.9, beta_g 0.5)")
    rows: dict[str, list[Row]] = {}
    if "grouping" in cfg.studies:
        net = heterogeneous_network(setup.network, cfg.workers_per_region)
        counts = "-".join(map(str, cfg.workers_per_region))
        rows["grouping"] = [base] + [
            Row(label=f"{counts}, {name}", definition=f"{counts} workers per region; {text}",
                variant=Variant(name=f"{counts} {name}", method="halos", setup=replace(
                    setup, network=net, halos=replace(h, lps_groups=groups(net)))))
            for name, (text, groups) in GROUPINGS.items()]
    if "sweep" in cfg.studies:
        rows["sweep"] = [base] + [
            Row(label=sweep_name(h, p, v), definition=f"HALoS with {p} = {v:g}",
                variant=Variant(name=sweep_name(h, p, v), method="halos",
                                setup=replace(setup, halos=with_param(h, p, v))))
            for p, values in SWEEP.items() for v in values if v != param_value(h, p)]
    if "non-iid" in cfg.studies:
        no_momentum = replace(setup, halos=with_param(h, "beta_g", 0.0))
        rows["non-iid"] = [
            base,
            Row(label="i.i.d., beta_g 0", definition="HALoS without global momentum",
                variant=Variant(name="beta_g=0", method="halos", setup=no_momentum)),
            Row(label="non-i.i.d., beta_g 0.5", definition="each region its quarter of the text",
                variant=Variant(name="non-iid", method="halos", non_iid=True)),
            Row(label="non-i.i.d., beta_g 0", definition="each region its quarter of the "
                "text, no global momentum",
                variant=Variant(name="non-iid beta_g=0", method="halos", setup=no_momentum,
                                non_iid=True))]
    if "link-sharing" in cfg.studies:
        shared = replace(setup, time_model=replace(setup.time_model, link_sharing=True))
        rows["link-sharing"] = [
            base,
            Row(label="HALoS, shared links", definition="HALoS, transfers share each link",
                variant=Variant(name="halos shared", method="halos", setup=shared)),
            Row(label="Async-Local-SGD", definition="Async-Local-SGD, the paper's settings",
                variant=Variant(name="async_local_sgd", method="async_local_sgd")),
            Row(label="Async-Local-SGD, shared links", definition="Async-Local-SGD, transfers "
                "share each link",
                variant=Variant(name="async_local_sgd shared", method="async_local_sgd",
                                setup=shared))]
    return rows


def run_studies(setup: PaperSetup, cfg: StudiesConfig,
                progress: Callable[[Curve, int], None] = lambda c, s: None,
                on_targets: Callable[[list[dict]], None] = lambda t: None
                ) -> tuple[dict[str, list[Curve]], list[dict]]:
    """Sync for every seed, the targets, then every variant of the studies (each once)."""
    sync = experiment.run_all([(setup, cfg.sim, Variant(name="sync", method="sync"), s)
                               for s in cfg.seeds], cfg.jobs, progress)
    budget = cfg.sim.total_iters * len(setup.network.speeds)
    targets = experiment.reference_targets(sync, budget, experiment.TARGET_FRACTIONS)
    for t in targets:
        t["name"] = f"sync_{round(100 * t['fraction'])}pct"
    on_targets(targets)
    variants = {r.variant.name: r.variant for rows in study_rows(setup, cfg).values()
                for r in rows}
    tasks = [(setup, cfg.sim, v, s) for v in variants.values() for s in cfg.seeds]
    curves = experiment.run_all(tasks, cfg.jobs, progress)
    n = len(cfg.seeds)
    out = {name: curves[i * n:(i + 1) * n] for i, name in enumerate(variants)}
    return {"sync": sync, **out}, targets


def _per_seed(curves: Sequence[Curve], targets: Sequence[dict]) -> dict:
    return {t["name"]: [experiment.time_to_loss(c, t["loss"]) for c in curves] for t in targets}


def figures(curves: Sequence[Curve], targets: Sequence[dict], tokens_per_step: int) -> dict:
    """A variant's final loss, accuracy, virtual time and time/tokens to each target."""
    return {
        "final_loss": spread([c.final_loss for c in curves]),
        "final_accuracy": spread([c.final_accuracy for c in curves]),
        "virtual_time_s": spread([c.time_s[-1] for c in curves]),
        "time_to_loss_s": {k: spread(v) for k, v in _per_seed(curves, targets).items()},
        "tokens_to_loss": {t["name"]: spread([
            None if s is None else s * tokens_per_step
            for s in (experiment.steps_to_loss(c, t["loss"]) for c in curves)])
            for t in targets},
    }


def time_ratio(a: Sequence[Curve], b: Sequence[Curve], targets: Sequence[dict]) -> dict:
    """Per target, a's time over b's, per seed, then median [min, max]."""
    ta, tb = _per_seed(a, targets), _per_seed(b, targets)
    return {k: spread([experiment.ratio(x, y) for x, y in zip(ta[k], tb[k])]) for k in ta}


def difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """a - b per seed, then median [min, max]."""
    return spread([x - y for x, y in zip(a, b)])


def summary(curves: dict[str, list[Curve]], targets: list[dict], setup: PaperSetup,
            cfg: StudiesConfig, *, corpus: dict, num_params: int, model: str) -> dict:
    """The JSON figures of the studies (without the machine, which the caller adds)."""
    tps = cfg.sim.workload.local_batch * cfg.sim.workload.model.seq_len
    rows = study_rows(setup, cfg)
    out = {"corpus": corpus, "model": model, "model_params": num_params, "seeds": cfg.seeds,
           "total_iters": cfg.sim.total_iters, "target_rule": experiment.TARGET_RULE,
           "targets": targets, "studies": {}, "paper": PAPER}
    for study, study_rows_ in rows.items():
        out["studies"][study] = entry = {"rows": [
            {"label": r.label, "variant": r.variant.name, "definition": r.definition,
             **figures(curves[r.variant.name], targets, tps)} for r in study_rows_]}
        entry.update(_comparison(study, curves, targets, study_rows_, cfg, setup))
    out["config"] = {"total_iters": cfg.sim.total_iters, "eval_points": cfg.sim.eval_points,
                     "eval_sequences": cfg.sim.workload.eval_sequences,
                     "local_batch": cfg.sim.workload.local_batch,
                     "tokens_per_local_step": tps, "studies": cfg.studies}
    out["wall_s"] = {n: round(sum(c.wall_s for c in cs), 1) for n, cs in curves.items()}
    out["cpu_s"] = {n: round(sum(c.cpu_s for c in cs), 1) for n, cs in curves.items()}
    out["curves"] = {n: [{"seed": s, "time_s": c.time_s, "local_steps": c.local_steps,
                          "loss": c.loss, "final_accuracy": c.final_accuracy}
                         for s, c in zip(cfg.seeds, cs)] for n, cs in curves.items()}
    return out


def _comparison(study: str, curves: dict[str, list[Curve]], targets: list[dict],
                rows: list[Row], cfg: StudiesConfig, setup: PaperSetup) -> dict:
    """What each study compares, per seed: the ratios and differences it is about."""
    by_label = {r.label.split(", ")[-1] if study == "grouping" else r.label:
                curves[r.variant.name] for r in rows}
    if study == "grouping":
        first = rows[1].variant.setup
        return {"workers_per_region": cfg.workers_per_region,
                "speeds": first.network.worker_speeds,
                "speeds_rule": "worker j of region r: the (j mod 4)-th of region r's published "
                               "speeds (fewer workers keep the first, more repeat them)",
                "groups": {r.label: r.variant.setup.halos.lps_groups for r in rows[1:]},
                "naive_vs_consistent_time": time_ratio(by_label["naive"],
                                                       by_label["consistent"], targets),
                "naive_minus_consistent_loss": difference(
                    [c.final_loss for c in by_label["naive"]],
                    [c.final_loss for c in by_label["consistent"]]),
                "paper": PAPER["grouping"]}
    if study == "non-iid":
        acc = {k: [100 * c.final_accuracy for c in v] for k, v in by_label.items()}
        return {"momentum_accuracy_points": {
                    "non_iid": difference(acc["non-i.i.d., beta_g 0.5"],
                                          acc["non-i.i.d., beta_g 0"]),
                    "iid": difference(acc["HALoS (paper's values)"], acc["i.i.d., beta_g 0"])},
                "momentum_loss": {
                    "non_iid": difference([c.final_loss for c in by_label[
                        "non-i.i.d., beta_g 0.5"]], [c.final_loss for c in by_label[
                            "non-i.i.d., beta_g 0"]]),
                    "iid": difference([c.final_loss for c in by_label["HALoS (paper's values)"]],
                                      [c.final_loss for c in by_label["i.i.d., beta_g 0"]])},
                "paper": PAPER["non-iid"]}
    if study == "link-sharing":
        return {"shared_vs_not_time": {
            "halos": time_ratio(by_label["HALoS, shared links"],
                                by_label["HALoS (paper's values)"], targets),
            "async_local_sgd": time_ratio(by_label["Async-Local-SGD, shared links"],
                                          by_label["Async-Local-SGD"], targets)}}
    return {"paper_values": {p: param_value(setup.halos, p) for p in SWEEP},
            "values": {p: list(v) for p, v in SWEEP.items()}}


COLUMNS = ["study", "row", "final loss [min, max]", "accuracy %", "h to {0}", "h to {1}"]


def table_rows(out: dict) -> list[list]:
    """One line per study row: final loss, accuracy, hours to each target."""
    lines = []
    for study, entry in out["studies"].items():
        for r in entry["rows"]:
            acc = r["final_accuracy"]
            lines.append([study, r["label"], experiment.fmt(r["final_loss"], 1, 4),
                          experiment.fmt({k: (v * 100 if isinstance(v, float) else v)
                                          for k, v in acc.items()}, 1, 1),
                          *(experiment.fmt(r["time_to_loss_s"][t["name"]], 3600, 3)
                            for t in out["targets"])])
    return lines

