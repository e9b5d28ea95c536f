"""Hosts emulated with Linux network namespaces, so that a partition can be real.

``HostNetwork(n)`` makes a bridge in the root namespace and ``n`` namespaces, each joined to the
bridge by a veth pair; every namespace is one "host" with its own address. Services that the
hosts must reach (etcd, a rendezvous) listen on the bridge's address. ``Host.partition()`` takes
the host's link down: packets are dropped without a TCP reset, so peers see what a cut cable or
a dead switch gives them (silence until a timeout), not a refused connection.

Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2). ``netns_supported()`` says why not when not.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import signal
import subprocess
import time
import zlib
from dataclasses import dataclass, field

IFACE = "eth0"
"""The host's interface inside its namespace (the same name on every host)."""
ENV_NETNS = "FTSYSTEM_NETNS"
"""Set to the namespace's name for programs started inside a host (the agent reads it)."""
MAX_NAME = 8
"""Longest network name: ``<name>-v<host>p`` must fit Linux's 15-byte interface names."""
LINKS_GONE_TIMEOUT_S = 10.0
"""How long ``HostNetwork.destroy()`` waits for the kernel to free its interfaces' names."""

_networks = itertools.count()


class NetnsError(RuntimeError):
    """A namespace operation failed; the message names the command and the kernel's answer."""


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def netns_supported() -> str | None:
    """None when namespaces can be made here, else the reason (for a skip or an error)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"ftprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (NetnsError, FileNotFoundError) as e:
        return f"cannot create a network namespace: {e}"
    return None


def namespace_pids(name: str) -> list[int]:
    """Every process running in network namespace ``name``."""
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def network_name(prefix: str, pid: int, serial: int) -> str:
    """``prefix``, ``pid`` in base 36 and ``serial`` modulo 36: distinct for distinct pids and for
    36 consecutive serials of one pid, and at most ``MAX_NAME`` characters for a prefix of two."""
    name = f"{prefix}{_base36(pid)}{_base36(serial % 36)}"
    if len(name) > MAX_NAME:
        raise ValueError(f"network name {name!r} is longer than {MAX_NAME} characters: "
                         f"shorten the prefix {prefix!r}")
    return name


def unique_network_name(prefix: str) -> str:
    """A name for a new ``HostNetwork`` of this process, never the name of its previous one.

    A network removes its namesakes' leftovers on entry, and a deleted namespace's veth pair can
    outlive it for a while: with a name per run, a run neither kills another process's hosts nor
    waits for the interfaces of the run before it.
    """
    return network_name(prefix, os.getpid(), next(_networks))


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = digits[n % 36]
    while n := n // 36:
        out = digits[n % 36] + out
    return out


def _interfaces() -> list[str]:
    """The names of the interfaces in this process's namespace."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    # "226: ft-v1@if225: <BROADCAST,..." (a veth's name carries its peer's index after "@")
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.count(":") >= 2]


def default_subnet(name: str) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 derived from the network's name, so two networks rarely collide."""
    digest = zlib.crc32(name.encode())
    return ipaddress.IPv4Network(f"10.{100 + digest % 100}.{(digest >> 8) % 256}.0/24")


def set_link(up: bool, iface: str = IFACE) -> None:
    """Bring this process's own namespace link up or down (used by an agent inside a host)."""
    _ip("link", "set", "dev", iface, "up" if up else "down")


@dataclass
class Host:
    """One emulated host: a namespace with one link to the bridge."""

    name: str
    """The namespace's name (``ip netns``)."""
    address: str
    """Its IPv4 address on the bridge's subnet."""
    gateway: str
    """The root namespace's address on the bridge: services the host uses listen there."""

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside this host, with ``FTSYSTEM_NETNS`` telling it where it runs."""
        # Gloo picks its interface from the hostname, which resolves to loopback here: name it.
        return ["ip", "netns", "exec", self.name, "env", f"{ENV_NETNS}={self.name}",
                f"GLOO_SOCKET_IFNAME={IFACE}", *cmd]

    def partition(self) -> None:
        """Cut the host off: its link goes down, traffic is dropped without a reset."""
        _ip("link", "set", "dev", IFACE, "down", netns=self.name)

    def heal(self) -> None:
        _ip("link", "set", "dev", IFACE, "up", netns=self.name)


@dataclass
class HostNetwork:
    """A bridge and ``num_hosts`` namespaces on it; removed again on exit."""

    num_hosts: int
    name: str = "ft"
    """Prefix of every interface and namespace (keep it short: names are capped at 15 bytes)."""
    subnet: ipaddress.IPv4Network | None = None
    hosts: list[Host] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if len(self.name) > MAX_NAME:
            raise ValueError(f"network name {self.name!r} is longer than {MAX_NAME} characters "
                             "(interface names are capped at 15 bytes)")
        self.subnet = self.subnet or default_subnet(self.name)
        if self.num_hosts + 2 > self.subnet.num_addresses:
            raise ValueError(f"{self.num_hosts} hosts do not fit in {self.subnet}")

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the bridge: services for the hosts listen here."""
        return str(self.subnet.network_address + 1)

    def __enter__(self) -> "HostNetwork":
        self.destroy()  # what a previous run killed before cleaning up left behind
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _create(self) -> None:
        prefix = self.subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/{prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.num_hosts):
            host = Host(f"{self.name}-h{i}", str(self.subnet.network_address + 2 + i),
                        self.bridge_address)
            self._add_host(host, root_end=f"{self.name}-v{i}", prefix=prefix)
            self.hosts.append(host)

    def _add_host(self, host: Host, *, root_end: str, prefix: int) -> None:
        _ip("netns", "add", host.name)
        _ip("link", "add", root_end, "type", "veth", "peer", "name", f"{root_end}p")
        _ip("link", "set", f"{root_end}p", "netns", host.name)
        _ip("link", "set", f"{root_end}p", "name", IFACE, netns=host.name)
        _ip("addr", "add", f"{host.address}/{prefix}", "dev", IFACE, netns=host.name)
        _ip("link", "set", IFACE, "up", netns=host.name)
        _ip("link", "set", "lo", "up", netns=host.name)
        _ip("link", "set", root_end, "master", self.bridge)
        _ip("link", "set", root_end, "up")

    def destroy(self) -> None:
        """Remove the namespaces, their veth pairs and the bridge, and wait until the kernel has
        freed the interfaces' names (a network of the same name can be made right after)."""
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in existing.splitlines():
            ns = line.split()[0] if line.split() else ""
            if ns.startswith(f"{self.name}-h"):
                # A namespace outlives its name while a process is in it, and keeps its veth
                # (whose name the next network of this name needs): nothing may stay behind.
                for pid in namespace_pids(ns):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # The kernel frees a deleted namespace's veth pair later, on its own: delete the root
        # ends now (which deletes their peers too); one already on its way out refuses.
        for link in self._links():
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self.hosts.clear()
        deadline = time.monotonic() + LINKS_GONE_TIMEOUT_S
        while (left := self._links()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            raise NetnsError(f"interfaces {', '.join(left)} still exist "
                             f"{LINKS_GONE_TIMEOUT_S:.0f} s after their deletion; remove them "
                             f"with `ip link del NAME` before making network {self.name!r} again")

    def _links(self) -> list[str]:
        """This network's interfaces in the root namespace: the bridge and the veths' root ends."""
        return [link for link in _interfaces() if link.startswith(f"{self.name}-")]
