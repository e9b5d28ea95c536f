"""The example replica program of ``ftsystem run``: TinyGPT on the synthetic Markov language.

A training loop as users write them, through the public API only (docs/adopting.md): AdamW with
a warmup-plus-cosine ``LambdaLR`` stepped every committed step, the averaged gradient clipped,
a ``GradScaler`` (or bf16 autocast), dropout, and a torchdata ``StatefulDataLoader``. The
scheduler and the scaler are advanced by the step function, which ``FTReplica`` runs after
averaging, live and when it replays logged steps; the loader is advanced by the loop.

Run it under an agent: ``ftsystem agent ... -- python -m ftsystem.example.train --steps 300``. At the end
it writes ``OUT/<replica>.json`` (commits with wall times, epochs entered, final losses, the state
hash) for the run's summary.

Under ``--nproc-per-replica N`` each of the replica's N ranks runs this program: the model is
sharded over them with FSDP2 (each transformer block, then the rest), rank k reads data shard
``replica_shard * N + k``, and rank 0 writes the result, with every rank's shard hash. With
``--tp T`` the ranks form a ``(dp_shard, tp)`` mesh of ``(N / T, T)`` instead: tensor parallelism
over ``tp`` (the Llama-laid-out ``TinyDecoder``, ``ftsystem.example.tensor_parallel``), FSDP2
over ``dp_shard`` when it has several ranks; the ``T`` ranks of a ``tp`` group read one data
shard, ``replica_shard * N / T + dp_shard rank``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import hashlib
import json
import os
import logging
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchdata.stateful_dataloader import StatefulDataLoader

from ftsystem.training.devices import local_device
from ftsystem.training.replica import FTReplica
from ftsystem.training.replica_group import init_replica_group
from ftsystem.training.replicated import Batches
from ftsystem.example.tensor_parallel import TinyDecoder, parallelize
from ftsystem.example.workload import MarkovBatches, MarkovLanguage, ModelConfig, TinyGPT, num_params

EVAL_SHARD = -1  # a shard no replica trains on
# torchdata 0.11 calls a torch API that torch deprecated since; nothing to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300, help="committed steps to train")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per replica and step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20,
                   help="steps of linear warmup before the cosine decay")
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip the averaged gradient to this norm (0: no clipping)")
    p.add_argument("--amp", choices=("scaler", "bf16", "off"), default="scaler",
                   help="a GradScaler (loss scaling), bf16 autocast, or neither")
    p.add_argument("--dropout", type=float, default=None,
                   help="dropout in TinyGPT's blocks (default 0.1; TinyDecoder, under --tp, has "
                        "none)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model and the language")
    p.add_argument("--data-shard", type=int, default=0, help="this replica's data shard")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree inside the replica (a divisor of its ranks): "
                        "its ranks form a (dp_shard, tp) mesh and the model is TinyDecoder; 1: "
                        "FSDP2 over every rank and TinyGPT")
    p.add_argument("--model-params", type=int, default=0,
                   help="approximate parameter count (0: the small default model)")
    p.add_argument("--sleep-per-step", type=float, default=0.0,
                   help="extra seconds per step, to emulate a slower accelerator")
    p.add_argument("--straggle", type=_straggle, default=None, metavar="STEP:SECONDS",
                   help="sleep SECONDS before the all-reduce of step STEP, once: a replica "
                        "alive but holding the others back (its beats go on)")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="all-reduce gradient buckets during backward (auto: on GPU only)")
    p.add_argument("--loop", choices=("real", "plain"), default="real",
                   help="real: the loop above; plain: the minimal one (optimizer.step() after "
                        "averaging, batches by step; no scheduler, scaler, clipping, dropout "
                        "or loader), as the benchmarks' baselines run it")
    p.add_argument("--ema", type=float, default=0.0,
                   help="keep an exponential moving average of the weights with this decay "
                        "(torch.optim.swa_utils.AveragedModel, registered; 0: none)")
    p.add_argument("--freeze", choices=("none", "pos"), default="none",
                   help="freeze the position embedding (a frozen layer: no gradient, never "
                        "moved by weight decay or momentum)")
    p.add_argument("--unfreeze-at", type=int, default=None, metavar="STEP",
                   help="with --freeze pos: unfreeze the position embedding at this step "
                        "(gradual unfreezing, which FTReplica refuses: the job halts once)")
    p.add_argument("--passes", type=int, default=1,
                   help="the loader's data is this many times shorter than the job, so it "
                        "makes this many shuffled passes over it")
    p.add_argument("--forget-scheduler", action="store_true",
                   help="a bug on purpose: do not register the LR scheduler (the replicas' "
                        "states then diverge after a restart, and the digests must say so)")
    p.add_argument("--out", type=Path, default=None, help="directory for the result JSON")
    p.add_argument("--linger", type=float, default=120.0,
                   help="seconds a finished replica waits to serve replicas still restarting")
    args = p.parse_args(argv)
    if args.tp > 1 and (args.ema or args.freeze != "none" or args.dropout):
        p.error("--ema, --freeze and --dropout are for TinyGPT: leave them out with --tp")
    if args.dropout is None:
        args.dropout = 0.0 if args.tp > 1 else 0.1
    return args


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The LR factor at a step: linear warmup to 1, then cosine decay to 0.1."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        # numpy, as such lambdas are often written: the scheduler then puts numpy floats
        # into the optimizer's param_groups, which every state transfer carries.
        return 0.1 + 0.45 * (1 + np.cos(np.pi * progress))
    return factor


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    if args.loop == "plain":
        args.amp, args.clip, args.dropout = "off", 0.0, 0.0
    cfg = ModelConfig.for_params(args.model_params) if args.model_params else ModelConfig()
    cfg.dropout = args.dropout
    ranks = init_replica_group()  # also makes this rank's device current
    device = local_device()
    mesh = replica_mesh(device, ranks, args.tp)
    model = (TinyGPT if mesh is None else TinyDecoder)(cfg).to(device)
    if args.freeze == "pos":
        model.pos.weight.requires_grad_(False)
    # Before sharding: FSDP2 modules cannot be deep-copied; the average is sharded as the
    # model is, so each rank averages its own shard.
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema)) \
        if args.ema and args.loop == "real" else None
    if mesh is not None:
        parallelize(model, mesh["tp"])
        if mesh["dp_shard"].size() > 1:
            shard_model(model, mesh["dp_shard"])
    elif ranks > 1:
        shard_model(model)
        if ema is not None:
            shard_model(ema.module)
    language = MarkovLanguage(vocab_size=cfg.vocab_size, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "scaler")
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    if args.loop == "plain":
        ft = FTReplica(model, optimizer, overlap=overlap, mesh=mesh)
        shard = data_shard(ft, args.data_shard)
        batches = (language.batch(shard=shard, step=ft.step, batch_size=args.batch_size,
                                  seq_len=cfg.seq_len) for _ in itertools.count())
    else:
        ft, batches = real_loop(model, optimizer, scaler, ema, language, args, device, overlap,
                                mesh)
    try:
        ft.start()
        loss = train(ft, model, batches, scaler, args, device)
        ft.finish(args.linger)
        write_result(ft, model, language, args, loss)
    finally:
        ft.close()


def real_loop(model: TinyGPT, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler, ema: AveragedModel | None, language: MarkovLanguage,
              args: argparse.Namespace, device: torch.device, overlap: bool | None,
              mesh: DeviceMesh | None) -> tuple[FTReplica, Batches]:
    """The replica of a real loop: a step function after averaging, everything registered."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup,
                                                                           args.steps))
    step_after_averaging = real_step(model, optimizer, scaler, scheduler, ema, args, device)
    ft = FTReplica(model, optimizer, step_fn=step_after_averaging, overlap=overlap, mesh=mesh)
    if not args.forget_scheduler:
        ft.register("lr_schedule", scheduler)
    ft.register("grad_scaler", scaler)
    if ema is not None:
        ft.register("ema", ema)
    shard = data_shard(ft, args.data_shard)
    return ft, ft.register_data("data", data_loader(language, model.cfg, args, shard))


