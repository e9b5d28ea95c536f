"""Who may read a donor's state: replicas proven by their token that are members or its joiners.

A replica's state server (``ftsystem.training.http_transport.StateServer``) hands out its
weights and optimizer state. Every request names the fetching replica (``X-Ftsystem-Replica``)
and carries that replica's own token (``Authorization: Bearer``; 401 otherwise): HMAC of the
replica id under the state servers' key, which the agents derive from the job's token and hand
to their ranks (``ftsystem.control.tokens``). So a holder of one replica's token cannot fetch
as another, and no rank holds the job's token itself. A snapshot or the update log goes only to
a replica that is a member of the current epoch or that the leader assigned to this donor
(``catchup/<rid>``); anyone else gets 403. ``/status`` (steps and byte counts) needs a valid
token only.

The check is cheap: the epoch is the one the replica's control plane already follows; the
assignment is read from etcd only for a fetcher that is not a member, and a grant is then
remembered while the joiner keeps asking (at most ``GRANT_TTL_S`` apart). That also serves a
joiner that registered ``ready`` and replays the log while it waits for its join epoch: the
leader deletes its assignment then, a moment before the epoch lists it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, NamedTuple

from ftsystem.control import keys
from ftsystem.control.tokens import (ENV_TOKEN, ENV_TOKEN_FILE, bearer_header, bearer_matches,
                                     replica_token)
from ftsystem.training.runtime import ENV_STATE_KEY, ControlPlane, ReplicaContext

log = logging.getLogger(__name__)
HEADER_REPLICA = "X-Ftsystem-Replica"
"""The fetching replica's id: its token must be that replica's, and the server checks it
against the epoch and the assignments."""
GRANT_TTL_S = 1.0
"""A joiner found assigned to this donor is served without reading etcd again as long as its
requests come at most this far apart."""


class StateAccessError(RuntimeError):
    """A rank has no token and its agent was not started with ``--insecure``."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a fetch sends: who is asking and that replica's token (empty under
    ``--insecure``)."""

    replica_id: str
    token: str = field(default="", repr=False)

    @classmethod
    def of(cls, replica_id: str, key: str) -> "Credentials":
        """Replica ``replica_id``'s, with its token under the state servers' ``key`` (none
        without a key)."""
        return cls(replica_id, replica_token(key, replica_id) if key else "")

    def headers(self) -> dict[str, str]:
        auth = {"Authorization": bearer_header(self.token)} if self.token else {}
        return auth | {HEADER_REPLICA: self.replica_id}


class Refusal(NamedTuple):
    status: int
    message: str


class StateAccess:
    """The state server's gate: :meth:`authenticate` every request, :meth:`authorize` those
    for state."""

    def __init__(self, *, key: str | None, donor: str,
                 epoch: Callable[[], tuple[int, Collection[str]]],
                 assigned_donor: Callable[[str], str | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``key``: the state servers' key, which makes each replica's token; None: serve
        without tokens (``--insecure``). ``epoch()``: the current epoch's number and members
        (-1 and none before the first); ``assigned_donor(rid)``: the donor the leader assigned
        to ``rid``, or None."""
        self._key = key or None
        self._donor, self._epoch, self._assigned_donor = donor, epoch, assigned_donor
        self._clock = clock
        self._granted: dict[str, float] = {}  # joiner -> until when
        self._lock = threading.Lock()

    def authenticate(self, headers: Mapping[str, str]) -> Refusal | None:
        """Whether the request carries the token of the replica it names."""
        if self._key is None:
            return None
        fetcher = headers.get(HEADER_REPLICA) or ""
        if fetcher and bearer_matches(headers.get("Authorization") or "",
                                      replica_token(self._key, fetcher).encode()):
            return None
        return Refusal(401, f"missing or wrong replica token: name the fetching replica in "
                            f"{HEADER_REPLICA} and send 'Authorization: Bearer <its token>', "
                            f"made from the key its agent hands it ({ENV_STATE_KEY})")

    def authorize(self, headers: Mapping[str, str]) -> Refusal | None:
        fetcher = headers.get(HEADER_REPLICA) or ""
        if not fetcher:
            return Refusal(403, f"name the fetching replica in {HEADER_REPLICA}")
        number, members = self._epoch()
        if fetcher in members or self._still_granted(fetcher):
            return None
        try:
            assigned = self._assigned_donor(fetcher)
        except Exception as e:  # etcd unreachable past the timeout: nobody can be checked
            return Refusal(503, f"cannot read the catch-up assignment of {fetcher}: {e}")
        if assigned == self._donor:
            with self._lock:
                self._granted[fetcher] = self._clock() + GRANT_TTL_S
            return None
        return Refusal(403, f"replica {fetcher} is neither a member of epoch {number} nor "
                            f"assigned to catch up from {self._donor}")

    def are_members(self, replicas: Collection[str]) -> bool:
        """Whether every one of ``replicas`` is a member of the current epoch."""
        _, members = self._epoch()
        return all(replica in members for replica in replicas)

    def _still_granted(self, fetcher: str) -> bool:
        now = self._clock()
        with self._lock:
            if self._granted.get(fetcher, 0.0) <= now:
                self._granted.pop(fetcher, None)
                return False
            self._granted[fetcher] = now + GRANT_TTL_S  # an active session stays granted
            return True


def replica_access(ctx: ReplicaContext, control: ControlPlane) -> tuple[StateAccess, Credentials]:
    """The gate of this rank's state server and the credentials of its own fetches, from what
    the agent handed down. Closed by default: without a key it starts only under an agent
    started with ``--insecure``."""
    if not ctx.state_key and not ctx.insecure:
        raise StateAccessError(
            f"no state key: {ENV_STATE_KEY} is not set, and this replica's state server would "
            "hand its weights and optimizer state to anyone who reaches it. Run it under "
            f"`ftsystem agent` with {ENV_TOKEN} (or {ENV_TOKEN_FILE} naming a file that holds "
            "it) set to the job's token, from which the agent derives the key, or start the "
            "agent with --insecure")

    def epoch() -> tuple[int, Collection[str]]:
        current = control.epoch
        return (current.number, current.members) if current else (-1, ())

    def assigned_donor(replica_id: str) -> str | None:
        try:
            key = keys.catchup(ctx.job, replica_id)
        except ValueError:  # not a replica id: nobody assigned it
            return None
        assignment = control.get_json(key)
        return assignment.get("donor") if isinstance(assignment, dict) else None

    access = StateAccess(key=ctx.state_key or None, donor=ctx.replica_id, epoch=epoch,
                         assigned_donor=assigned_donor)
    return access, Credentials.of(ctx.replica_id, ctx.state_key)
