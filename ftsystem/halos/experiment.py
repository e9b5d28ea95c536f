"""Run several methods on one setup and compare them at one target loss.

The target is the lowest held-out loss that *every* compared method reaches within the common
budget of local steps: ``max over methods of (min of its curve)``. It depends on no method's
tuning, every method reaches it by construction, and it is as low as that allows. Time-to-loss is
the virtual time of a method's first evaluation at or below the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftsystem.halos.config import PaperSetup
from ftsystem.halos.simulator import Curve, SimConfig, simulate

TARGET_RULE = "max over methods of each method's lowest held-out loss within the common budget"


@dataclass(kw_only=True, slots=True)
class Comparison:
    """The methods' curves and the figures derived from them."""

    curves: dict[str, Curve]
    """Loss curve per method, in run order."""
    target_loss: float
    """The loss every method reached (see ``TARGET_RULE``)."""
    tokens_per_local_step: int
    """Tokens of one local step of the simulated model."""

    def time_to_loss_s(self, method: str) -> float | None:
        curve = self.curves[method]
        i = curve.first_reaching(self.target_loss)
        return None if i is None else curve.time_s[i]

    def tokens_to_loss(self, method: str) -> int | None:
        curve = self.curves[method]
        i = curve.first_reaching(self.target_loss)
        return None if i is None else curve.local_steps[i] * self.tokens_per_local_step

    def ratios_vs_halos(self) -> dict[str, float | None]:
        """Time-to-loss of each method over HALoS's (empty when HALoS was not run)."""
        if "halos" not in self.curves:
            return {}
        base = self.time_to_loss_s("halos")
        return {m: _ratio(self.time_to_loss_s(m), base) for m in self.curves}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare(setup: PaperSetup, cfg: SimConfig, methods: Sequence[str],
            progress: Callable[[Curve], None] = lambda _: None) -> Comparison:
    """Simulate each method with the same budget and data; ``progress`` sees each curve."""
    curves = {}
    for method in methods:
        curves[method] = simulate(setup, cfg, method)
        progress(curves[method])
    target = max(min(c.loss) for c in curves.values())
    return Comparison(curves=curves, target_loss=target,
                      tokens_per_local_step=setup.time_model.tokens_per_local_step)


def summary(comp: Comparison, setup: PaperSetup, cfg: SimConfig) -> dict:
    """The JSON figures of a comparison (without the machine, which the caller adds)."""
    curves = comp.curves
    out = {
        "time_to_loss_s": {m: comp.time_to_loss_s(m) for m in curves},
        "tokens_to_loss": {m: comp.tokens_to_loss(m) for m in curves},
        "final_loss": {m: c.final_loss for m, c in curves.items()},
        "target_loss": comp.target_loss,
        "target_rule": TARGET_RULE,
        "ratios_vs_halos": comp.ratios_vs_halos(),
        "paper_ratios": setup.paper_ratios,
        "virtual_time_s": {m: c.time_s[-1] for m, c in curves.items()},
        "wall_s": {m: round(c.wall_s, 2) for m, c in curves.items()},
        "config": _config(setup, cfg),
        "curves": {m: {"time_s": c.time_s, "local_steps": c.local_steps, "loss": c.loss}
                   for m, c in curves.items()},
    }
    if "halos" in curves and "sync" in curves:
        out["halos_vs_sync_final_loss_pct"] = 100 * (curves["halos"].final_loss /
                                                     curves["sync"].final_loss - 1)
    return out


def _config(setup: PaperSetup, cfg: SimConfig) -> dict:
    w, m = cfg.workload, cfg.workload.model
    return {"total_iters": cfg.total_iters, "workers": len(setup.network.speeds),
            "regions": setup.network.num_regions, "non_iid": w.non_iid, "seed": w.seed,
            "local_batch": w.local_batch, "model": f"TinyGPT d{m.d_model} L{m.num_layers} "
            f"vocab{m.vocab_size} seq{m.seq_len}", "markov_branching": w.branching,
            "time_model": {"num_params": setup.time_model.num_params,
                           "bytes_per_param": setup.time_model.bytes_per_param,
                           "local_step_time_s": setup.time_model.local_step_time_s}}


def paper_column(setup: PaperSetup, method: str) -> str:
    """The paper's ratio for ``method`` at the largest Pythia that reports one (YAML order)."""
    found = [r[method] for r in setup.paper_ratios.values() if method in r]
    return f"{found[-1]:g}" if found else ("1" if method == "halos" else "-")


def table_rows(comp: Comparison, setup: PaperSetup) -> list[list]:
    ratios = comp.ratios_vs_halos()
    rows = []
    for m, c in comp.curves.items():
        t, tok = comp.time_to_loss_s(m), comp.tokens_to_loss(m)
        rows.append([m, "-" if t is None else f"{t / 3600:.3f}",
                     "-" if ratios.get(m) is None else f"{ratios[m]:.2f}", paper_column(setup, m),
                     "-" if tok is None else f"{tok / 1e9:.2f}", f"{c.final_loss:.4f}",
                     f"{c.time_s[-1] / 3600:.2f}"])
    return rows


TABLE_COLUMNS = ["method", "h to loss", "x HALoS", "paper", "B tokens", "loss", "end h"]


def plot(comp: Comparison, path: str | Path, title: str) -> None:
    """Loss against virtual time and against tokens, with the target loss, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    by_time, by_tokens = fig.subplots(1, 2)
    for m, c in comp.curves.items():
        by_time.plot([t / 3600 for t in c.time_s], c.loss, label=m)
        by_tokens.plot([s * comp.tokens_per_local_step / 1e9 for s in c.local_steps], c.loss,
                       label=m)
    for ax, xlabel in [(by_time, "virtual time (h, log)"), (by_tokens, "tokens (B)")]:
        ax.axhline(comp.target_loss, color="gray", linestyle="--", linewidth=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
    by_time.set_xscale("symlog", linthresh=0.01)  # linear near 0, where every curve starts
    by_time.set_xlim(left=0)
    by_time.legend()
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
