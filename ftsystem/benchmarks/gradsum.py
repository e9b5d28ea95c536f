"""``ftsystem bench gradsum``: the step time of four ways to average gradients across replicas.

Two data-parallel ranks (one process each, one compute thread each) train one model and time a
training step with each of:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over Gloo (its buckets are all-reduced
  during backward);
- ``flat``: backward, then every gradient in one buffer, one all-reduce on a torchft
  ``ProcessGroupGloo``: what ``FTReplica.commit`` does without overlap;
- ``overlap``: :class:`ftsystem.training.overlap.OverlappedGradSum`, buckets of that buffer all-reduced
  on the same group while backward runs: ``FTReplica.commit`` with overlap;
- ``local``: no communication at all, the compute floor.

Why one pair of processes with the modes interleaved, rather than one job per mode: on a small
shared VM, whole-job step times move by ~10% from one run to the next (other tenants, CPU
frequency, where the allocator's pages landed), more than the differences measured here. Every
few steps the pair moves on to the next mode, so a slow patch of the machine hits every mode
alike, and the median over the cycles leaves the odd disturbed cycle out. A cycle is this
bench's round (``--rounds``, also ``--cycles``): the JSON gives each mode's median and min/max
over them.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import typer

from ftsystem.measure import report
from ftsystem.benchmarks import overhead
from ftsystem.cli import bench_app

MODES = ("ddp", "flat", "overlap", "local")
WORLD_SIZE = 2
DEFAULT_SIZES = "10M,100M"
QUICK_SIZES = "100K"
QUICK_CYCLES = 3
DEFAULT_STEPS_PER_CYCLE = 2
PAIR_TIMEOUT_S = 3600.0


# --- pure logic -------------------------------------------------------------------------------

def default_cycles(params: int) -> int:
    """How many times each mode is measured: a few minutes in all on one core per rank."""
    return 12 if params <= 30_000_000 else 4


def summarize(samples: Mapping[str, Sequence[float]]) -> dict[str, dict]:
    """Per mode, from its step times (s, one per cycle): median, min, max, mean and
    ``speed_vs_ddp`` (with its min and max over the cycles).

    ``speed_vs_ddp`` is the median over the cycles of DDP's time over the mode's in the same
    cycle (>1: faster than DDP; None without a DDP figure). Pairing within a cycle cancels the
    machine's drift, which a ratio of the two medians would keep.
    """
    ddp = samples.get("ddp") or []
    out = {}
    for mode, times in samples.items():
        if not times:
            continue
        speed = report.spread([base / own for base, own in zip(ddp, times)])
        out[mode] = {"median_s": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "mean_s": statistics.mean(times),
                     "speed_vs_ddp": speed["median"],
                     "speed_vs_ddp_min": speed["min"], "speed_vs_ddp_max": speed["max"]}
    return out


# --- one rank ---------------------------------------------------------------------------------

def rank_main(*, rank: int, world_size: int, params: int, cycles: int, steps_per_cycle: int,
              bucket_bytes: int, out: Path) -> None:
    """One rank: time every mode in turn, ``cycles`` times; rank 0 writes ``out/result.json``."""
    import torch
    import torch.distributed as dist

    from ftsystem.example.workload import num_params

    torch.set_num_threads(1)  # as ftsystem.example.train and the overhead bench: one core per rank
    dist.init_process_group("gloo", init_method=overhead.rendezvous_file(out).as_uri(), rank=rank,
                            world_size=world_size)
    store, pg = _torchft_group(rank, world_size)
    model, steps, buckets = _step_functions(rank, world_size, params, bucket_bytes, pg)
    # Batches built once: making one is a Python loop over the sequence, the same for every
    # mode, which would only dilute the differences in the gradient sum.
    batches = [model.batch(i) for i in range(steps_per_cycle + 1)]
    for step in steps.values():  # first allocations, DDP's bucket rebuild, Gloo's connections
        step(batches[0])
    samples: dict[str, list[float]] = {mode: [] for mode in steps}
    for cycle in range(cycles):
        # Reversed every other cycle (A B C D, D C B A): a mode's place in the cycle, like the
        # drift of the machine's load, then favours none.
        for mode, step in list(steps.items())[::1 if cycle % 2 == 0 else -1]:
            dist.barrier()  # both ranks start the mode together: no wait for the peer is timed
            step(batches[0])  # untimed: the first step after a switch pays for the switch
            started = time.perf_counter()
            for batch in batches[1:]:
                step(batch)
            samples[mode].append((time.perf_counter() - started) / steps_per_cycle)
    if rank == 0:
        (out / "result.json").write_text(json.dumps({
            "num_params": num_params(model.inner), "buckets": buckets,
            "modes": summarize(samples), "samples": samples}))
    dist.barrier()  # no rank leaves while its peer may still use rank 0's store
    pg.shutdown()
    dist.destroy_process_group()
    del store  # closed only now (rank 0's; None elsewhere)


def _torchft_group(rank: int, world_size: int):
    """A torchft ``ProcessGroupGloo`` over every rank. Its store is hosted by rank 0 on a port
    the kernel picks and kept bound, published through the default group: picking a free port,
    closing it and binding it later races with every other process on the machine."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) \
        if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    pg = ProcessGroupGloo(timedelta(seconds=PAIR_TIMEOUT_S))
    pg.configure(f"127.0.0.1:{port[0]}/gradsum", f"replica{rank}", rank, world_size)
    return store, pg


