"""``ftsystem bench fingerprint``: what the periodic state digest costs, as a share of step time.

Every ``FTSYSTEM_FINGERPRINT_EVERY`` committed steps (default 100) each replica hashes its whole
state (parameters, AdamW's two slots, hyperparameters) with
:func:`ftsystem.training.fingerprint.state_digest` and all-reduces the 16-byte digest with the other
members. This bench times, for one replica built as ``ftsystem.example.train`` builds it (its defaults:
batch, learning rate, dropout; one compute thread):

- a training step: forward and backward on a ``MarkovLanguage`` batch, then ``optimizer.step()``;
- the digest of ``{**local_state(model, optimizer), "step": 0}`` after the optimizer has stepped.

Both in the same process, in rounds, the order alternating (steps first, then digests first): a
drift of the machine's load then hits both alike. The cost of one comparison per ``every`` steps
is ``digest / (every * step)``, taken per round from that round's medians, so that the load of
the moment cancels out of the ratio. No communication is measured: the all-reduce of 16 bytes
per member is latency only.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import typer

from ftsystem.measure import report
from ftsystem.benchmarks import overhead
from ftsystem.cli import bench_app

DEFAULT_SIZES = "10M,100M"
DEFAULT_ROUNDS = 3
DEFAULT_OUT = Path("bench/results/fingerprint.json")
OTHER_EVERIES = (10, 1000)
"""Comparison intervals reported beside hsdp's default."""
WARMUP_STEPS = 2
STEPS_PER_ROUND = 5
DIGESTS_PER_ROUND = 3
MEASURED = ("one replica, no communication; the digest's all-reduce of 16 bytes per member is "
            "not included. step: forward+backward+optimizer.step() (no clipping, scaler or "
            "scheduler); digest: state_digest alone over the state, whose building (references "
            "to the live tensors) is not timed.")


# --- pure logic -------------------------------------------------------------------------------

def summarize(rounds: Sequence[Mapping[str, Sequence[float]]], everies: Sequence[int]) -> dict:
    """From each round's ``step_s`` and ``digest_s`` samples: the spread of each over every
    sample, and per ``every`` the spread over the rounds of ``digest / (every * step)``, each
    round's ratio from that round's medians (pairing within a round cancels the load's drift)."""
    pairs = [(statistics.median(r["step_s"]), statistics.median(r["digest_s"])) for r in rounds]
    return {
        "step_s": report.spread([t for r in rounds for t in r["step_s"]]),
        "digest_s": report.spread([t for r in rounds for t in r["digest_s"]]),
        "cost_fraction": {str(every): report.spread([digest / (every * step)
                                                     for step, digest in pairs])
                          for every in everies}}


# --- one replica ------------------------------------------------------------------------------

class _Replica:
    """A model, its AdamW and a few batches, as ``ftsystem.example.train`` builds them by default."""

    def __init__(self, params: int) -> None:
        import torch

        from ftsystem.example.train import parse_args
        from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT

        args = parse_args(["--model-params", str(params)])
        torch.manual_seed(args.seed)
        cfg = ModelConfig.for_params(params)
        cfg.dropout = args.dropout
        self.model = TinyGPT(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        language = MarkovLanguage(vocab_size=cfg.vocab_size, seed=args.seed)
        # Built once: making a batch is a Python loop, no part of the step being compared.
        self.batches = [language.batch(shard=0, step=i, batch_size=args.batch_size,
                                       seq_len=cfg.seq_len) for i in range(STEPS_PER_ROUND)]

    def step(self, index: int) -> None:
        self.optimizer.zero_grad()
        self.model.loss(self.batches[index % len(self.batches)]).backward()
        self.optimizer.step()

    def state(self) -> dict:
        """What a replica digests (no registered objects here)."""
        from ftsystem.training.shards import local_state

        return {**local_state(self.model, self.optimizer), "step": 0}


def _timed(fn: Callable[[], object], times: int) -> list[float]:
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def measure(params: int, *, rounds: int, everies: Sequence[int]) -> dict:
    """One size: ``rounds`` rounds of step and digest timings, in alternating order."""
    from ftsystem.training.fingerprint import state_digest
    from ftsystem.training.wire import tree_tensors
    from ftsystem.example.workload import num_params

    replica = _Replica(params)
    for i in range(WARMUP_STEPS):  # first allocations; AdamW's slots exist from here on
        replica.step(i)
    state = replica.state()
    steps = itertools.count(WARMUP_STEPS)
    runs = {"step_s": lambda: _timed(lambda: replica.step(next(steps)), STEPS_PER_ROUND),
            "digest_s": lambda: _timed(lambda: state_digest(state), DIGESTS_PER_ROUND)}
    per_round = []
    for round_ in range(rounds):
        order = report.round_order(list(runs), round_)
        per_round.append({"order": order, **{name: runs[name]() for name in order}})
    return {"params": params, "num_params": num_params(replica.model),
            "digest_bytes": sum(t.numel() * t.element_size() for t in tree_tensors(state)),
            **summarize(per_round, everies), "rounds": per_round}


@bench_app.command("fingerprint")
def fingerprint(
    out: Annotated[Path, typer.Option(help="write results here")] = DEFAULT_OUT,
    sizes: Annotated[str, typer.Option(help="approximate model sizes")] = DEFAULT_SIZES,
    rounds: Annotated[int, typer.Option(
        min=1, help=f"rounds of {STEPS_PER_ROUND} steps and {DIGESTS_PER_ROUND} digests, "
                    "in alternating order")] = DEFAULT_ROUNDS,
) -> None:
    """Cost of the periodic state digest as a fraction of step time, one replica, one thread.
    Quick: --sizes 200K --rounds 1."""
    import torch

    from ftsystem.training.settings import DEFAULT_FINGERPRINT_EVERY

    try:
        params_list = overhead.parse_sizes(sizes)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sizes") from e
    everies = sorted({DEFAULT_FINGERPRINT_EVERY, *OTHER_EVERIES})
    load_before, threads = os.getloadavg(), torch.get_num_threads()
    torch.set_num_threads(1)  # as ftsystem.example.train and the other benches: one core per replica
    try:
        models = [measure(p, rounds=rounds, everies=everies) for p in params_list]
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their own setting
    report.print_table(
        f"fingerprint: state digest vs step time, one replica, {rounds} round(s)",
        ["params", "step s", "digest s", "MB", *(f"every {every}" for every in everies)],
        [(m["num_params"], _range(m["step_s"], "{:.2g}".format),
          _range(m["digest_s"], "{:.2g}".format), f"{m['digest_bytes'] / 1e6:.0f}",
          *(_range(m["cost_fraction"][str(every)], _percent) for every in everies))
         for m in models])
    report.write_json(out, {
        "measured": MEASURED, "default_every": DEFAULT_FINGERPRINT_EVERY, "everies": everies,
        "statistics": "step_s and digest_s: median/min/max over every timed sample; "
                      "cost_fraction: digest_s / (every * step_s) per round from that round's "
                      "medians, then median/min/max over the rounds",
        "models": models,
        "options": {"sizes": sizes, "rounds": rounds, "warmup_steps": WARMUP_STEPS,
                    "steps_per_round": STEPS_PER_ROUND, "digests_per_round": DIGESTS_PER_ROUND},
        # Other work on a shared machine moves every figure; interleaving moves them alike.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "machine": report.machine()})
    typer.echo(f"results: {out}")


def _range(figures: Mapping[str, float], fmt: Callable[[float], str]) -> str:
    """``median (min-max)``."""
    return f"{fmt(figures['median'])} ({fmt(figures['min'])}-{fmt(figures['max'])})"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2g}%"
