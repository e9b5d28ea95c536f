"""Which address a process advertises to its peers when none is given.

A process listens on one address (``--bind``) and tells others another (``--advertise-address``):
in a container or a pod it listens on 0.0.0.0 and is reached at its pod IP. The default
advertised address works unchanged on Kubernetes (``POD_IP``, set from the downward API by our
manifests) and on Slurm or bare hosts (the address of the interface that holds the default
route, which other nodes of the cluster reach).
"""

from __future__ import annotations

import os
import socket
from typing import Mapping

ENV_ADVERTISE = "FTSYSTEM_ADVERTISE_ADDRESS"
ENV_POD_IP = "POD_IP"
"""Kubernetes' pod IP, as ``docker/k8s`` sets it from ``status.podIP``."""
_ROUTE_PROBE = ("192.0.2.1", 9)
"""TEST-NET-1 (RFC 5737): connecting a UDP socket there only picks a route; nothing is sent."""


def default_advertise_address(env: Mapping[str, str] = os.environ) -> str:
    """``FTSYSTEM_ADVERTISE_ADDRESS``, else ``POD_IP``, else the default route's local
    address, else the hostname's address, else loopback (a machine without a network)."""
    return env.get(ENV_ADVERTISE) or env.get(ENV_POD_IP) or _routable_address() or "127.0.0.1"


def _routable_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(_ROUTE_PROBE)
            return probe.getsockname()[0]
    except OSError:
        pass
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if address.startswith("127.") else address