class _Model:
    """The workload of the torchft baseline (batch, learning rate, seed), on one rank."""

    def __init__(self, rank: int, params: int) -> None:
        import torch

        from ftsystem.baselines.torchft_replica import BATCH_SIZE, LEARNING_RATE, SEED
        from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT

        torch.manual_seed(SEED)
        self.rank = rank
        self.inner = TinyGPT(ModelConfig.for_params(params))
        self.params = list(self.inner.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=LEARNING_RATE)
        self.language = MarkovLanguage(vocab_size=self.inner.cfg.vocab_size, seed=SEED)
        self.batch_size = BATCH_SIZE

    def batch(self, step: int):
        return self.language.batch(shard=self.rank, step=step, batch_size=self.batch_size,
                                   seq_len=self.inner.cfg.seq_len)


def _step_functions(rank: int, world_size: int, params: int, bucket_bytes: int, pg
                    ) -> tuple[_Model, dict[str, Callable], int]:
    """The model, one training step per mode (all on the same model and optimizer: its state
    does not change a step's cost), and the overlap's number of buckets."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ftsystem.training.overlap import DEFAULT_BUCKET_CAP_BYTES, OverlappedGradSum
    from ftsystem.training.flat import FlatLayout, release_grads

    class Loss(torch.nn.Module):
        """DDP reduces the gradients of what runs through its forward: make that the loss."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return self.inner.loss(batch)

    model = _Model(rank, params)
    ps, opt = model.params, model.optimizer
    layout = FlatLayout(ps)
    # DDP's hooks stay on the parameters but do nothing in a backward its forward did not
    # prepare; the overlap's do nothing unless armed. So the modes do not disturb each other.
    ddp = DistributedDataParallel(Loss(model.inner))
    overlap = OverlappedGradSum(layout, bucket_bytes or DEFAULT_BUCKET_CAP_BYTES)

    def allreduce(tensor: torch.Tensor) -> torch.futures.Future:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return pg.allreduce([tensor], opts).get_future()

    def apply_mean(buf: torch.Tensor) -> None:  # as FTReplica.commit after the sum
        buf /= world_size
        layout.unpack(buf)
        opt.step()
        release_grads(ps)

    def ddp_step(batch) -> None:
        opt.zero_grad()
        ddp(batch).backward()
        opt.step()

    def flat_step(batch) -> None:
        opt.zero_grad()
        model.inner.loss(batch).backward()
        buf = layout.pack()
        allreduce(buf).wait()
        apply_mean(buf)

    def overlap_step(batch) -> None:
        opt.zero_grad()
        overlap.arm(layout.empty(), allreduce)
        model.inner.loss(batch).backward()
        apply_mean(overlap.finish(lambda future: future.wait()))

    def local_step(batch) -> None:  # the replicas drift apart here; no matter for timing
        opt.zero_grad()
        model.inner.loss(batch).backward()
        opt.step()

    steps = {"ddp": ddp_step, "flat": flat_step, "overlap": overlap_step, "local": local_step}
    return model, steps, overlap.num_buckets


