"""Launching children that can never outlive the process that supervises them."""

from __future__ import annotations

import os


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that the kernel SIGKILLs it when its parent dies.

    ``setpriv --pdeathsig`` (util-linux) sets the signal in the child itself, so no Python runs
    between fork and exec: a ``preexec_fn`` would force a plain fork(), whose gRPC fork
    handlers abort the child when the parent's etcd client has threads running.
    """
    return ["setpriv", "--pdeathsig", "KILL", "--", *cmd]


def signal_group(pid: int, sig: int) -> None:
    """Signal a child that leads its own session, and so its descendants too."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass

