"""A real-mode run against the simulator on the same configuration.

``simulate`` runs ``simulator``'s HALoS on what the real run ran: the same model, data and seed,
the same H, K, alpha and momenta, the same workers and speeds, the emulated step time as the
speed-1.0 step time, the model's own fp32 bytes as what a transfer carries, and the shaped
(scaled) bandwidths as the network. Its budget is the local steps the real workers had
acknowledged, and the lr schedule has the real run's length. ``compare`` sets the two loss
curves of the GPS model side by side: virtual seconds against wall seconds since the real run's
start (every node up), per global update and to common loss targets.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from ftsystem.halos.config import Network, PaperSetup, TimeModel
from ftsystem.halos.realconfig import RealConfig

TARGET_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Targets: the GPS model's loss after these shares of the global updates both runs made."""


def sim_setup(real: RealConfig, paper: PaperSetup) -> PaperSetup:
    """The paper's setup with what the real run changed: its regions, workers, speeds, scaled
    bandwidths, model size, step time and HALoS hyperparameters."""
    if not real.bandwidth_bps or real.local_step_s <= 0:
        raise ValueError("comparing with the simulator needs a shaped run with an emulated "
                         "step time (--shape --step-time S)")
    per = real.workers_per_region
    speeds = [real.speed_of(i) for i in range(real.num_workers)]
    network = Network(bandwidth_gbps=[[bps / 1e9 for bps in row] for row in real.bandwidth_bps],
                      worker_speeds=[speeds[r * per:(r + 1) * per]
                                     for r in range(real.num_regions)],
                      gps_region=real.gps_region)
    m = real.workload.model
    time_model = TimeModel(num_params=real.model_bytes // 4, local_step_time_s=real.local_step_s,
                           tokens_per_local_step=real.workload.local_batch * m.seq_len)
    halos = dataclasses.replace(paper.halos, local_steps=real.local_steps, workers_per_lps=per,
                                lps=real.lps, gps=real.gps, accumulation_k=real.accumulation_k,
                                merge_alpha=real.merge_alpha)
    return dataclasses.replace(paper, network=network, time_model=time_model,
                               worker=real.worker, halos=halos)


def simulate(real: RealConfig, paper: PaperSetup, budget_steps: int):
    """The simulator's HALoS curve on the real run's configuration (``simulator.Curve``)."""
    from ftsystem.halos import simulator

    total = real.schedule_steps
    # One evaluation per GPS update (every record passes the bar of 1 local step).
    cfg = simulator.SimConfig(total_iters=total, eval_points=total * real.num_workers,
                              workload=real.workload)
    run = simulator.Run(sim_setup(real, paper), cfg, "halos")
    run.budget = budget_steps  # what the real workers did, not the schedule's length
    return run.execute(simulator.PROCESSES["halos"])


def compare(real_curve: list[list[float]], sim_times: list[float], sim_losses: list[float]
            ) -> dict:
    """Pure: the real run's GPS curve (``[update, loss, seconds]``, from update 0) against the
    simulator's (one point per GPS update, from the initial model).

    Per global update, the ratio of wall to virtual time; and to each target (the worse of
    the two runs' losses after ``TARGET_FRACTIONS`` of the updates both made, so both reach
    it), each run's first time at or below it and their ratio.
    """
    common = min(len(real_curve), len(sim_times)) - 1
    if common < 1:
        raise ValueError("no global update to compare: one of the runs made none")
    real_s = [row[2] for row in real_curve[1:common + 1]]
    sim_s = sim_times[1:common + 1]
    per_update = [r / s for r, s in zip(real_s, sim_s) if s > 0]
    targets = []
    for fraction in TARGET_FRACTIONS:
        u = max(1, math.ceil(fraction * common))
        target = max(real_curve[u][1], sim_losses[u])
        real_t = _first_at_or_below(target, [r[1] for r in real_curve], [r[2] for r in real_curve])
        sim_t = _first_at_or_below(target, sim_losses, sim_times)
        targets.append({"fraction": fraction, "update": u, "loss": round(target, 4),
                        "real_s": real_t, "sim_s": round(sim_t, 3),
                        "ratio_real_to_sim": round(real_t / sim_t, 3) if sim_t > 0 else None})
    return {
        "updates_compared": common,
        "per_update": {"real_s": real_s, "sim_s": [round(s, 3) for s in sim_s],
                       "ratio_median": round(statistics.median(per_update), 3),
                       "ratio_min": round(min(per_update), 3),
                       "ratio_max": round(max(per_update), 3)},
        "targets": targets,
        "real_loss": [round(r[1], 4) for r in real_curve[:common + 1]],
        "sim_loss": [round(v, 4) for v in sim_losses[:common + 1]],
    }


def _first_at_or_below(target: float, losses: list[float], times: list[float]) -> float:
    return next(t for v, t in zip(losses, times) if v <= target)
