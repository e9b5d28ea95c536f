"""One torchft 0.2.0 replica group of one rank, training the example workload.

Run as ``python -m ftsystem.baselines.torchft_replica --replica 1 --steps 60 --out r1.json``
with ``TORCHFT_LIGHTHOUSE`` set to the lighthouse's address, as torchft expects.

The loop is torchft's documented one: ``start_quorum()`` per step, gradients averaged with
``Manager.allreduce``, ``should_commit()`` gates ``optimizer.step()``. The gradients go as one
flat buffer in one all-reduce, as ftsystem sends them, and the model, optimizer and data are
those of ftsystem's example program in its plain loop (``ftsystem.example.train --loop plain``),
so that the two differ only in the fault tolerance. ``--model-params``, ``--batch-size``,
``--lr``, ``--seed`` and ``--sleep-per-step`` mean what they mean to that program, with its
defaults; a benchmark passes both the same values (``ftsystem.benchmarks.harness``). A restarted
replica heals from a healthy peer through the Manager's ``state_dict``/``load_state_dict``
callbacks (HTTP checkpoint transport, torchft's default).

torchft's ``DistributedDataParallel`` wrapper is not used: in 0.2.0 its comm hook asserts on
the future of a failed all-reduce (``assert fut._fut`` in ``ddp.py``), so a peer SIGKILLed
mid-all-reduce crashes every survivor with an AssertionError (seen here with 3 replicas).

Every commit is appended to a progress file beside ``--out`` (so a supervisor can watch the
replica), and at exit the JSON result holds the commit timeline of this process's life.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import typer
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

from ftsystem.example import train as ftsystem_train
from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT, num_params

# Manager.allreduce and should_commit give up after this. A SIGKILLed peer is noticed at once
# (its sockets close), so this only bounds a hung peer or an all-reduce stuck behind a survivor
# that already left the collective; 10 s stays clear of step-time jitter on a loaded 2-core box.
# torchft reads whole seconds from TORCHFT_TIMEOUT_SEC, so 1 s is its floor.
MANAGER_TIMEOUT = timedelta(seconds=10)
# Waiting for the lighthouse to issue a quorum. It must outlast the lighthouse's own waits
# (heartbeat expiry, join timeout) with margin, or survivors would give up on a valid quorum.
QUORUM_TIMEOUT = timedelta(seconds=20)
# Connecting to the lighthouse and the managers' RPC servers (loopback here).
CONNECT_TIMEOUT = timedelta(seconds=10)
# How often the manager heartbeats to the lighthouse; torchft's default, which the lighthouse's
# heartbeat timeout is sized against.
HEARTBEAT_INTERVAL = timedelta(milliseconds=100)
# torchft environment overrides that would silently replace the values above.
TORCHFT_TIMEOUT_ENVS = ("TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC",
                        "TORCHFT_CONNECT_TIMEOUT_SEC", "TORCHFT_QUORUM_RETRIES")

# ftsystem's example program's defaults, read from it so that they cannot drift apart: this
# program's own defaults.
_FTSYSTEM_DEFAULTS = ftsystem_train.parse_args([])
BATCH_SIZE = _FTSYSTEM_DEFAULTS.batch_size
LEARNING_RATE = _FTSYSTEM_DEFAULTS.lr
SEED = _FTSYSTEM_DEFAULTS.seed

logger = logging.getLogger(__name__)


def manager_settings(batch_size: int = BATCH_SIZE, lr: float = LEARNING_RATE
                     ) -> dict[str, object]:
    """The Manager settings a replica training at ``batch_size`` and ``lr`` runs with, for
    the benchmark's record."""
    return {
        "timeout_s": MANAGER_TIMEOUT.total_seconds(),
        "quorum_timeout_s": QUORUM_TIMEOUT.total_seconds(),
        "connect_timeout_s": CONNECT_TIMEOUT.total_seconds(),
        "heartbeat_interval_ms": HEARTBEAT_INTERVAL.total_seconds() * 1000,
        "min_replica_size": 1,
        "use_async_quorum": True,
        "process_group": "ProcessGroupGloo",
        "gradient_averaging": "Manager.allreduce of one flat buffer of every gradient",
        "batch_size": batch_size, "learning_rate": lr,
        "checkpoint_transport": "HTTPTransport (default)",
    }


def progress_path(out: Path) -> Path:
    """Where a replica writing its result to ``out`` appends ``step unix_time`` per commit."""
    return out.with_name(out.name + ".progress")


