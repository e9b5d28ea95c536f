"""A load generator's bookkeeping of keep-alives, without I/O: when each lease's next one is
due, and what the replies say about the leases' safety margin. The caller passes the time."""

from __future__ import annotations

import heapq
import random

from ftsystem.benchmarks.controller.stats import summarize


class KeepAliveSchedule:
    """When each held lease's next keep-alive is due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._interval: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._interval)

    def add(self, lease: int, interval_s: float, first_s: float, now: float) -> None:
        """A lease held from ``now`` on: its first keep-alive ``first_s`` later."""
        self._interval[lease] = interval_s
        heapq.heappush(self._heap, (now + first_s, lease))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def remove(self, lease: int) -> None:
        self._interval.pop(lease, None)  # its heap entry is dropped when it falls due

    def due(self, now: float) -> tuple[list[int], float]:
        """The leases due by ``now`` (each rescheduled an interval on) and how late the most
        overdue one is: lateness is the load generator falling behind, not etcd."""
        leases, late = [], 0.0
        while self._heap and self._heap[0][0] <= now:
            at, lease = heapq.heappop(self._heap)
            interval = self._interval.get(lease)
            if interval is None:
                continue
            leases.append(lease)
            late = max(late, now - at)
            # A fixed cadence, unless more than an interval behind: then restart it from now.
            nxt = at + interval if at + interval > now else now + interval
            heapq.heappush(self._heap, (nxt, lease))
        return leases, late


class KeepAliveStats:
    """Keep-alives sent and answered; how long a lease went without a renewal (its safety
    margin: at TTL it expires)."""

    RTT_SAMPLES = 20_000
    """Round trips kept per window (a uniform sample of them): the report stays small."""

    def __init__(self) -> None:
        self.sent = self.replies = self.not_found = 0
        self.max_late_s = self.max_gap_s = 0.0
        self.rtts: list[float] = []
        self._rtts_seen = 0
        self._rng = random.Random(0)
        self._sent_at: dict[int, float] = {}
        self._renewed_at: dict[int, float] = {}

    def add(self, lease: int, now: float) -> None:
        self._renewed_at[lease] = now

    def remove(self, lease: int) -> None:
        self._sent_at.pop(lease, None)
        self._renewed_at.pop(lease, None)

    def on_sent(self, leases: list[int], now: float, late_s: float) -> None:
        self.sent += len(leases)
        self.max_late_s = max(self.max_late_s, late_s)
        for lease in leases:
            self._sent_at[lease] = now

    def on_reply(self, lease: int, ttl: int, now: float) -> None:
        self.replies += 1
        if ttl <= 0:  # revoked by the benchmark, and not yet dropped: not a renewal
            self.not_found += 1
            return
        sent = self._sent_at.get(lease)
        if sent is not None:
            self._sample_rtt(now - sent)
        last = self._renewed_at.get(lease)
        if last is not None:
            self.max_gap_s = max(self.max_gap_s, now - last)
            self._renewed_at[lease] = now

    def _sample_rtt(self, rtt: float) -> None:
        """Reservoir sampling: every round trip of the window equally likely to be kept."""
        self._rtts_seen += 1
        if len(self.rtts) < self.RTT_SAMPLES:
            self.rtts.append(rtt)
        else:
            slot = self._rng.randrange(self._rtts_seen)
            if slot < self.RTT_SAMPLES:
                self.rtts[slot] = rtt

    def snapshot(self, reset: bool) -> dict:
        """The counters; ``reset`` starts a new window of round trips and maxima."""
        rtt = summarize(self.rtts) if self.rtts else None
        out = {"sent": self.sent, "replies": self.replies, "not_found": self.not_found,
               "max_late_s": self.max_late_s, "max_gap_s": self.max_gap_s, "rtt_s": rtt,
               "rtt_samples": self.rtts if reset else []}
        if reset:
            self.rtts, self._rtts_seen = [], 0
            self.max_late_s = self.max_gap_s = 0.0
        return out