def real_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler, scheduler: torch.optim.lr_scheduler.LRScheduler,
              ema: AveragedModel | None, args: argparse.Namespace, device: torch.device
              ) -> Callable[[], None]:
    """The real loop's step on averaged gradients: unscale, clip, step, schedule, average."""
    def step_after_averaging() -> None:
        # A replayed step ran no forward pass, so scale() never initialized the scaler.
        scaler.scale(torch.zeros((), device=device))
        scaler.unscale_(optimizer)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if ema is not None:
            ema.update_parameters(model)
    return step_after_averaging


def data_loader(language: MarkovLanguage, cfg: ModelConfig, args: argparse.Namespace,
                shard: int) -> StatefulDataLoader:
    """This rank's shard, shuffled by a generator seeded with the job's seed (the recipe
    ``register_data`` requires), so every replica's loader holds the same state (its position)
    at equal steps and draws the same order in every pass, while each reads its own shard."""
    length = max(64, args.steps) if args.passes == 1 else -(-args.steps // args.passes)
    dataset = MarkovBatches(language, shard=shard, num_batches=length,
                            batch_size=args.batch_size, seq_len=cfg.seq_len)
    return StatefulDataLoader(dataset, batch_size=None, shuffle=True,
                              generator=torch.Generator().manual_seed(args.seed))


def replica_mesh(device: torch.device, ranks: int, tp: int) -> DeviceMesh | None:
    """The replica's ``(dp_shard, tp)`` mesh for ``--tp``; None without tensor parallelism."""
    if tp == 1:
        return None
    if tp < 1 or ranks % tp:
        raise ValueError(f"--tp {tp} must divide the replica's {ranks} ranks")
    return init_device_mesh(device.type, (ranks // tp, tp), mesh_dim_names=("dp_shard", "tp"))


def data_shard(ft: FTReplica, replica_shard: int) -> int:
    """This rank's data shard: the ranks of a ``tp`` group compute on one batch together."""
    if ft.mesh is None:
        return replica_shard * ft.ctx.world_size + ft.ctx.rank
    dp = ft.mesh["dp_shard"]
    return replica_shard * dp.size() + dp.get_local_rank()


def shard_model(model: TinyGPT | TinyDecoder, mesh: DeviceMesh | None = None) -> None:
    """FSDP2 over the replica's ranks (or ``mesh``): each block is one unit, the embeddings and
    norm another."""
    blocks = model.layers if isinstance(model, TinyDecoder) else model.blocks.layers
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _straggle(text: str) -> tuple[int, float]:
    step, sep, seconds = text.partition(":")
    try:
        if sep and int(step) >= 1 and float(seconds) >= 0:
            return int(step), float(seconds)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected STEP:SECONDS, a step of at least 1 and seconds "
                                     f"of at least 0 (as 40:5), not {text!r}")


def train(ft: FTReplica, model: TinyGPT, batches: Iterator[torch.Tensor],
          scaler: torch.amp.GradScaler, args: argparse.Namespace, device: torch.device
          ) -> float | None:
    loss = None  # a replica that joins at the last step commits nothing itself
    progress = _progress_file(ft, args)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.amp == "bf16" \
        else contextlib.nullcontext()
    model.train()
    while ft.step < args.steps:
        if args.unfreeze_at is not None and ft.step == args.unfreeze_at:
            model.pos.weight.requires_grad_(True)
        batch = next(batches).to(device)
        with autocast:
            step_loss = model.loss(batch)
        scaler.scale(step_loss).backward()
        if args.sleep_per_step:
            time.sleep(args.sleep_per_step)
        if args.straggle is not None and ft.step + 1 == args.straggle[0]:
            time.sleep(args.straggle[1])
        if ft.commit(loss=step_loss.item(), samples=args.batch_size):
            loss = step_loss.item()
            if progress is not None:
                os.write(progress, "{} {!r}\n".format(*ft.commits[-1]).encode())
    return loss


def _progress_file(ft: FTReplica, args: argparse.Namespace) -> int | None:
    """``<out>/<replica>.commits``: ``step unix_time`` per commit, across generations.

    The result JSON holds the last generation's commits only; ETTR needs all of them. One
    ``write`` per line on an append-only descriptor: a kill never leaves half a line.
    """
    if args.out is None or ft.ctx.rank != 0:
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{ft.ctx.replica_id}.commits"
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def eval_loss(model: TinyGPT, language: MarkovLanguage) -> float:
    batch = language.batch(shard=EVAL_SHARD, step=0, batch_size=64, seq_len=model.cfg.seq_len)
    batch = batch.to(model.tok.weight.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model.loss(batch).item()
    finally:
        model.train(was_training)


def write_result(ft: FTReplica, model: TinyGPT, language: MarkovLanguage,
                 args: argparse.Namespace, loss: float | None) -> None:
    """Rank 0 writes the replica's result; the state hash covers every rank's shard."""
    if args.out is None:
        return
    evaluated = eval_loss(model, language)  # a forward of a sharded model needs every rank
    shard_hashes = ft.replica.gather(ft.state_hash())
    shard_catchup = [json.loads(s) for s in ft.replica.gather(json.dumps(ft.catchup_stats))]
    if ft.ctx.rank != 0:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"replica": ft.ctx.replica_id, "generation": ft.ctx.generation, "step": ft.step,
              "started": ft.started, "resumed_from": ft.resumed_from,
              "commits": ft.commits, "epochs": ft.epochs, "catchup": ft.catchup_stats,
              "overlapped_commits": ft.overlapped_commits, "divergences": ft.divergences,
              "partial_sums": ft.partial_sums,
              "commit_ms": ft.commit_times.per_commit_ms(),
              "start_up_commit_ms": ft.commit_times.start_up_ms(),
              "lr": ft.optimizer.param_groups[0]["lr"],
              "shard_catchup": shard_catchup,
              "train_loss": loss,
              "eval_loss": evaluated, "shard_hashes": shard_hashes,
              "state_hash": hashlib.sha256("".join(shard_hashes).encode()).hexdigest(),
              "num_params": num_params(model),
              "device": str(next(model.parameters()).device)}
    write_once(args.out / f"{ft.ctx.replica_id}.json", result)


def write_once(path: Path, result: dict) -> None:
    """Write ``result`` unless the file holds another generation's: a replica's result is
    its state at the end of the job, and a later generation of the same replica (a spare that
    took over after it finished, by a race) must not replace it with something else.
    ``os.link`` creates the file only if it is absent, atomically."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    try:
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            existing = json.loads(path.read_text())
        if existing.get("generation") == result["generation"]:
            os.replace(tmp, path)
            return
        logging.getLogger(__name__).error(
            "replica %s generation %s: %s holds generation %s's result; keeping it",
            result["replica"], result["generation"], path, existing.get("generation"))
    finally:
        tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