@dataclass(kw_only=True, slots=True)
class Trainer:
    """The model, optimizer and data of one replica, and its commit record."""

    replica: int
    model_params: Optional[int]
    batch_size: int = BATCH_SIZE
    lr: float = LEARNING_RATE
    seed: int = SEED
    """Seeds the model's initial weights and the language (the data)."""
    model: TinyGPT = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    data: MarkovLanguage = field(init=False)
    commits: list[list[float]] = field(default_factory=list)
    last_loss: Optional[float] = None

    def __post_init__(self) -> None:
        cfg = ModelConfig.for_params(self.model_params) if self.model_params else ModelConfig()
        # Same seed everywhere: replicas start identical, as torchft's examples assume.
        torch.manual_seed(self.seed)
        self.model = TinyGPT(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        self.data = MarkovLanguage(vocab_size=cfg.vocab_size, seed=self.seed)

    def state_dict(self) -> dict[str, object]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def backward(self, step: int) -> float:
        """Forward and backward on this replica's batch for ``step``; returns the loss."""
        cfg = self.model.cfg
        batch = self.data.batch(shard=self.replica, step=step, batch_size=self.batch_size,
                                seq_len=cfg.seq_len)
        self.optimizer.zero_grad()
        loss = self.model.loss(batch)
        loss.backward()
        return float(loss)


def state_hash(trainer: Trainer) -> str:
    """sha256 over the bytes of every model and optimizer tensor, in a fixed order."""
    digest = hashlib.sha256()
    for _, tensor in sorted(trainer.model.state_dict().items()):
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    optim_state = trainer.optimizer.state_dict()["state"]
    for index in sorted(optim_state):
        for _, tensor in sorted(optim_state[index].items()):
            digest.update(torch.as_tensor(tensor).contiguous().numpy().tobytes())
    return digest.hexdigest()


ENV_HOST = "FTSYSTEM_TORCHFT_HOST"
"""The address this replica's manager and store are reached at by the others (default
``localhost``: every replica on one host). A replica in an emulated host of its own (a network
namespace) names the host's address."""


def build_manager(trainer: Trainer) -> tuple[Manager, TCPStore]:
    """A torchft Manager for a replica group of one rank, hosting the group's own TCPStore."""
    host = os.environ.get(ENV_HOST, "localhost")
    # torchft expects the replica group's store to exist before the Manager (torchrun's job).
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=MANAGER_TIMEOUT),
        load_state_dict=trainer.load_state_dict,
        state_dict=trainer.state_dict,
        min_replica_size=1,
        timeout=MANAGER_TIMEOUT,
        quorum_timeout=QUORUM_TIMEOUT,
        connect_timeout=CONNECT_TIMEOUT,
        heartbeat_interval=HEARTBEAT_INTERVAL,
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        replica_id=f"torchft_replica_{trainer.replica}",
        hostname=host,
    )
    return manager, store


def train_step(manager: Manager, trainer: Trainer) -> bool:
    """One torchft step; returns whether the replicas committed it."""
    manager.start_quorum()
    loss = trainer.backward(manager.current_step())
    average_gradients(manager, trainer.model)
    if not manager.should_commit():
        return False
    trainer.optimizer.step()
    trainer.last_loss = loss
    return True


def average_gradients(manager: Manager, model: torch.nn.Module) -> None:
    """Every gradient averaged over the quorum in one all-reduce of one flat buffer (as
    ftsystem does), not one call per parameter. A failed all-reduce is recorded by the manager
    (not raised) and turns the commit vote into False."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def last_step(steps: int, last_step_file: Optional[Path]) -> Optional[int]:
    """The step to train to: ``steps``, or the one ``last_step_file`` names (None while it does
    not exist: train on)."""
    if last_step_file is None:
        return steps
    try:
        return int(last_step_file.read_text())
    except FileNotFoundError:
        return None


def train(trainer: Trainer, manager: Manager, *, steps: int, progress: Path,
          sleep_per_step: float, last_step_file: Optional[Path] = None) -> None:
    """Step until ``steps`` steps are committed (or the step ``last_step_file`` names, once it
    exists), recording and appending each commit."""
    with progress.open("a") as log:
        while (last := last_step(steps, last_step_file)) is None or \
                manager.current_step() < last:
            if train_step(manager, trainer):
                entry = [manager.current_step(), time.time()]
                trainer.commits.append(entry)
                log.write(f"{entry[0]} {entry[1]:.6f}\n")
                log.flush()
            time.sleep(sleep_per_step)


def write_result(out: Path, trainer: Trainer, generation: int) -> None:
    """Write the JSON result atomically, so a reader never sees half of it."""
    result = {
        "replica": trainer.replica,
        "generation": generation,
        "commits": trainer.commits,
        "final_loss": trainer.last_loss,
        "state_hash": state_hash(trainer),
        "num_params": num_params(trainer.model),
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


def main(
    replica: int = typer.Option(..., help="Replica index: its data shard and torchft replica id."),
    steps: int = typer.Option(..., help="Train until this many steps are committed."),
    out: Path = typer.Option(..., help="Where to write the JSON result."),
    generation: int = typer.Option(0, help="How many times this replica was restarted before."),
    model_params: Optional[int] = typer.Option(
        None, help="Approximate model size; the workload's small default when omitted or 0."),
    batch_size: int = typer.Option(BATCH_SIZE, min=1, help="Sequences per replica and step."),
    lr: float = typer.Option(LEARNING_RATE, help="AdamW's learning rate."),
    seed: int = typer.Option(SEED, help="Seeds the model and the language."),
    sleep_per_step: float = typer.Option(0.0, help="Seconds to sleep after each step."),
    last_step_file: Optional[Path] = typer.Option(
        None, help="Train to the step this file names instead of --steps, and on until the "
                   "supervisor has written it."),
) -> None:
    """Train one torchft replica and write its commit timeline to ``--out``."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    for name in TORCHFT_TIMEOUT_ENVS:
        os.environ.pop(name, None)
    trainer = Trainer(replica=replica, model_params=model_params, batch_size=batch_size, lr=lr,
                      seed=seed)
    # The store must outlive the manager: it is the replica group's rendezvous server.
    manager, _store = build_manager(trainer)
    try:
        train(trainer, manager, steps=steps, progress=progress_path(out),
              sleep_per_step=sleep_per_step, last_step_file=last_step_file)
    finally:
        manager.shutdown(wait=False)
    write_result(out, trainer, generation)
    logger.info("replica %d generation %d done: %d commits", replica, generation,
                len(trainer.commits))


if __name__ == "__main__":
    typer.run(main)
