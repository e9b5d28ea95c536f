"""The ranks of one replica: the static group FSDP shards over, and the replica's own votes.

A replica of N ranks is one member of the job. Rank k takes part in the cross-replica group of
shard k (``FaultTolerantAllReduce(shard_index=k)``), and the replica commits a step only when
every one of its ranks succeeded in the same epoch (docs/design.md, step protocol, step 3):
otherwise shard 0 could commit step t while shard 1 does not, and no peer could repair the mix. So
each attempt (an all-reduce of the gradients, or entering an epoch) ends with a :meth:`vote`, and
whatever changes the state is applied only after the vote passed.

Votes travel over a Gloo group of the replica's ranks (CPU-side control, whatever backend
moves the shards). Their timeout is the process group's default: a dead rank takes its whole
replica down through the agent, so a vote never waits on a dead peer for long. A replica of
one rank has no group, and every agreement is its own decision.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ftsystem.training.devices import local_device, use_device
from ftsystem.training.stores import replica_store


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the ranks of a replica reported for one attempt."""

    failed: bool
    """Some rank's collective failed: nobody else may publish a newer epoch, ask for one."""
    superseded: bool
    """Some rank found a newer epoch published while it waited."""
    lowest: int
    highest: int
    """The epoch numbers the ranks used: they differ when ranks entered different epochs."""
    replaced: bool
    """Some rank's state was replaced by a peer's (its gradients are stale)."""

    @property
    def ok(self) -> bool:
        return not self.failed and not self.superseded and self.lowest == self.highest

    @property
    def split(self) -> bool:
        return self.lowest != self.highest


class ReplicaGroup:
    """Agreement among the ranks of one replica (trivial for a replica of one rank)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._group = None
        if size > 1:
            if not dist.is_initialized() or dist.get_world_size() != size:
                raise RuntimeError(
                    f"a replica of {size} ranks needs its process group before FTReplica: "
                    "call ftsystem.training.replica_group.init_replica_group() first, then shard the "
                    "model with fully_shard and build the optimizer")
            self._group = dist.new_group(backend="gloo")

    def _max(self, values: list[float]) -> list[float]:
        if self._group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return tensor.tolist()

    def vote(self, *, failed: bool, superseded: bool, epoch: int, replaced: bool = False
             ) -> Verdict:
        f, s, hi, neg_lo, r = self._max([failed, superseded, epoch, -epoch, replaced])
        return Verdict(failed=bool(f), superseded=bool(s), lowest=int(-neg_lo), highest=int(hi),
                       replaced=bool(r))

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """Per flag: whether it holds on some rank."""
        return tuple(bool(f) for f in self._max([float(f) for f in flags]))

    def max(self, value: int) -> int:
        return int(self._max([value])[0])

    def gather(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order."""
        if self._group is None:
            return [text]
        out: list[str] = [""] * self.size
        dist.all_gather_object(out, text, group=self._group)
        return out

    def barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)


def check_mesh(mesh: DeviceMesh, world_size: int) -> None:
    """Refuse a device mesh that is not the replica's own ranks in rank order.

    ftsystem's replicas are the outer, fault-tolerant data-parallel dimension: a replica's mesh
    holds only its own ranks (``WORLD_SIZE``), whatever it combines inside (FSDP2, tensor or
    pipeline parallelism). Rank k of every replica holds the same part of the model and sums it
    with rank k of the others, so every replica must lay its mesh out alike, in rank order, as
    ``init_device_mesh`` does.
    """
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(world_size)):
        dims = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
        raise ValueError(
            f"FTReplica(mesh=...): the mesh {dims or tuple(mesh.mesh.shape)} holds ranks "
            f"{ranks}, not this replica's {world_size} ranks (WORLD_SIZE) in rank order. Build "
            "it over the replica's own ranks, e.g. init_device_mesh(device, (dp_shard, tp), "
            "mesh_dim_names=(\"dp_shard\", \"tp\")) with dp_shard * tp = WORLD_SIZE: the "
            "replicas themselves are the data-parallel dimension across meshes, so leave out "
            "any dimension that spans replicas")


def init_replica_group() -> int:
    """Start the process group of this replica's ranks from the agent's environment.

    Call it first thing in every replica (before ``fully_shard``); it returns the number of
    ranks. On a GPU machine it makes the rank's GPU (``ftsystem.training.devices.local_device()``) the
    current device, also in a replica of one, which has no group. NCCL carries the shards on
    GPU, Gloo on CPU.
    """
    use_device(local_device())  # before the group: NCCL binds communicators to it
    size = int(os.environ.get("WORLD_SIZE", "1"))  # every node's ranks of the replica
    if size > 1 and not dist.is_initialized():
        rank = int(os.environ["RANK"])
        # torch's env:// rendezvous would serve the store on every address: this one listens
        # on the agent's advertised address only
        store = replica_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              serve=rank == 0)
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                store=store, rank=rank, world_size=size)
    return size
