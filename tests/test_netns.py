"""Names of emulated host networks, and networks made one after the other in one process."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftsystem.launch.netns import (
    MAX_NAME,
    HostNetwork,
    netns_supported,
    network_name,
    unique_network_name,
)

PIDS = st.integers(min_value=1, max_value=4_194_304)  # Linux's largest pid_max
NETNS = netns_supported()  # None, or why namespaces cannot be made here


@given(PIDS, PIDS, st.integers(0, 35), st.integers(0, 35))
def test_names_differ_between_processes_and_runs(pid_a: int, pid_b: int, run_a: int,
                                                 run_b: int) -> None:
    a, b = network_name("ra", pid_a, run_a), network_name("ra", pid_b, run_b)
    assert (a == b) == ((pid_a, run_a) == (pid_b, run_b)), (a, b)


@given(PIDS, st.integers(min_value=0))
def test_every_interface_name_fits_linux(pid: int, run: int) -> None:
    name = network_name("ra", pid, run)
    assert name.startswith("ra") and len(name) <= MAX_NAME
    longest = f"{name}-v9999p"  # a veth's root end before its peer moves into the namespace
    assert len(longest.encode()) <= 15, longest


def test_a_prefix_too_long_for_the_pid_is_refused() -> None:
    with pytest.raises(ValueError, match="shorten the prefix 'restart'"):
        network_name("restart", 4_194_304, 0)


def test_consecutive_names_of_one_process_differ() -> None:
    names = [unique_network_name("ra") for _ in range(36)]
    assert len(set(names)) == len(names), names


def _interfaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f": {prefix}-" in line]


@pytest.mark.skipif(NETNS is not None, reason=str(NETNS))
def test_a_network_can_follow_its_namesake_at_once() -> None:
    """A deleted namespace's veth pair lingers in the kernel; destroy() waits until it is gone.

    The same name each time: the worst case (a crashed run's leftovers under the next run's name).
    A process left in a host is killed with it.
    """
    name = unique_network_name("t")
    for _ in range(5):  # a veth left lingering fails one of five rounds with "File exists"
        with HostNetwork(3, name=name) as net:
            left = subprocess.Popen(net.hosts[0].wrap(["sleep", "60"]))
            assert len(_interfaces(name)) == 4  # the bridge and three root ends
        assert _interfaces(name) == []
        assert left.wait(timeout=10) == -9


@pytest.mark.skipif(NETNS is not None, reason=str(NETNS))
def test_two_runs_of_one_process_get_networks_of_their_own() -> None:
    with HostNetwork(2, name=unique_network_name("t")) as first:
        with HostNetwork(2, name=unique_network_name("t")) as second:
            assert first.bridge != second.bridge
            assert {h.name for h in first.hosts}.isdisjoint(h.name for h in second.hosts)
