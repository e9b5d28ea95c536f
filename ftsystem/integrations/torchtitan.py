"""torchtitan's trainer with ftsystem's fault tolerance: ``FTSystemTrainer`` and its config.

Each replica is one torchtitan job under an ``ftsystem agent`` (its own ``torchrun``-style ranks,
any parallelism inside but the replicated one and pipelines); ftsystem makes the replicas the
fault-tolerant data-parallel dimension across them. The trainer is torchtitan's, with three
seams changed (docs/torchtitan.md):

- after backward, :meth:`FTReplica.commit` averages this rank's gradients with the same rank
  of every other replica, and only then runs the step: clipping, the optimizer, the schedule
  (``_step_after_averaging``); a commit the replicas do not all make changes nothing;
- the learning-rate schedule, the data loader's position and the token count are registered
  with the replica, so a replica restarted after a failure catches up on all of them from a
  live one while the others train on (no checkpoint reload, no job restart);
- the data loader of each replica reads its own shard (``fault_tolerance.data_shard`` of
  ``fault_tolerance.num_replicas``), and its state must be the same in every replica at equal
  steps: :class:`TokenFileDataLoader` is such a loader.

Run it as torchtitan runs any trainer, under an agent per replica::

    ftsystem agent --etcd ... --job JOB --replica-id r0 -- \\
        python -m torchtitan.train --module ftsystem.integrations.torchtitan \\
        --config llama3_debugmodel --dataloader.path tokens.bin \\
        --fault_tolerance.num_replicas 3 --fault_tolerance.data_shard 0
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.dataloader import DataloaderExhaustedError, ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from ftsystem.training.replica import FTReplica

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class FaultTolerance:
    """Where this replica stands among the job's replicas (``--fault_tolerance.*``)."""

    num_replicas: int = 1
    """The job's replicas: the data is cut into ``num_replicas`` times each replica's own
    data-parallel degree shards."""

    data_shard: int = 0
    """This replica's part of the data, from 0 to ``num_replicas - 1``."""

    linger_s: float = 120.0
    """How long a replica that reached the last step stays to serve replicas still catching
    up (``FTReplica.finish``)."""


