"""Chaos against what ``ftsystem run`` started: its controllers, etcd, and its hosts.

Replica actions are the agents' business; ``controller-kill`` and ``etcd-member-kill`` orders
target no replica, so the process that started the services executes them: it SIGKILLs the
leading controller (or the etcd member that leads the Raft group), keeps it down for the order's
duration, and starts it again as a Deployment or a StatefulSet would. Training must not notice
more than a short pause of membership changes.

Host orders hit one node of a replica as a machine fails: ``host-kill`` takes the node's link
down, then SIGKILLs every process in its network namespace at once, the agent included (nothing
is left to report it). A dead host sends nothing: no reset, no FIN, so its peers learn of its
death from silence, as they would from a machine that lost power or a NIC that failed; killing
the processes with the link up would close every socket and tell the peers at once. After the
order's duration the link comes back and the node's agent starts again, as a rebooted host
would. ``host-partition`` takes the node's link down for the duration while its processes live
on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import threading
import urllib.request
from typing import Callable

from ftsystem.control import keys
from ftsystem.chaos.spec import HOST_ACTIONS, SERVICE_ACTIONS, Order
from ftsystem.chaos.executor import ChaosActionError, OrderExecutor
from ftsystem.control.etcd_server import EmbeddedEtcd, EtcdCluster
from ftsystem.launch.netns import Host, namespace_pids
from ftsystem.launch.procs import kill_and_reap
from ftsystem.control.store import Store

log = logging.getLogger(__name__)


class ServiceChaos:
    """Executes service orders in a background thread while the job runs."""

    def __init__(self, etcd: str, job: str, cluster: EtcdCluster | None) -> None:
        self.etcd, self.job, self.cluster = etcd, job, cluster
        self.controllers: dict[str, tuple[Callable[[], subprocess.Popen], subprocess.Popen]] = {}
        self.nodes: dict[tuple[str, int], tuple[Host, Callable[[], None]]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None

    def add_controller(self, instance_id: str, start: Callable[[], subprocess.Popen]) -> None:
        """Register (and start) a controller instance; ``start`` is called again on restart."""
        self.controllers[instance_id] = (start, start())

    def add_node(self, replica_id: str, node_rank: int, host: Host,
                 restart: Callable[[], None]) -> None:
        """A node host orders may hit; ``restart`` starts its agent again after a host-kill."""
        self.nodes[(replica_id, node_rank)] = (host, restart)

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._main = self._loop.create_task(self._follow())
            ready.set()
            try:
                self._loop.run_until_complete(self._main)
            except asyncio.CancelledError:
                pass
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="service-chaos", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join(10)

    async def _follow(self) -> None:
        async with Store(self.etcd) as store:
            self._store = store
            executor = OrderExecutor(store, self.job, act=self._act,
                                     mine=lambda order: order.action in SERVICE_ACTIONS + HOST_ACTIONS)
            try:
                await executor.run()
            finally:
                await executor.stop()

    async def _act(self, order: Order) -> str:
        if order.action in HOST_ACTIONS:
            return await self._hit_host(order)
        if order.action == "controller-kill":
            return await self._kill_controller(order.duration_s)
        if order.action == "etcd-pause":
            return await self._pause_etcd(order.duration_s)
        return await self._kill_etcd_member(order.duration_s)

    async def _kill_controller(self, down_s: float) -> str:
        leader = (await self._store.get(keys.leader(self.job)) or b"").decode()
        if leader not in self.controllers:
            raise ChaosActionError(f"no controller of this run leads job {self.job} "
                                   f"(leader: {leader or 'none'})")
        start, proc = self.controllers[leader]
        kill_and_reap(proc)
        await asyncio.sleep(down_s)
        self.controllers[leader] = (start, start())
        return f"SIGKILL to leading controller {leader}; restarted after {down_s:g}s"

    async def _hit_host(self, order: Order) -> str:
        node = self.nodes.get((order.replica, order.node))
        if node is None:
            raise ChaosActionError(f"node {order.node} of replica {order.replica} is not a host "
                                   "of this run (host actions need ftsystem run --netns)")
        host, restart = node
        if order.action == "host-partition":
            await asyncio.to_thread(host.partition)
            await asyncio.sleep(order.duration_s)
            await asyncio.to_thread(host.heal)
            return f"host {host.name} cut off for {order.duration_s:g}s"
        await asyncio.to_thread(host.partition)  # first: the sockets' last words go nowhere
        pids = await asyncio.to_thread(namespace_pids, host.name)
        for pid in pids:  # one loop of kill(2): the processes die within microseconds
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await asyncio.sleep(order.duration_s)
        await asyncio.to_thread(host.heal)
        await asyncio.to_thread(restart)
        return f"link down, then SIGKILL to all {len(pids)} processes of host {host.name}; " \
               f"rebooted after {order.duration_s:g}s"

    async def _pause_etcd(self, pause_s: float) -> str:
        """A control-plane outage: every member stops (SIGSTOP) for ``pause_s``; clients' calls
        hang as on a dead network, and leases that lapse meanwhile expire all at once after."""
        if self.cluster is None:
            raise ChaosActionError("etcd-pause needs the embedded etcd of this run (no --etcd)")
        members = [m.process for m in self.cluster.members
                   if m.process is not None and m.process.poll() is None]
        for proc in members:
            proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(pause_s)
        finally:
            for proc in members:
                proc.send_signal(signal.SIGCONT)
        return f"SIGSTOP to {len(members)} etcd member(s) for {pause_s:g}s"

    async def _kill_etcd_member(self, down_s: float) -> str:
        if self.cluster is None or len(self.cluster.members) < 3:
            raise ChaosActionError("etcd-member-kill needs an etcd of at least 3 members "
                                   "started by this run (ftsystem run --etcd-members 3)")
        member = await asyncio.to_thread(_raft_leader, self.cluster)
        member.kill()
        await asyncio.sleep(down_s)
        await asyncio.to_thread(member.launch)  # its data directory rejoins it to the cluster
        return f"SIGKILL to etcd member {member.name} (Raft leader); restarted after {down_s:g}s"


def _raft_leader(cluster: EtcdCluster) -> EmbeddedEtcd:
    """The member leading the Raft group (the most disruptive to kill), else the first alive."""
    alive = [m for m in cluster.members if m.process is not None and m.process.poll() is None]
    if not alive:
        raise ChaosActionError("no etcd member of this run is alive")
    for member in alive:
        try:
            status = _status(member)
        except OSError:
            continue
        if status.get("leader") == status.get("header", {}).get("member_id"):
            return member
    return alive[0]


def _status(member: EmbeddedEtcd) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{member.port}/v3/maintenance/status",
                                     data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=2) as response:
        return json.loads(response.read())
