"""UDP pulses among the agents of one replica: how a dead or cut-off node is noticed in a second.

A host that dies takes its agent with it, and one whose link is cut cannot reach etcd: neither
reports anything, and a lease would only tell after its TTL. So the agents of a multi-node
replica pulse each other directly, in a star (node rank 0 and every other node, so traffic
grows with the nodes, not with their square), every ``PULSE_S``. A peer silent for the peer
timeout is dead or cut off: the agent that noticed ends the generation, and a node that hears
nobody fences itself (stops its ranks). Pulses need no etcd, so an etcd outage is not mistaken
for a dead host, and they carry the generation's end to every node even then.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PULSE_S = 0.2
RUNNING, DONE, ENDED = "run", "done", "ended"


@dataclass
class PeerView:
    """What this agent heard from its peers in the current generation (pure bookkeeping)."""

    generation: int
    peers: dict[str, int]
    """uid -> node rank of the peers this agent watches."""
    started: float
    last_heard: dict[str, float] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    ended_by: str = ""
    silent: int | None = None
    """The node rank found silent, once one was."""

    def hear(self, uid: str, generation: int, state: str, now: float) -> None:
        if generation != self.generation or uid not in self.peers:
            return
        self.last_heard[uid] = now
        if state == DONE:
            self.done.add(uid)
        elif state == ENDED:
            self.ended_by = uid

    def verdict(self, now: float, timeout_s: float, startup_s: float) -> str | None:
        """Why the generation is over from what was heard, or None while it runs. A peer not
        heard yet in this generation gets ``startup_s``: it may still be learning of it from
        etcd and launching its ranks."""
        if self.ended_by:
            return f"ended by node {self.peers[self.ended_by]}"
        for uid, rank in sorted(self.peers.items(), key=lambda p: p[1]):
            if uid in self.done:
                continue
            heard = uid in self.last_heard
            silent = now - self.last_heard.get(uid, self.started)
            if silent > (timeout_s if heard else startup_s):
                self.silent = rank
                return f"node {rank} silent for {silent:.1f}s (dead host or cut link)"
        return None


class _Receiver(asyncio.DatagramProtocol):
    def __init__(self, pulse: "Pulse") -> None:
        self.pulse = pulse

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        try:
            msg = json.loads(data)
            uid, generation, state = msg["uid"], int(msg["gen"]), msg["state"]
        except (ValueError, KeyError, TypeError):
            return  # not ours
        if self.pulse.view is not None:
            self.pulse.view.hear(uid, generation, state, time.monotonic())


class Pulse:
    def __init__(self, uid: str, host: str, timeout_s: float, startup_s: float) -> None:
        self.uid, self.host, self.timeout_s, self.startup_s = uid, host, timeout_s, startup_s
        self.view: PeerView | None = None
        self.state = RUNNING
        self._targets: list[tuple[str, int]] = []
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> str:
        """Listen; returns the host:port peers send to."""
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _Receiver(self), local_addr=(self.host, 0))
        return f"{self.host}:{self._transport.get_extra_info('sockname')[1]}"

    def follow(self, generation: int, node_rank: int, holders: dict[int, dict]) -> None:
        """Watch the peers of a new generation: node 0 watches all, the others node 0."""
        others = {rank: h for rank, h in holders.items() if rank != node_rank}
        watched = others if node_rank == 0 else {0: holders[0]}
        self.state = RUNNING
        self.view = PeerView(generation, {h["uid"]: r for r, h in watched.items()},
                             time.monotonic())
        self._targets = [_address(h["pulse_addr"]) for h in watched.values()]

    async def watch(self) -> str:
        """Pulse the peers until one falls silent or ends the generation; returns why."""
        while True:
            self._send()
            await asyncio.sleep(PULSE_S)
            reason = self.view.verdict(time.monotonic(), self.timeout_s, self.startup_s)
            if reason is not None:
                return reason

    def announce(self, state: str) -> None:
        """Tell the peers at once (and on every later pulse) that this node is done or has
        ended the generation."""
        self.state = state
        for _ in range(3):  # UDP: a lost datagram must not cost a peer its timeout
            self._send()

    def _send(self) -> None:
        if self._transport is None or self.view is None:
            return
        data = json.dumps({"uid": self.uid, "gen": self.view.generation,
                           "state": self.state}).encode()
        for target in self._targets:
            try:
                self._transport.sendto(data, target)
            except OSError:
                pass  # a cut link: the peer's silence is the signal

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)
