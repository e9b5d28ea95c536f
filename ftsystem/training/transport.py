"""How a joiner receives a donor's state: the interface, whatever carries the bytes.

Non-blocking catch-up: every replica can donate a snapshot of its state, taken between two
commits (``ftsystem.training.snapshot``), and the log of the updates it committed since
(``ftsystem.training.update_log``). A joiner loads the snapshot, then replays the log
(``LocalState.replay``) until it is a step or two behind, while the others train
(``ftsystem.training.joiner``). It does so through a :class:`StateTransport`;
``ftsystem.training.http_transport`` is the one over HTTP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ftsystem.training.update_log import LoggedUpdate


class DonorUnavailableError(RuntimeError):
    """The donor did not answer, or no longer has what the joiner needs."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A donor's state as a joiner received it."""

    step: int
    state: dict
    nbytes: int
    transfer_s: float
    """From the donor's first byte to its last: the wire, not the wait for a snapshot."""

    def stats(self) -> dict:
        """What a joiner reports of it (``catchup`` in its result)."""
        return {"snapshot_step": self.step, "snapshot_bytes": self.nbytes,
                "transfer_s": self.transfer_s,
                "transfer_bytes_per_s": self.nbytes / self.transfer_s if self.transfer_s else None}


Progress = Callable[[int, int], None]
"""Called as bytes arrive: (received so far, total)."""


Destinations = Callable[[dict[tuple, torch.Tensor]], dict[tuple, torch.Tensor]]
"""Given the donor's layout (meta tensors by place), the tensors to receive a state into."""


class StateTransport(ABC):
    """The joiner's side of a state transfer, from one rank of a donor to the same rank here.

    ``donor_addr`` is where that donor rank serves, as the donor registered it (an entry of
    its ``state_addr``). The transport holds what every request needs (timeouts, credentials)
    and bounds every wait. Each method raises :class:`DonorUnavailableError` when the donor
    does not answer, refuses, or fails mid-transfer: the joiner then asks for another donor.
    """

    @abstractmethod
    def fetch_snapshot(self, donor_addr: str, at_step: int | None = None, *,
                       into: Destinations | None = None,
                       on_progress: Progress | None = None) -> Snapshot:
        """The donor's state right after its next commit, or after committing ``at_step``
        (still to come: the ranks of a joiner agree on one step; a step already committed
        is refused).

        The snapshot lands in given tensors: ``into`` is called once, while the donor waits
        for its commit, with the donor's layout (meta tensors by place,
        ``wire.tensor_places``; ``{}`` when it has none yet), and the tensors it returns
        receive the snapshot's where their shape and dtype fit (``wire.decode_state``), their
        contents overwritten even if the transfer fails. What does not fit, or everything
        without ``into``, arrives in tensors allocated for it. ``on_progress`` follows the
        bytes."""

    @abstractmethod
    def fetch_log(self, donor_addr: str, after: int
                  ) -> tuple[list[tuple[int, LoggedUpdate]], int, int] | None:
        """The donor's logged updates of the steps after ``after`` (step, update; oldest
        first), its head step and the bytes moved; None when its log no longer reaches back
        to step ``after + 1`` (the joiner then needs a newer snapshot)."""

    @abstractmethod
    def fetch_head(self, donor_addr: str) -> int:
        """The donor's committed step."""
