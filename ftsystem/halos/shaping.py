"""Bandwidth shaping of a HALoS run in real mode: the paper's links, scaled to this run, by ``tc``.

Every node (the GPS, each LPS, each worker) runs in its own network namespace
(``launch.netns.HostNetwork``). Each host shapes its own egress with an HTB qdisc: one class per
peer it talks to, picked by a u32 filter on the peer's address, at the rate of the link between
them (``RealConfig.bandwidth_bps``):

- a worker and its LPS: the bandwidth inside their region (the matrix's diagonal);
- LPS ``r`` and the GPS (in region ``gps_region``): ``bandwidth[gps_region][r]``.

Everything else (etcd, the launcher, unrelated pairs) goes to an unshaped default class. Both
directions of a link are shaped, each at its sender. No class is shared by two peers, so
concurrent transfers do not share a link, as in the simulator's time model.

The paper's bandwidths are scaled so that a transfer of our model takes the same share of a
worker's job as a transfer of Pythia-70M does in the paper (``scaled_bps``). netem is not used
(it is not available everywhere): rates only, no added latency, as the time model has none.

The decisions (which class, which rate, which commands) are pure functions; ``apply`` runs them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from ftsystem.halos.realconfig import GPS, RealConfig, lps_name, worker_name

MIN_RATE_BPS = 8_000
"""The floor of a scaled rate: HTB's rate tables lose precision below a few kbit/s."""
DEFAULT_RATE = "10gbit"
"""The default class's rate: traffic that is not between HALoS peers is not shaped."""
DEFAULT_CLASS = 1
FIRST_PEER_CLASS = 10
QUANTUM_BYTES = 1514
"""One full Ethernet frame: each class has a fixed rate (rate = ceil), so it never borrows and
the quantum only silences HTB's warning about small rates."""
MIN_BURST_BYTES = 3028
"""Two frames: the least a bucket may hold; above it a class may burst 1 ms of its rate."""


class ShapingError(RuntimeError):
    """A ``tc`` command failed; the message names it and the kernel's answer."""


def scaled_bps(paper_gbps: float, *, model_bytes: int, paper_model_bytes: int, step_s: float,
               paper_step_s: float) -> float:
    """The paper's link rate scaled to this run, in bit/s, at least ``MIN_RATE_BPS``.

    ``paper_bps * (model_bytes / paper_model_bytes) * (paper_step_s / step_s)``: a transfer of
    our model then lasts as many of our (emulated) local steps as a transfer of Pythia-70M
    lasts of the paper's, so it takes the same share of a worker's job and of an exchange.
    """
    if min(model_bytes, paper_model_bytes, step_s, paper_step_s, paper_gbps) <= 0:
        raise ValueError("scaling bandwidths needs model sizes, step times and rates > 0 "
                         "(an emulated step time: --step-time)")
    bps = paper_gbps * 1e9 * (model_bytes / paper_model_bytes) * (paper_step_s / step_s)
    return max(float(MIN_RATE_BPS), bps)


def scaled_bandwidths(bandwidth_gbps: list[list[float]], num_regions: int, **scale
                      ) -> list[list[float]]:
    """The first ``num_regions`` regions of the paper's matrix, each entry ``scaled_bps``."""
    if num_regions > len(bandwidth_gbps):
        raise ValueError(f"the setup's network has {len(bandwidth_gbps)} regions, not "
                         f"{num_regions}")
    return [[scaled_bps(g, **scale) for g in row[:num_regions]]
            for row in bandwidth_gbps[:num_regions]]


def node_region(cfg: RealConfig, name: str) -> int:
    """The region node ``name`` runs in (the GPS: ``gps_region``)."""
    if name == GPS:
        return cfg.gps_region
    if name.startswith("lps") and name[3:].isdigit():
        return int(name[3:])
    if name.startswith("w") and name[1:].isdigit():
        return cfg.worker_regions[int(name[1:])]
    raise ValueError(f"no HALoS node is called {name!r}")


def link_bps(cfg: RealConfig, a: str, b: str) -> float | None:
    """The rate between nodes ``a`` and ``b`` (symmetric), or None if they never talk."""
    pair = {a, b}
    for region in range(cfg.num_regions):
        lps = lps_name(region)
        if pair == {GPS, lps}:
            return cfg.bandwidth_bps[cfg.gps_region][region]
        workers = {worker_name(i) for i, r in enumerate(cfg.worker_regions) if r == region}
        if lps in pair and pair - {lps} <= workers and len(pair) == 2:
            return cfg.bandwidth_bps[region][region]
    return None


