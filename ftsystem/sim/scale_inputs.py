"""ftsystem's recovery costs at 1K..200K GPUs, from inputs that hold at that scale.

A benchmark on this machine measures a job of a few replicas on loopback. What of it carries to
98,304 GPUs, and what must come from elsewhere, is decided here, one named input at a time, each
labelled with where it comes from (``MEASURED``, ``PUBLISHED``, ``MODEL``, ``ASSUMED``) and with a
range of plausible values for the sensitivity table (docs/ettr_simulation.md):

- the survivors' stall after a host dies (measured here: ``bench failover --scenario host``);
- the controller's decision at the job's node count (measured here: ``bench controller --nodes``);
- the time to create NCCL communicators of a given size (a straight line through two published
  figures, ``nccl_init_s``);
- the wait for a replacement host (assumed), and the time a relaunched replica takes from process
  start to its first commit (measured here: ``bench rejoin``);
- the survivors' stall while a recovered replica joins (measured here: ``bench rejoin``).

Everything here is arithmetic without I/O; the command reads the benchmark files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ftsystem.sim import ettr

MEASURED = "measured-here"
PUBLISHED = "published"
MODEL = "model"
ASSUMED = "assumed"
KINDS = (MEASURED, PUBLISHED, MODEL, ASSUMED)

DEFAULT_TIMEOUT_S = 30.0
"""ftsystem's default ``--timeout`` (``ftsystem.training.runtime.DEFAULT_TIMEOUT_S``, which is not imported
here: it pulls in the etcd client): the fallback for the host stall."""
GPUS_PER_HOST = 8
"""H100/H200 hosts, as in the paper's clusters: a job of 98,304 GPUs runs 12,288 node agents."""

NCCL_INIT_SMALL = (16, 1.08)
"""(ranks, seconds): NCCL's own "Init timings" line for a 16-rank communicator over InfiniBand,
total 1.08 s, of which kernel loading 0.51 s, bootstrap 0.22 s, topology 0.28 s
(github.com/NVIDIA/nccl/issues/1412)."""
NCCL_INIT_LARGE = (98_304, 265.0)
"""(ranks, seconds): stock NCCL's initialisation at 96K GPUs, about 265 s (Si et al.,
"Collective Communication for 100k+ GPUs", arXiv 2510.20171, Meta, the NCCLX paper, as
summarised from its text; NCCLX itself starts 11x faster). Meta reported 2.5 minutes "above
certain K GPUs" on the default init path, at launch and at restarts after a GPU failure
(github.com/NVIDIA/nccl/issues/1156): the same order."""
NCCLX_SPEEDUP = 11.0
"""NCCLX's startup against stock NCCL at Meta's scale (arXiv 2510.20171): the low end of the
communicator-init sweeps."""
HOST_WAIT_S = ettr.SYNC_RESTART_S - NCCL_INIT_LARGE[1]
"""Assumed wait until a replacement host runs the failed replica's processes: the part of the
paper's 10-minute restart at 98K that is not communicator initialisation (600 - 265 = 335 s):
scheduling, host health checks, container and process start. It still holds the checkpoint load,
which ``time_to_join_s`` counts again: conservative."""
HOST_WAIT_SWEEP_S = (0.0, 60.0, HOST_WAIT_S, ettr.SYNC_RESTART_S)
"""A hot spare with its agent running; a warm spare; the base; the paper's whole restart."""


