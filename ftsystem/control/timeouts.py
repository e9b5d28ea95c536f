"""One timeout for users to set; every other deadline is derived from it here.

torchft users hand-tune a hierarchy of timeouts (heartbeat, quorum, collective, connect). Here
they set one, ``FTSYSTEM_TIMEOUT_S`` (``--timeout``, 30 s by default): the longest a hung or
partitioned replica may stall the survivors. The paths that detect such a replica are derived so
that each ends well within it:

- a hung process stops writing its heartbeat: the agent's watchdog fires after a third of it and
  revokes the replica's lease, which publishes an epoch without the replica within milliseconds;
- a partitioned host (or a dead one) stops renewing its lease: etcd expires it after a third of
  it (plus up to a second of etcd's own granularity), with the same effect;
- a collective, a rendezvous or a state transfer gives up after the whole timeout: the backstop
  for what neither path catches (a silently lossy link, a peer stuck inside the kernel).

Survivors abandon an in-flight all-reduce the moment a newer epoch appears, so they are stalled
for about a third of the timeout, and never longer than the timeout. A replica that is alive
but holds the others back at a step's all-reduce is named by them sooner: within the straggler
bound, a multiple of the step time (:class:`StragglerBound`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

NODE_LEASE_TTL_S = 40
"""An agent's hold on its node rank (``agent.slot``) lapses this long after its last renewal,
like a Kubernetes node lease (the kubelet's: 40 s, renewed every 10 s). It is not how a dead node
is noticed (UDP pulses, the replica lease and the data plane do that in about a second, and the
survivors free the dead node's rank at once); it only frees the rank of an agent that died with
no surviving peer to free it, for a spare. Being long, it costs etcd 16,384 / 10 = 1,638
keep-alives a second at 16,384 nodes, not the 4,915 of a 10 s lease renewed every third."""
NODE_LEASE_RENEW_S = 10.0
"""How often an agent renews its node lease: a quarter of the TTL, as the kubelet does."""
MIN_TIMEOUT_S = 6.0
"""Below this the lease TTL (a third, whole seconds, at least 2) no longer fits."""


class TimeoutConfigError(ValueError):
    """The one timeout is out of range; the message says which range."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    timeout_s: float
    """The one setting: the longest a hung or partitioned replica stalls the survivors."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.timeout_s) or self.timeout_s < MIN_TIMEOUT_S:
            raise TimeoutConfigError(
                f"timeout {self.timeout_s!r} s is too short: set FTSYSTEM_TIMEOUT_S / --timeout "
                f"to at least {MIN_TIMEOUT_S:g} s (the lease TTL is a third of it, at least 2 s)")

    @property
    def watchdog_s(self) -> float:
        """A rank without a heartbeat for this long is hung: its replica is restarted."""
        return self.timeout_s / 3

    @property
    def lease_ttl_s(self) -> int:
        """The replica's etcd lease: a host that stops renewing it is dropped after this."""
        return max(2, math.floor(self.timeout_s / 3))

    @property
    def collective_s(self) -> float:
        """Collectives, rendezvous and transfers give up after this (the backstop)."""
        return self.timeout_s


# --- stragglers: a bound from the observed step time -------------------------------------------

ENV_STRAGGLER_FACTOR = "FTSYSTEM_STRAGGLER_FACTOR"
ENV_STRAGGLER_FLOOR_S = "FTSYSTEM_STRAGGLER_FLOOR_S"
ENV_STRAGGLER_CEILING_S = "FTSYSTEM_STRAGGLER_CEILING_S"
ENV_STRAGGLER_SILENCE_S = "FTSYSTEM_STRAGGLER_SILENCE_S"
DEFAULT_STRAGGLER_FACTOR, DEFAULT_STRAGGLER_FLOOR_S = 4.0, 2.0
DEFAULT_STRAGGLER_SILENCE_S = MIN_STRAGGLER_SILENCE_S = 0.6
"""Three of the members' beats (``ftsystem.training.ftar.BEAT_S``, 0.2 s): a shorter silence
could fall between two beats of a live member."""


@dataclass(frozen=True, slots=True)
class StragglerBound:
    """How long a member waits at a step's all-reduce for a peer that has not arrived before it
    reports the peer late (the leader then takes it out of the epoch; it rejoins after its
    agent restarts it and it has caught up).

    The bound is ``factor`` times the median of the recent step times, kept between ``floor_s``
    (a step a few times slower than usual, a scheduling hiccup, must not cost a replica) and
    ``ceiling_s`` (by default the watchdog's third of the timeout: never later than a hung rank
    would be restarted anyway). Before any step time is known, it is the ceiling.
    """

    factor: float = DEFAULT_STRAGGLER_FACTOR
    floor_s: float = DEFAULT_STRAGGLER_FLOOR_S
    ceiling_s: float = Timeouts(30.0).watchdog_s
    silence_s: float = DEFAULT_STRAGGLER_SILENCE_S
    """A member whose beats stood still this long while another waited for it at the
    all-reduce is named at once, without waiting for the bound: dead, frozen or cut off (its
    beats come from a thread of their own, whatever its loop is doing)."""

    def __post_init__(self) -> None:
        if not (self.factor >= 1 and 0 < self.floor_s <= self.ceiling_s
                and MIN_STRAGGLER_SILENCE_S <= self.silence_s <= self.ceiling_s):
            raise TimeoutConfigError(
                f"straggler bound factor {self.factor:g}, floor {self.floor_s:g} s, ceiling "
                f"{self.ceiling_s:g} s, silence {self.silence_s:g} s: need factor >= 1, "
                f"0 < floor <= ceiling and {MIN_STRAGGLER_SILENCE_S:g} <= silence <= ceiling "
                f"(set {ENV_STRAGGLER_FACTOR}, "
                f"{ENV_STRAGGLER_FLOOR_S}, {ENV_STRAGGLER_CEILING_S}, {ENV_STRAGGLER_SILENCE_S})")

    def bound_s(self, step_times: Sequence[float]) -> float:
        if not step_times:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * statistics.median(step_times)))

    @classmethod
    def from_env(cls, env: Mapping[str, str], timeouts: Timeouts) -> "StragglerBound":
        """Defaults, overridden by the environment; the ceiling follows the one timeout."""
        try:
            ceiling = float(env.get(ENV_STRAGGLER_CEILING_S, timeouts.watchdog_s))
            # A floor set for all jobs may exceed the ceiling of one with a short timeout: the
            # ceiling wins there (never later than the watchdog would restart a hung rank).
            floor = min(float(env.get(ENV_STRAGGLER_FLOOR_S, DEFAULT_STRAGGLER_FLOOR_S)),
                        ceiling)
            silence = min(float(env.get(ENV_STRAGGLER_SILENCE_S, DEFAULT_STRAGGLER_SILENCE_S)),
                          ceiling)
            return cls(factor=float(env.get(ENV_STRAGGLER_FACTOR, DEFAULT_STRAGGLER_FACTOR)),
                       floor_s=floor, ceiling_s=ceiling, silence_s=silence)
        except ValueError as e:
            raise TimeoutConfigError(f"straggler bound: {e} (set {ENV_STRAGGLER_FACTOR}, "
                                     f"{ENV_STRAGGLER_FLOOR_S}, {ENV_STRAGGLER_CEILING_S}, "
                                     f"{ENV_STRAGGLER_SILENCE_S} to numbers)") from e
