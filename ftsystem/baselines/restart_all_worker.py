"""One rank of the synchronous restart-all baseline: plain DDP over Gloo under torchrun elastic.

Run by ``torchrun`` (one process per node), never by hand; ``restart_all`` builds the command.
It trains the same TinyGPT on the same Markov language, batch size, learning rate and optimizer
as ``ftsystem.example.train``, averaging gradients with ``DistributedDataParallel``. Rank 0 writes a
checkpoint every ``--checkpoint-every`` steps (to a temporary name, then renamed, so a kill
mid-write never leaves a torn file) and every generation starts from the newest one: the steps
after it are computed again. That is the recovery model the baseline stands for.

Files in ``--workdir``, per node (``FTSYSTEM_NODE``, set by the runner, because torchrun may
hand a node a different rank after each restart):

- ``<node>.commits``: ``step unix_time`` appended at every committed step, over all generations;
- ``<node>.starts``: one JSON line per generation (restart count, rank, step it resumed from);
- ``<node>.pid``: the current generation's pid, for failure injection;
- ``<node>.json``: the result, written when training ends.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT

ENV_NODE = "FTSYSTEM_NODE"
CHECKPOINT = "checkpoint.pt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", type=Path, required=True, help="checkpoint, logs, results")
    p.add_argument("--steps", type=int, default=300, help="steps to train")
    p.add_argument("--until", type=float, default=0.0,
                   help="unix time after which training stops early (0: never)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="Gloo collective timeout (s): a hung or cut-off peer fails the group")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="how long ranks wait for each other at start (s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="seeds the model and the language")
    p.add_argument("--model-params", type=int, default=0,
                   help="approximate parameter count (0: the small default model)")
    p.add_argument("--sleep-per-step", type=float, default=0.0,
                   help="extra seconds per step, to emulate a slower accelerator")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a stuck rank, on ask
    node = os.environ[ENV_NODE]
    _write_atomic(args.workdir / f"{node}.pid", str(os.getpid()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.startup_timeout))
    try:
        run(args, node)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, node: str) -> None:
    """One generation: resume from the checkpoint, train, write the result.

    A function of its own so that DDP and the training group are released when it returns,
    before the process group is destroyed: a rank tearing Gloo down while it still holds
    them (and its peers still use them) was seen to hang in the destructors at exit.
    """
    model, optimizer, language = build(args)
    step = load_checkpoint(args.workdir / CHECKPOINT, model, optimizer)
    group = training_group(args.timeout)
    _append(args.workdir / f"{node}.starts", json.dumps({
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "rank": dist.get_rank(), "resumed_from": step, "pid": os.getpid(),
        "time": time.time()}))
    ddp = DistributedDataParallel(model, process_group=group)
    step, loss = train(ddp, group, optimizer, language, args, step, node)
    write_result(args.workdir / f"{node}.json", model, language, step, loss)
    dist.barrier(group=group)  # leave together, so no rank tears down under a busy peer


def training_group(timeout_s: float) -> dist.ProcessGroup:
    """The group training runs on, whose collectives give up after ``timeout_s``.

    Not the default group: ranks start seconds apart (imports, checkpoint loading; tens of
    seconds on a loaded machine), and a short timeout there fails every start and restarts the
    group forever. Once all ranks have met (the barrier, under the long startup timeout), a
    silent peer is hung or cut off, and ``timeout_s`` is the detector.
    """
    dist.barrier()
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def build(args: argparse.Namespace) -> tuple[TinyGPT, torch.optim.Optimizer, MarkovLanguage]:
    """The model, optimizer and data of ``ftsystem.example.train``, from the same seed."""
    torch.manual_seed(args.seed)
    cfg = ModelConfig.for_params(args.model_params) if args.model_params else ModelConfig()
    model = TinyGPT(cfg)
    language = MarkovLanguage(vocab_size=cfg.vocab_size, seed=args.seed)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr), language


def train(ddp: DistributedDataParallel, group: dist.ProcessGroup,
          optimizer: torch.optim.Optimizer, language: MarkovLanguage,
          args: argparse.Namespace, step: int, node: str) -> tuple[int, float | None]:
    """Train from ``step``; returns the last step and loss. Any peer failure raises."""
    rank, loss = dist.get_rank(), None
    seq_len = ddp.module.cfg.seq_len
    while step < args.steps and not _all_past(args.until, group):
        batch = language.batch(shard=rank, step=step, batch_size=args.batch_size,
                               seq_len=seq_len)
        optimizer.zero_grad()
        step_loss = _loss(ddp, batch)
        step_loss.backward()  # DDP all-reduces the gradients here
        if args.sleep_per_step:
            time.sleep(args.sleep_per_step)
        optimizer.step()
        step, loss = step + 1, step_loss.item()
        _append(args.workdir / f"{node}.commits", f"{step} {time.time():.6f}")
        if rank == 0 and step % args.checkpoint_every == 0:
            save_checkpoint(args.workdir / CHECKPOINT, ddp.module, optimizer, step)
    return step, loss


def _loss(ddp: DistributedDataParallel, batch: torch.Tensor) -> torch.Tensor:
    """``TinyGPT.loss``, but through the DDP wrapper: its forward arms the gradient all-reduce."""
    logits = ddp(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             batch[:, 1:].reshape(-1))


def _all_past(until: float, group: dist.ProcessGroup) -> bool:
    """Whether any rank is past ``until``: one vote, so that every rank stops at the same step."""
    if not until:
        return False
    vote = torch.tensor([float(time.time() >= until)])
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())


def load_checkpoint(path: Path, model: TinyGPT, optimizer: torch.optim.Optimizer) -> int:
    """Restore the newest checkpoint, if any; returns the step to resume from."""
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_checkpoint(path: Path, model: TinyGPT, optimizer: torch.optim.Optimizer,
                    step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "model": model.state_dict(),
                "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)  # atomic: a restart sees the old checkpoint or the new one


def write_result(path: Path, model: TinyGPT, language: MarkovLanguage, step: int,
                 loss: float | None) -> None:
    rank = dist.get_rank()
    _write_atomic(path, json.dumps({"step": step, "train_loss": loss, "rank": rank,
                                    "eval_loss": _eval_loss(model, language) if rank == 0
                                    else None}))


def _eval_loss(model: TinyGPT, language: MarkovLanguage) -> float:
    """ftsystem.example.train's held-out loss; rank 0 only, as every rank holds the same model."""
    # Imported here, not at the top: ftsystem.example.train pulls in torchft (1.5 s here), which
    # every restart would pay for nothing.
    from ftsystem.example.train import eval_loss
    return eval_loss(model, language)


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:  # one write per line: a kill leaves whole lines behind
        f.write(line + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