def egress_plan(cfg: RealConfig) -> dict[str, list[tuple[str, float]]]:
    """For each node, the peers it sends to and at what rate (bit/s), in node order."""
    if not cfg.bandwidth_bps:
        raise ValueError("the run has no bandwidths to shape (RealConfig.bandwidth_bps)")
    names = cfg.node_names()
    return {a: [(b, rate) for b in names if b != a and (rate := link_bps(cfg, a, b))]
            for a in names}


def tc_commands(iface: str, peers: list[tuple[str, float]]) -> list[list[str]]:
    """The ``tc`` arguments that shape ``iface``'s egress: one HTB class per (address, bit/s)
    peer, selected by destination, and an unshaped default class for everything else."""
    dev = ["dev", iface]
    commands = [
        ["qdisc", "replace", *dev, "root", "handle", "1:", "htb",
         "default", str(DEFAULT_CLASS)],
        ["class", "add", *dev, "parent", "1:", "classid", f"1:{DEFAULT_CLASS}", "htb",
         "rate", DEFAULT_RATE, "quantum", str(QUANTUM_BYTES)],
    ]
    for k, (address, bps) in enumerate(peers):
        classid, rate = f"1:{FIRST_PEER_CLASS + k}", f"{round(bps)}bit"
        burst = str(max(MIN_BURST_BYTES, round(bps / 8 / 1000)))
        commands.append(["class", "add", *dev, "parent", "1:", "classid", classid, "htb",
                         "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
                         "quantum", str(QUANTUM_BYTES)])
        commands.append(["filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1",
                         "u32", "match", "ip", "dst", f"{address}/32", "flowid", classid])
    return commands


def transfer_s(num_bytes: int, bps: float) -> float:
    """Seconds to send ``num_bytes`` at ``bps`` (what the shaping implies, no latency)."""
    return num_bytes * 8 / bps


@dataclass(frozen=True, slots=True)
class ShapedLink:
    """One shaped direction of a link, as reported in a run's summary."""

    sender: str
    receiver: str
    bps: float
    model_transfer_s: float
    """Seconds a transfer of the model's fp32 bytes takes at ``bps``."""


def describe(cfg: RealConfig, model_bytes: int) -> list[ShapedLink]:
    """Every shaped direction of the run's links, with a model transfer's time on it."""
    return [ShapedLink(a, b, bps, round(transfer_s(model_bytes, bps), 6))
            for a, peers in egress_plan(cfg).items() for b, bps in peers]


# --- I/O -------------------------------------------------------------------------------------

def unsupported() -> str | None:
    """None when namespaces and HTB shaping work here, else why not (for an error or a skip)."""
    from ftsystem.launch.netns import netns_supported

    if (why := netns_supported()) is not None:
        return why
    if shutil.which("tc") is None:
        return "`tc` (iproute2) is not installed"
    probe = f"ftshape{os.getpid()}"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    try:
        _tc(probe, ["qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb"])
    except ShapingError as e:
        return f"cannot shape with tc htb (kernel module sch_htb?): {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def apply(namespace: str, iface: str, peers: list[tuple[str, float]]) -> None:
    """Shape ``iface`` of network namespace ``namespace`` as ``tc_commands`` says."""
    # Without segmentation offload: HTB charges a 64 KB GSO packet at once, so a transfer of a
    # few such packets would finish up to one packet's time early.
    cmd = ["ip", "-n", namespace, "link", "set", "dev", iface, "gso_max_size", "1500"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ShapingError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    for args in tc_commands(iface, peers):
        _tc(namespace, args)


def class_bytes(namespace: str, iface: str) -> dict[str, int]:
    """Bytes each HTB class of ``iface`` has sent so far (``1:10`` -> bytes)."""
    out = _tc(namespace, ["-s", "class", "show", "dev", iface])
    sent, current = {}, None
    for line in out.splitlines():
        words = line.split()
        if words[:2] == ["class", "htb"]:
            current = words[2]
        elif words[:1] == ["Sent"] and current is not None:
            sent[current] = int(words[1])
            current = None
    return sent


def _tc(namespace: str, args: list[str]) -> str:
    cmd = ["tc", "-n", namespace, *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ShapingError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout
