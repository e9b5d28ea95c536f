"""Whether the members hold the same state, and what happens when they do not.

- Every ``FTSYSTEM_FINGERPRINT_EVERY`` steps the members compare state digests
  (:meth:`Integrity.compare_digests`). A replica whose digest differs from the majority's is
  reported and receives the majority's state in a new epoch; with no majority the job stops.
  Votes are counted per copy lineage (``fingerprint.lineage_votes``): replicas whose states
  descend from one whole-state copy made since the last comparison are one witness, so a
  joiner that copied a donor gone bad cannot outvote the healthy replicas with it, and no
  corruption ever has more than one vote.
- At every epoch entry the members compare signatures (registered objects, settings) and
  commit chains (``epoch_entry``); what differs is reported here.
- :meth:`Integrity.halt` stops a replica for good: no restart can fix what it found.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from ftsystem.control import keys
from ftsystem.measure import metrics
from ftsystem.training.fingerprint import WORDS, describe_split, from_words, judge, to_words
from ftsystem.training.ftar import CollectiveFailed, EpochChanged, FaultTolerantAllReduce
from ftsystem.training.local_state import LocalState
from ftsystem.training.replica_group import ReplicaGroup
from ftsystem.training.replicated import RegistrationMismatch
from ftsystem.training.runtime import ControlPlane, ReplicaContext
from ftsystem.training.settings import ENV_FINGERPRINT_EVERY

log = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """The members' states differ and no majority says which is right: the job must stop."""


class Integrity:
    def __init__(self, ctx: ReplicaContext, control: ControlPlane, replica: ReplicaGroup,
                 ftar: FaultTolerantAllReduce, state: LocalState, fingerprint_every: int,
                 device: torch.device) -> None:
        self.ctx, self.control, self.replica, self.ftar = ctx, control, replica, ftar
        self.state = state
        self.fingerprint_every = fingerprint_every
        self._device = device
        self._labels = (ctx.job, ctx.replica_id)
        self.divergences: list[dict] = []
        """Divergences this replica took part in: step, how found, who differed."""

    def signature_word(self) -> int:
        """What every replica must agree on, hashed: the registered objects, the interval of
        digest comparisons (their collectives must pair up)."""
        text = f"{self.state.objects.signature()}|{self.fingerprint_every}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                              signed=True)

    def signature_mismatch(self, donor: str) -> None:
        self.halt(RegistrationMismatch(
            f"replica {self.ctx.replica_id} registered [{self.state.objects.signature()}] with "
            f"{ENV_FINGERPRINT_EVERY}={self.fingerprint_every}, and replica {donor} something "
            "else: every replica of a job must register the same objects (names and "
            "advanced_by) and use the same settings"))

    def due(self, step: int) -> bool:
        return step % self.fingerprint_every == 0

    def compare_digests(self) -> bool:
        """Compare state digests with the members; True when this replica must receive the
        majority's state (it has been reported).

        A comparison that a failure interrupts is skipped: the next epoch's entry compares
        commit chains, the next comparison the states. The ranks of a replica decide
        together.
        """
        n, rank = self.ftar.world_size, self.ftar.rank
        if n == 1:
            return False
        started, verdict, split = time.monotonic(), None, None
        words = torch.zeros(n, WORDS + 1, dtype=torch.int64, device=self._device)
        words[rank] = torch.tensor([*to_words(self.state.digest()), self.state.lineage])
        try:
            self.ftar.allreduce_sum(words)
            rows = words.tolist()
            digests, lineages = [from_words(w[:WORDS]) for w in rows], [w[WORDS] for w in rows]
            verdict = judge(digests, lineages)
        except (EpochChanged, CollectiveFailed) as e:
            log.info("replica %s step %d: state digests not compared (%s)",
                     self.ctx.replica_id, self.state.step, e)
        diverged, unrepairable = self.replica.any(
            verdict is not None and rank in verdict.divergent,
            verdict is not None and not verdict.repairable)
        metrics.FINGERPRINT_DURATION.labels(*self._labels).observe(time.monotonic() - started)
        members = self.ftar.epoch.members
        if verdict is not None and not verdict.agreed:
            split = describe_split(digests, lineages, list(members))
            log.error("replica %s step %d: state digests differ (%s); diverged: %s, majority: %s",
                      self.ctx.replica_id, self.state.step, split,
                      [members[i] for i in verdict.divergent],
                      [members[i] for i in verdict.majority] or "none")
        if unrepairable:
            self.report_divergence("state-digest", [m for m in members
                                                    if m != self.ctx.replica_id])
            self.halt(DivergenceError(
                f"step {self.state.step}: the state digests of {', '.join(members)} differ "
                f"({split or 'on another rank of this replica'}) and no majority agrees on "
                "one: nobody can tell which state is right, so the job stops. Restart it from "
                "the last disk checkpoint; see docs/divergence.md"))
        if diverged:
            self.report_divergence("state-digest", [members[i] for i in verdict.majority]
                                   if verdict is not None else [])
            return True
        if verdict is not None:
            self.state.compared()
        return False

    def report_divergence(self, found_by: str, differs_from: list[str]) -> None:
        """Name this replica as diverged: a log line, a metric, an event in etcd (REST)."""
        epoch = self.ftar.epoch.number
        event = {"kind": "divergence", "replica": self.ctx.replica_id,
                 "step": self.state.step, "epoch": epoch, "found_by": found_by,
                 "differs_from": differs_from, "time": time.time()}
        self.divergences.append(event)
        log.error("replica %s diverged at step %d (epoch %d, found by %s): its state differs "
                  "from %s's", self.ctx.replica_id, self.state.step, epoch, found_by,
                  ", ".join(differs_from) or "the others")
        metrics.DIVERGENCES.labels(*self._labels, found_by).inc()
        try:
            self.control.put_json(keys.divergence(self.ctx.job, self.state.step,
                                                  self.ctx.replica_id), event)
        except Exception as e:  # the report must not stop the repair
            log.warning("replica %s: divergence event not written: %s", self.ctx.replica_id, e)

    def halt(self, error: Exception) -> None:
        """Raise ``error``, which no restart can fix: its agent stops restarting this replica."""
        log.error("replica %s: %s", self.ctx.replica_id, error)
        self.control.put_json(keys.halted(self.ctx.job, self.ctx.replica_id),
                              {"time": time.time(), "step": self.state.step,
                               "reason": str(error)})
        raise error