class FTSystemTrainer(Trainer):
    """torchtitan's ``Trainer`` whose replicas survive each other's failures (module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    ft: FTReplica

    def __init__(self, config: Config) -> None:
        check_config(config)
        super().__init__(replace(config, dataloader=ReplicaDataShard(
            config.dataloader, config.fault_tolerance)))
        check_loader(self.dataloader)
        optimizers = self.optimizers.optimizers
        if len(optimizers) != 1:
            raise ValueError(
                f"FTSystemTrainer: the optimizer config builds {len(optimizers)} optimizers; "
                "a replica averages and steps one. Use one optimizer (param_groups may differ "
                "in lr and weight decay, not in optimizer)")
        self._grad_norm = torch.zeros(())
        self.ft = FTReplica(self.model_parts[0], optimizers[0],
                            step_fn=self._step_after_averaging,
                            overlap=False if self.gradient_accumulation_steps > 1 else None,
                            mesh=self.parallel_dims.world_mesh)
        self.ft.register("lr_schedulers", self.lr_schedulers)
        self.ft.register("train_state", self, advanced_by="loop")  # the tokens seen
        self._batches = self.ft.register_data("data", self.dataloader)

    def train(self) -> None:
        """Join the job, train to ``training.steps`` committed steps, then serve late joiners."""
        self.ft.start()
        batches = self.batch_generator(self._batches)
        while self.ft.step < self.config.training.steps:
            self.step = self.ft.step + 1
            self.gc_handler.run(self.step)
            try:
                self.train_step(batches)
            except DataloaderExhaustedError:
                log.warning("ran out of data at step %d: the replica finishes there", self.step)
                break
        self.ft.finish(self.config.fault_tolerance.linger_s)

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
                   ) -> None:
        """Forward and backward over the step's microbatches, then the replicas' commit."""
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
        global_tokens = torch.tensor(tokens, device=self.device)
        if self.parallel_dims.dp_enabled:  # the replica's own data-parallel ranks
            global_tokens = dist_utils.dist_sum_tensor(global_tokens,
                                                       self.parallel_dims.get_mesh("batch"))
        loss = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            loss += self.forward_backward_step(
                input_dict={k: _to(v, self.device) for k, v in inputs.items()},
                labels=labels.to(self.device), global_valid_tokens=global_tokens).detach()
        committed = self.ft.commit(loss=loss.item(), samples=len(microbatches) * len(
            microbatches[0][1]))
        if committed and self.metrics_processor.should_log(self.step):
            log.info("replica %s step %d: loss %.4f, grad norm %.4f", self.ft.ctx.replica_id,
                     self.step, loss.item(), float(self._grad_norm))

    def _step_after_averaging(self) -> None:
        """What torchtitan's step does after backward, run on the replicas' average (and on
        logged averages when a replica replays steps it missed)."""
        self._grad_norm = dist_utils.clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.config.training.max_norm, foreach=True,
            ep_enabled=self.parallel_dims.ep_enabled)
        self.optimizers.step()
        self.lr_schedulers.step()

    def close(self) -> None:
        if hasattr(self, "ft"):
            self.ft.close()
        super().close()


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def check_config(config: FTSystemTrainer.Config) -> None:
    """Refuse, before anything is built, what a replica cannot run; warn of what has no effect."""
    ft, parallelism = config.fault_tolerance, config.parallelism
    if not 0 <= ft.data_shard < ft.num_replicas:
        raise ValueError(f"fault_tolerance.data_shard {ft.data_shard} must be in 0.."
                         f"{ft.num_replicas - 1} (fault_tolerance.num_replicas)")
    if parallelism.data_parallel_replicate_degree != 1:
        raise ValueError(
            "parallelism.data_parallel_replicate_degree must be 1: ftsystem's replicas are the "
            "replicated data-parallel dimension. Run more replicas instead (one agent each)")
    if parallelism.pipeline_parallel_degree != 1:
        raise ValueError("parallelism.pipeline_parallel_degree must be 1: FTSystemTrainer "
                         "averages one model part per rank")
    if not config.training.disable_cuda_graphs:
        raise ValueError(
            "set training.disable_cuda_graphs: each commit hands the averaged gradients in as "
            "new tensors, which a captured CUDA graph cannot follow")
    if config.checkpoint.enable:
        log.warning("checkpoint.enable has no effect: ftsystem keeps and restores the "
                    "replicated state itself (FTSYSTEM_CHECKPOINT_DIR, docs/checkpoints.md)")
    if config.validator.enable:
        log.warning("validator.enable has no effect: FTSystemTrainer does not validate")


def check_loader(loader: Any) -> None:
    """Refuse a loader whose state differs between replicas at equal steps (it is replicated
    state: a replica that catches up loads a live replica's)."""
    if isinstance(loader, ParallelAwareDataloader) and \
            type(loader).state_dict is ParallelAwareDataloader.state_dict:
        raise ValueError(
            f"{type(loader).__name__} keys its state by its data-parallel rank and keeps "
            "its shard's pending tokens in it, so replicas at one step hold different states. "
            "Use ftsystem.integrations.torchtitan.TokenFileDataLoader, or give the loader a "
            "state_dict() that is the same in every replica at equal steps (a position)")


class ReplicaDataShard:
    """A dataloader config whose loaders read this replica's part of the data.

    torchtitan hands a loader the replica's own data-parallel degree and rank; across the job
    there are ``num_replicas`` times as many shards, and this replica's are consecutive.
    """

    def __init__(self, config: Any, ft: FaultTolerance) -> None:
        self.config, self.ft = config, ft

    def build(self, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
        return self.config.build(dp_world_size=dp_world_size * self.ft.num_replicas,
                                 dp_rank=self.ft.data_shard * dp_world_size + dp_rank, **kwargs)

    def to_dict(self) -> dict:
        return self.config.to_dict()


class TokenIds(BaseTokenizer):
    """The tokenizer of data that is token ids already (:class:`TokenFileDataLoader`'s): none.
    torchtitan's trainer builds a tokenizer whatever its loader needs."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, **unused: Any) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the data is token ids: there is no text to encode")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the data is token ids: there is no tokenizer to decode them")

    def get_vocab_size(self) -> int:
        raise NotImplementedError("the data is token ids: the model's config has the vocabulary")


class TokenWindows(Dataset):
    """Samples of ``seq_len + 1`` consecutive tokens from a flat file of token ids, every
    ``num_shards``-th one from ``shard``: item i is window ``i * num_shards + shard``."""

    def __init__(self, path: str, dtype: str, seq_len: int, shard: int, num_shards: int) -> None:
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len, self.shard, self.num_shards = seq_len, shard, num_shards
        windows = (len(self.tokens) - 1) // seq_len
        self.length = (windows - shard + num_shards - 1) // num_shards
        if self.length <= 0:
            raise ValueError(f"{path}: {len(self.tokens)} tokens make no window of {seq_len + 1} "
                             f"for shard {shard} of {num_shards}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        start = (index * self.num_shards + self.shard) * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return {"input": window[:-1], "positions": torch.arange(self.seq_len)}, window[1:]


class TokenFileDataLoader(ParallelAwareDataloader):
    """Batches of windows of a pre-tokenized file, shuffled by the job's seed.

    Its state is the shuffle's position alone (the same in every replica at equal steps), so
    ftsystem can hand it to a replica that catches up; each replica's shard is a constructor
    argument. No tokenizer is used: the file holds token ids.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        path: str = ""
        """A flat binary file of token ids (``numpy.ndarray.tofile``)."""
        dtype: str = "uint16"
        """Their numpy dtype."""
        seed: int = 0
        """The shuffle's seed: the job's, the same in every replica."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 local_batch_size: int, **unused: Any) -> None:
        if not config.path or not os.path.exists(config.path):
            raise ValueError(f"dataloader.path {config.path!r}: no such file of token ids")
        dataset = TokenWindows(config.path, config.dtype, seq_len, dp_rank, dp_world_size)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size, shuffle=True, drop_last=True,
                         generator=torch.Generator().manual_seed(config.seed),
                         num_workers=config.num_workers)

    def state_dict(self) -> dict[str, Any]:
        return StatefulDataLoader.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        StatefulDataLoader.load_state_dict(self, state_dict)


def llama3_debugmodel() -> FTSystemTrainer.Config:
    """torchtitan's debug Llama 3 (6M parameters) under ftsystem, reading ``dataloader.path``.

    Its inner attention is ``ScaledDotProductAttention``, which trains on any device (torchtitan
    defaults to FlexAttention, which has no backward on CPU); the sequences are whole windows
    of the token file, so a causal mask is all they need.
    """
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    for _, _, parent, name in spec.model.traverse(FlexAttention.Config):
        setattr(parent, name, ScaledDotProductAttention.Config())
    return FTSystemTrainer.Config(
        model_spec=spec,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        tokenizer=TokenIds.Config(),
        dataloader=TokenFileDataLoader.Config(),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8,
                                                  decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=8, seq_len=2048, steps=10,
                                disable_cuda_graphs=True),
        activation_checkpoint=None,
    )


__all__ = ["FTSystemTrainer", "FaultTolerance", "TokenFileDataLoader", "TokenIds",
           "llama3_debugmodel"]
