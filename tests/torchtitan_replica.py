"""One rank of a replica that trains torchtitan's debug Llama with ``FTSystemTrainer`` on CPU
(``tests/test_torchtitan.py`` runs it under real agents).

torchtitan supports accelerators only: on a machine without one it takes the device to be
"cuda", and its metrics read the accelerator's memory. So this program, and only it, tells
torchtitan that the device is the CPU before torchtitan is imported, and gives its metrics a
memory monitor that reports nothing. The rest is what a user runs: the integration's
``llama3_debugmodel`` config, ``FTSystemTrainer``, ``TokenFileDataLoader``.

It takes the example's arguments (``--steps``, ``--data-shard``, ``--out``, ``--linger``,
``--sleep-per-step``) and writes its result as ``ftsystem.example.train`` does, for
``ftsystem.launch``'s summary.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import time
from pathlib import Path

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan reads it

import torchtitan.components.metrics as titan_metrics  # noqa: E402
from torchtitan.config import TrainingConfig  # noqa: E402

from ftsystem.example.train import write_once  # noqa: E402
from ftsystem.integrations.torchtitan import (FaultTolerance, FTSystemTrainer,  # noqa: E402
                                              TokenFileDataLoader, llama3_debugmodel)


class NoDeviceMemory:
    """What torchtitan's metrics ask of a device's memory, on a CPU: nothing to report."""

    device_name = "cpu"

    def get_peak_stats(self):
        return titan_metrics.DeviceMemStats(*[0] * len(titan_metrics.DeviceMemStats._fields))

    def reset_peak_stats(self) -> None:
        pass


titan_metrics.build_device_memory_monitor = NoDeviceMemory


class PacedTrainer(FTSystemTrainer):
    """``FTSystemTrainer`` with a pause after each step, so that the live replicas train on
    while a killed one restarts (seconds: importing torchtitan and building the trainer)."""

    def __init__(self, config: FTSystemTrainer.Config, sleep_per_step: float) -> None:
        self.sleep_per_step = sleep_per_step
        super().__init__(config)

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        time.sleep(self.sleep_per_step)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--data-shard", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", required=True, help="the token file (uint16 ids)")
    p.add_argument("--num-replicas", type=int, required=True)
    p.add_argument("--linger", type=float, default=60.0)
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    config = llama3_debugmodel()
    config.dump_folder = str(args.out / "torchtitan")
    config.training = TrainingConfig(local_batch_size=2, seq_len=32, steps=args.steps,
                                     disable_cuda_graphs=True)
    config.dataloader = TokenFileDataLoader.Config(path=args.tokens)
    config.fault_tolerance = FaultTolerance(num_replicas=args.num_replicas,
                                            data_shard=args.data_shard, linger_s=args.linger)
    trainer = PacedTrainer(config, args.sleep_per_step)
    try:
        trainer.train()
        write_result(trainer, args.out)
    finally:
        trainer.close()


def write_result(trainer: FTSystemTrainer, out: Path) -> None:
    ft = trainer.ft
    shard_hashes = ft.replica.gather(ft.state_hash())
    if ft.ctx.rank != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    write_once(out / f"{ft.ctx.replica_id}.json", {
        "replica": ft.ctx.replica_id, "generation": ft.ctx.generation, "step": ft.step,
        "started": ft.started, "commits": ft.commits, "epochs": ft.epochs,
        "catchup": ft.catchup_stats, "divergences": ft.divergences, "train_loss": None,
        "eval_loss": None, "shard_hashes": shard_hashes,
        "state_hash": hashlib.sha256("".join(shard_hashes).encode()).hexdigest(),
        "num_params": sum(p.numel() for p in trainer.model_parts[0].parameters())})


if __name__ == "__main__":
    main()