def nccl_init_s(ranks: int) -> float:
    """Seconds to create one NCCL communicator of ``ranks`` ranks: the straight line through
    ``NCCL_INIT_SMALL`` and ``NCCL_INIT_LARGE``. NCCLX reports that stock NCCL's bootstrap and
    connection setup grow super-linearly with the rank count; a convex curve lies below its chord,
    so between the two published points the line is an upper bound. Below the small point it
    stays at the small figure (fixed costs dominate). Communicators created in parallel (one per
    position in a replica) take the time of one."""
    if ranks < 1:
        raise ValueError(f"a communicator needs at least one rank, got {ranks}")
    (n0, t0), (n1, t1) = NCCL_INIT_SMALL, NCCL_INIT_LARGE
    return t0 + (max(ranks, n0) - n0) * (t1 - t0) / (n1 - n0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Input:
    """One number the prediction rests on, and where it comes from."""

    value_s: float
    """Base value, seconds."""
    kind: str
    """One of KINDS."""
    source: str
    """Where the value comes from: a file and field, a publication, or the reason for a guess."""
    sweep_s: tuple[float, ...] = ()
    """Plausible values for the sensitivity table (the base is added to them)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not all(v >= 0 for v in (self.value_s, *self.sweep_s)):
            raise ValueError(f"seconds must be non-negative: {self.value_s}, {self.sweep_s}")

    def points(self) -> tuple[float, ...]:
        """The sweep with the base value, ascending, without repeats."""
        return tuple(sorted({*self.sweep_s, self.value_s}))


@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence:
    """The figures the benchmark files hold (or their fallbacks), before scaling."""

    host_stall: Input
    """Survivors' stall after a whole host dies, detection and reconfiguration included."""
    decision: Input
    """The controller's decision (failure seen to epoch published), at ``decision_nodes``."""
    decision_nodes: int | None
    """How many node agents the decision was measured with; None: not measured, not scaled."""
    time_to_join: Input
    """A relaunched replica, from process start to its first commit: imports, model build,
    catch-up."""
    join_stall: Input
    """Survivors' stall while a recovered replica joins."""


def host_stall_input(layouts: dict[int, dict[str, float]] | None, source: str, *,
                     timeout_s: float) -> Input:
    """The survivors' stall after a host dies, from ``{nodes per replica: {"median", "max"}}``.

    The base is the largest median over the layouts: a replica of several nodes is what runs at
    scale, and its nodes notice a dead peer by UDP pulses, which need no closed connection (a
    host that loses power sends none). Without the benchmark: the timeout, which bounds every
    detection path. The sweep runs to the lease TTL (a third of the timeout: a silent host no
    pulse catches) and the timeout."""
    bounds = (timeout_s / 3, timeout_s)
    if not layouts:
        return Input(value_s=timeout_s, kind=ASSUMED, sweep_s=bounds,
                     source=f"assumed (no host failover benchmark): the timeout, {timeout_s:g} s, "
                            "bounds detection")
    medians = {n: s["median"] for n, s in layouts.items()}
    nodes = max(medians, key=medians.get)
    described = ", ".join(f"{n} node(s) per replica: median {s['median']:.2f} s, max "
                          f"{s['max']:.2f} s" for n, s in sorted(layouts.items()))
    return Input(value_s=medians[nodes], kind=MEASURED,
                 sweep_s=(min(medians.values()), max(s["max"] for s in layouts.values()), *bounds),
                 source=f"{source}: the largest median of the layouts ({described})")


def decision_input(p50_s: float | None, p99_s: float | None, source: str) -> Input:
    """The controller's decision: the p99 (the slower kind of failure), swept from its p50 to a
    second (an etcd under load)."""
    if p99_s is None:
        return Input(value_s=1.0, kind=ASSUMED, sweep_s=(0.05, 5.0),
                     source="assumed (no controller benchmark at scale): 1 s")
    return Input(value_s=p99_s, kind=MEASURED, sweep_s=(p50_s or p99_s, 0.2, 1.0),
                 source=source)


def time_to_join_input(value_s: float | None, source: str) -> Input:
    """A relaunched replica's time from process start to its first commit; swept to 4x (more
    state per rank, slower storage)."""
    if value_s is None:
        return Input(value_s=60.0, kind=ASSUMED, sweep_s=(15.0, 240.0),
                     source="assumed (no rejoin benchmark): 60 s")
    return Input(value_s=value_s, kind=MEASURED, sweep_s=(value_s / 2, 2 * value_s,
                                                          4 * value_s), source=source)


def join_stall_input(value_s: float | None, source: str) -> Input:
    """The survivors' stall while a replica joins; swept from none (a join fully overlapped)
    to 4x."""
    if value_s is None:
        return Input(value_s=1.0, kind=ASSUMED, sweep_s=(0.0, 10.0),
                     source="assumed (no rejoin benchmark): one reconfiguration, 1 s")
    return Input(value_s=value_s, kind=MEASURED, sweep_s=(0.0, 2 * value_s, 4 * value_s),
                 source=source)


def replica_layout(gpus: int) -> tuple[int, int]:
    """(replicas, GPUs per replica) of a job of ``gpus``, as the simulation lays it out."""
    replicas = ettr.num_replicas(gpus, ettr.REPLICA_GPUS)
    return replicas, gpus // replicas


def components(evidence: Evidence, gpus: int) -> dict[str, Input]:
    """Every input of ftsystem's recovery at a job of ``gpus``, by name, with its provenance.

    Two scale with the job: the controller's decision, linearly in the node count above the count
    it was measured at (the leader's work per decision grows at most with the membership); and
    the NCCL communicators, from ``nccl_init_s``. After a failure the survivors rebuild the
    communicators across replicas (one per position in a replica, one rank per replica, all in
    parallel); a relaunched replica creates its own, across its GPUs, before it starts."""
    replicas, replica_gpus = replica_layout(gpus)
    hosts = gpus // GPUS_PER_HOST
    factor = max(1.0, hosts / (evidence.decision_nodes or hosts))
    decision = evidence.decision
    reinit, replica_init, job_init = (nccl_init_s(n) for n in (replicas, replica_gpus, gpus))
    nccl = (f"{MODEL}: line through {NCCL_INIT_SMALL[1]} s at {NCCL_INIT_SMALL[0]} ranks "
            f"(NVIDIA/nccl#1412) and {NCCL_INIT_LARGE[1]:g} s at {NCCL_INIT_LARGE[0]:,} "
            "(arXiv 2510.20171)")
    return {
        "host_stall_s": evidence.host_stall,
        "decision_s": replace(
            decision, value_s=decision.value_s * factor,
            sweep_s=tuple(v * factor for v in decision.sweep_s),
            source=decision.source + (f"; x{factor:.2f} for {hosts:,} hosts against "
                                      f"{evidence.decision_nodes:,} measured (linear)"
                                      if factor > 1 else f"; {hosts:,} hosts")),
        "nccl_reinit_s": Input(
            value_s=reinit, kind=MODEL, sweep_s=(0.0, reinit / NCCLX_SPEEDUP, replica_init),
            source=f"{nccl}: {replicas} ranks (one per replica); sweep: none (communicators "
                   f"built ahead), NCCLX's 11x, a replica-wide rebuild ({replica_gpus:,} ranks)"),
        "host_wait_s": Input(
            value_s=HOST_WAIT_S, kind=ASSUMED, sweep_s=HOST_WAIT_SWEEP_S,
            source=f"{ASSUMED}: the paper's {ettr.SYNC_RESTART_S:g} s restart less stock NCCL's "
                   f"{NCCL_INIT_LARGE[1]:g} s init at 96K (scheduling, health checks, process "
                   "start); sweep: hot spare, warm spare, base, the paper's whole restart"),
        "replica_nccl_init_s": Input(
            value_s=replica_init, kind=MODEL,
            sweep_s=(replica_init / NCCLX_SPEEDUP, job_init),
            source=f"{nccl}: {replica_gpus:,} ranks (one replica); sweep: NCCLX's 11x, "
                   f"a job-wide init ({gpus:,} ranks)"),
        "time_to_join_s": evidence.time_to_join,
        "join_stall_s": evidence.join_stall,
    }


def recovery(parts: dict[str, Input], gpus: int) -> ettr.ReplicaRecovery:
    """ftsystem's recovery from its components: a failure stalls the survivors for detection,
    the decision and the rebuild of the cross-replica communicators; the failed replica waits for
    a host, creates its communicators, then starts and catches up; its join stalls the survivors
    for the measured join stall, a decision and another rebuild."""
    value = {name: part.value_s for name, part in parts.items()}
    reconfigure = value["decision_s"] + value["nccl_reinit_s"]
    return ettr.ReplicaRecovery(
        stall_s=value["host_stall_s"] + reconfigure,
        relaunch_s=value["host_wait_s"] + value["replica_nccl_init_s"],
        catchup_s=value["time_to_join_s"],
        join_stall_s=value["join_stall_s"] + reconfigure,
        replica_gpus=replica_layout(gpus)[1])


def sensitivity(parts: dict[str, Input], gpus: int,
                evaluate: Callable[[ettr.ReplicaRecovery], dict]) -> list[dict]:
    """ETTR against each input: every point of its sweep, the others at their base values.
    ``evaluate`` maps a recovery to ``{"work": .., "time": ..}``. Returns one row per input:
    {"input", "kind", "base_s", "points": [{"value_s", "work", "time"}, ...]}."""
    rows = []
    for name, part in parts.items():
        points = []
        for value_s in part.points():
            varied = {**parts, name: replace(part, value_s=value_s)}
            points.append({"value_s": value_s, **evaluate(recovery(varied, gpus))})
        rows.append({"input": name, "kind": part.kind, "base_s": part.value_s,
                     "points": points})
    return rows