# --- the pair of ranks ------------------------------------------------------------------------

def run_pair(*, params: int, cycles: int, steps_per_cycle: int, bucket_bytes: int,
             workdir: Path) -> dict:
    """Both ranks, one process each; returns rank 0's result."""
    overhead.run_ranks("gradsum", lambda rank: [
        "-m", "ftsystem.benchmarks.gradsum", "--rank", str(rank), "--world-size", str(WORLD_SIZE),
        "--params", str(params), "--cycles", str(cycles), "--steps-per-cycle",
        str(steps_per_cycle), "--bucket-bytes", str(bucket_bytes), "--out", str(workdir)],
        world_size=WORLD_SIZE, workdir=workdir, timeout_s=PAIR_TIMEOUT_S)
    return json.loads((workdir / "result.json").read_text())


@bench_app.command("gradsum")
def gradsum(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    sizes: Annotated[str, typer.Option(help="approximate model sizes")] = DEFAULT_SIZES,
    cycles: Annotated[int, typer.Option(
        "--rounds", "--cycles", min=0,
        help="rounds: times each mode is measured, the order alternated (0: by size, 12 up "
             "to 30M, else 4)")] = 0,
    steps_per_cycle: Annotated[int, typer.Option(
        min=1, help="timed steps of a mode in a row")] = DEFAULT_STEPS_PER_CYCLE,
    bucket_bytes: Annotated[int, typer.Option(
        min=0, help="largest bucket of the overlap (0: FTReplica's default, 25 MiB)")] = 0,
    quick: Annotated[bool, typer.Option(help=f"{QUICK_SIZES} parameters, {QUICK_CYCLES} "
                                             "cycles (well under a minute)")] = False,
) -> None:
    """Step time of DDP vs ftsystem's flat and overlapped gradient sums vs no communication,
    2 ranks, modes interleaved in the same processes."""
    if quick and sizes != DEFAULT_SIZES:
        typer.secho(f"warning: --sizes has no effect with --quick ({QUICK_SIZES})", err=True)
    try:
        params_list = overhead.parse_sizes(QUICK_SIZES if quick else sizes)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sizes") from e
    load_before = os.getloadavg()
    models = []
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-gradsum-") as tmp:
        for params in params_list:
            n = cycles or (QUICK_CYCLES if quick else default_cycles(params))
            result = run_pair(params=params, cycles=n, steps_per_cycle=steps_per_cycle,
                              bucket_bytes=bucket_bytes, workdir=Path(tmp) / str(params))
            models.append({"params": params, "cycles": n, **result})
    rows = [(m["num_params"], mode, f["median_s"], f"[{f['min_s']:.3g}, {f['max_s']:.3g}]",
             f["speed_vs_ddp"], m["buckets"] if mode == "overlap" else "")
            for m in models for mode in MODES if (f := m["modes"][mode])]
    report.print_table(f"gradsum: step time, {WORLD_SIZE} ranks, modes interleaved",
                       ["params", "mode", "median step (s)", "[min, max] (s)",
                        "speed vs DDP", "buckets"], rows)
    report.write_json(json_path, {
        "models": models, "world_size": WORLD_SIZE,
        "options": {"sizes": QUICK_SIZES if quick else sizes, "cycles": cycles,
                    "steps_per_cycle": steps_per_cycle, "bucket_bytes": bucket_bytes,
                    "quick": quick},
        # Other work on a shared machine moves every figure; interleaving moves them alike.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "machine": report.machine()})


def _rank_cli(rank: Annotated[int, typer.Option()],
              world_size: Annotated[int, typer.Option()],
              params: Annotated[int, typer.Option()],
              cycles: Annotated[int, typer.Option()],
              steps_per_cycle: Annotated[int, typer.Option()],
              bucket_bytes: Annotated[int, typer.Option()],
              out: Annotated[Path, typer.Option()]) -> None:
    rank_main(rank=rank, world_size=world_size, params=params, cycles=cycles,
              steps_per_cycle=steps_per_cycle, bucket_bytes=bucket_bytes, out=out)


if __name__ == "__main__":  # one rank, started by run_pair
    typer.run(_rank_cli)
