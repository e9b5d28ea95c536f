"""ftsystem's recovery costs at 1K..200K GPUs, from inputs that hold at that scale.

A benchmark on this machine measures a job of a few replicas on loopback. What of it carries to
98,304 GPUs, and what must come from elsewhere, is decided here, one named input at a time, each
labelled with where it comes from (``MEASURED``, ``PUBLISHED``, ``MODEL``, ``ASSUMED``) and with a
range of plausible values for the sensitivity table (docs/ettr_simulation.md):

- the survivors' stall after a host dies (measured here: ``bench failover --scenario host``), and
  after a replica hangs (the straggler bound at the job's step time, for the assumed share of
  failures that are hangs);
- the controller's decision at the job's node count (measured here: ``bench controller --nodes``);
- the time to create NCCL communicators of a given size (a straight line through two published
  figures, ``nccl_init_s``);
- the rendezvous of every rank in the epoch's one store at each membership change (a published
  TCPStore figure per connection, an assumed cost per request);
- the relaunch of a failed replica, one model shared with FT-HSDP: an assumed wait for a
  replacement host plus the NCCL init of one replica;
- the time a relaunched replica takes from process start to its first commit, and the
  survivors' stall while it joins (measured here: ``bench rejoin``);
- the two votes every step takes over a Gloo group of the replica's ranks, a loss of throughput
  at the job's step time (an assumed hop latency; the step time from published Llama 3 figures).

Everything here is arithmetic without I/O; the command reads the benchmark files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ftsystem.control.timeouts import StragglerBound
from ftsystem.sim import ettr

MEASURED = "measured-here"
PUBLISHED = "published"
MODEL = "model"
ASSUMED = "assumed"
KINDS = (MEASURED, PUBLISHED, MODEL, ASSUMED)
SECONDS, FRACTION, GPUS = "s", "fraction", "GPUs"
UNITS = (SECONDS, FRACTION, GPUS)

DEFAULT_TIMEOUT_S = 30.0
"""ftsystem's default ``--timeout`` (``ftsystem.training.runtime.DEFAULT_TIMEOUT_S``, which is not
imported here: it pulls in the etcd client): the fallback for the host stall."""
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
which ``time_to_join_s`` counts again: conservative. The same for FT-HSDP and ftsystem."""
HOST_WAIT_SWEEP_S = (0.0, 60.0, HOST_WAIT_S, ettr.SYNC_RESTART_S)
"""A hot spare with its agent running; a warm spare; the base; the paper's whole restart."""

STORE_INIT = (98_304, 100.0)
"""(ranks, seconds): a TCPStore on the libuv backend (PyTorch's default since 2.4) finished its
initialisation with 96K ranks in 100 s, every rank connecting, validating and adding once
(PyTorch tutorial "Introduction to Libuv TCPStore Backend",
pytorch/tutorials intermediate_source/TCPStore_libuv_backend.rst; the legacy backend timed out
after 30 minutes there). Rank 0 measured it, so launch skew is in it too: an upper bound."""
STORE_CONNECT_S = STORE_INIT[1] / STORE_INIT[0]
"""The store's time per connecting rank, 1.02 ms: the published figure spread evenly."""
STORE_CONNECTIONS_PER_RANK = 2
"""Each epoch, every rank of every member opens two clients of the epoch's store, which
``members[0]`` hosts for every shard: one for the barrier (``FaultTolerantAllReduce._barrier``)
and one for its group (torchft's ``ProcessGroup.configure``, ``create_store_client``)."""
STORE_REQUEST_S = 10e-6
"""Assumed: the store's time per small request (a set, a check, a get) on its one event loop."""
STORE_REQUESTS_FIXED = 3
"""Requests per rank and epoch besides one read per peer: its barrier key, one check that finds
every key there, its group's address."""

VOTES_PER_STEP = 2
"""``ReplicaGroup.max`` (the newest epoch any rank has seen) before a step's all-reduce and
``ReplicaGroup.vote`` after it (``ftsystem/training/gradient_sum.py``): two MAX all-reduces of a
few numbers over a Gloo group of the replica's ranks, on the training thread."""
VOTE_HOP_S = 20e-6
"""Assumed: one hop of a small message in Gloo's ring (TCP, seven in eight of them between ranks
of one host at 8 GPUs per host)."""
GLOO_HOPS_PUBLISHED_S = (0.039e-3 / 2, 0.354e-3 / 2)
"""Published two-process Gloo ring all-reduces of 1 KB between two servers: 0.039 ms over
InfiniBand verbs, 0.354 ms over TCP (github.com/pytorch/gloo/issues/158, 2018); two hops each."""

LLAMA3_STEP = (405e9, 16e6, 16_384, 400e12)
"""Llama 3 405B (Dubey et al. 2024, table 4): parameters, tokens per batch, GPUs, BF16 FLOP/s
per GPU achieved."""
STEP_S = 6 * LLAMA3_STEP[0] * LLAMA3_STEP[1] / (LLAMA3_STEP[2] * LLAMA3_STEP[3])
"""5.93 s: 6 x parameters x tokens FLOPs per step at Llama 3's rate. Each GPU's share of the batch
is kept as the job grows, so the step time does not change with scale."""
STEP_SWEEP_S = (STEP_S * LLAMA3_STEP[2] / ettr.PAPER_GPUS, 2.0, 2 * STEP_S)
"""The same 16M-token batch over 98,304 GPUs (0.99 s), 2 s, twice the base."""

HANG_FRACTION = 0.3
"""Assumed: the share of failures that leave a replica hung (alive to the agent and the lease)
rather than dead. No published split of the two was found."""


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


def store_rendezvous_s(ranks: int, members: int, connect_s: float, request_s: float) -> float:
    """Seconds for ``ranks`` ranks of an epoch of ``members`` replicas to meet in its one store:
    the store's event loop serves them one after another, each rank's two connections and its
    requests (``STORE_REQUESTS_FIXED`` and one read per peer). The polling of the ranks that wait
    while others connect is not counted (optimistic)."""
    if ranks < 0 or members < 1:
        raise ValueError(f"need ranks >= 0 and members >= 1, got {ranks}, {members}")
    requests = STORE_REQUESTS_FIXED + members - 1
    return ranks * (STORE_CONNECTIONS_PER_RANK * connect_s + requests * request_s)


def vote_s(ranks: int, hop_s: float) -> float:
    """Seconds of one vote over ``ranks`` ranks: Gloo's all-reduce is a ring (``gloo/allreduce.cc``,
    what ProcessGroupGloo runs for a dense CPU tensor), a reduce-scatter and an all-gather of
    ``ranks - 1`` sequential hops each. A replica of one rank has no group: no cost."""
    return 2 * (ranks - 1) * hop_s if ranks > 1 else 0.0


def vote_loss(step_s: float, one_vote_s: float) -> float:
    """The fraction of training throughput the votes take: they add to every step."""
    votes = VOTES_PER_STEP * one_vote_s
    return votes / (step_s + votes) if votes > 0 else 0.0


def hang_detection_s(step_s: float) -> float:
    """How long the survivors wait for a hung replica: the straggler bound at this step time with
    ftsystem's defaults (4 x the step, at least 2 s, at most the watchdog's third of the 30 s
    timeout; ``ftsystem.control.timeouts.StragglerBound``)."""
    return StragglerBound().bound_s([step_s])


@dataclass(frozen=True, kw_only=True, slots=True)
class Input:
    """One number the prediction rests on, and where it comes from."""

    value: float
    """Base value, in ``unit``."""
    kind: str
    """One of KINDS."""
    source: str
    """Where the value comes from: a file and field, a publication, or the reason for a guess."""
    sweep: tuple[float, ...] = ()
    """Plausible values for the sensitivity table (the base is added to them)."""
    unit: str = SECONDS
    """One of UNITS."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if not all(v >= 0 for v in (self.value, *self.sweep)):
            raise ValueError(f"values must be non-negative: {self.value}, {self.sweep}")
        if self.unit == FRACTION and not all(v <= 1 for v in (self.value, *self.sweep)):
            raise ValueError(f"a fraction must lie in [0, 1]: {self.value}, {self.sweep}")

    def points(self) -> tuple[float, ...]:
        """The sweep with the base value, ascending, without repeats."""
        return tuple(sorted({*self.sweep, self.value}))

    def range(self) -> tuple[float, float]:
        """The lowest and highest plausible value."""
        points = self.points()
        return points[0], points[-1]


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Spread:
    """A figure of several rounds: its median and extremes."""

    median: float
    low: float
    high: float


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
        return Input(value=timeout_s, kind=ASSUMED, sweep=bounds,
                     source=f"assumed (no host failover benchmark): the timeout, {timeout_s:g} s, "
                            "bounds detection")
    medians = {n: s["median"] for n, s in layouts.items()}
    nodes = max(medians, key=medians.get)
    described = ", ".join(f"{n} node(s) per replica: median {s['median']:.2f} s, max "
                          f"{s['max']:.2f} s" for n, s in sorted(layouts.items()))
    return Input(value=medians[nodes], kind=MEASURED,
                 sweep=(min(medians.values()), max(s["max"] for s in layouts.values()), *bounds),
                 source=f"{source}: the largest median of the layouts ({described}); sweep: the "
                        "other layout, the largest max, the lease TTL, the timeout")


def decision_input(p50_s: float | None, p99_s: float | None, source: str) -> Input:
    """The controller's decision: the p99 (the slower kind of failure), swept from its p50 to a
    second (an etcd under load)."""
    if p99_s is None:
        return Input(value=1.0, kind=ASSUMED, sweep=(0.05, 5.0),
                     source="assumed (no controller benchmark at scale): 1 s")
    return Input(value=p99_s, kind=MEASURED, sweep=(p50_s or p99_s, 0.2, 1.0),
                 source=f"{source}; sweep: the p50, 0.2 s, 1 s (an etcd under load)")


def time_to_join_input(figure: Spread | None, source: str) -> Input:
    """A relaunched replica's time from process start to its first commit: the median over the
    rounds, swept over the rounds' extremes, half and up to 4x (more state per rank, slower
    storage)."""
    if figure is None:
        return Input(value=60.0, kind=ASSUMED, sweep=(15.0, 240.0),
                     source="assumed (no rejoin benchmark): 60 s")
    value = figure.median
    return Input(value=value, kind=MEASURED,
                 sweep=(value / 2, figure.low, figure.high, 2 * value, 4 * value),
                 source=f"{source}; sweep: half, the rounds' min and max, 2x, 4x")


def join_stall_input(figure: Spread | None, source: str, *,
                     at_join_step: float | None = None) -> Input:
    """The survivors' stall while a replica joins: the median over the rounds, swept from none
    (a join fully overlapped), the stall of the join step alone and the rounds' extremes to
    4x."""
    if figure is None:
        return Input(value=1.0, kind=ASSUMED, sweep=(0.0, 10.0),
                     source="assumed (no rejoin benchmark): one reconfiguration, 1 s")
    value = figure.median
    sweep = (0.0, figure.low, figure.high, 2 * value, 4 * value)
    if at_join_step is not None:
        sweep += (at_join_step,)
    return Input(value=value, kind=MEASURED, sweep=sweep,
                 source=f"{source}; sweep: none, the rounds' min and max"
                        + (", the join step's own stall" if at_join_step is not None else "")
                        + ", 2x, 4x")


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
    parallel); a relaunched replica creates its own, across its GPUs, before it starts. The
    store's costs are per connection and per request: the rendezvous they add up to grows with
    the ranks (``store_rendezvous_s``)."""
    replicas, replica_gpus = replica_layout(gpus)
    hosts = gpus // GPUS_PER_HOST
    factor = max(1.0, hosts / (evidence.decision_nodes or hosts))
    decision = evidence.decision
    reinit, replica_init, job_init = (nccl_init_s(n) for n in (replicas, replica_gpus, gpus))
    nccl = (f"{MODEL}: line through {NCCL_INIT_SMALL[1]} s at {NCCL_INIT_SMALL[0]} ranks "
            f"(NVIDIA/nccl#1412) and {NCCL_INIT_LARGE[1]:g} s at {NCCL_INIT_LARGE[0]:,} "
            "(arXiv 2510.20171)")
    low_hop, tcp_hop = GLOO_HOPS_PUBLISHED_S
    return {
        "host_stall_s": evidence.host_stall,
        "hang_fraction": Input(
            value=HANG_FRACTION, kind=ASSUMED, unit=FRACTION, sweep=(0.0, 0.5, 1.0),
            source=f"{ASSUMED}: share of failures that hang a replica instead of killing it (no "
                   "published split found); a hang stalls the survivors for the straggler bound "
                   "at the step time instead of the host stall"),
        "step_s": Input(
            value=STEP_S, kind=MODEL, sweep=STEP_SWEEP_S,
            source=f"{MODEL}: 6 x 405e9 parameters x 16M tokens / (16,384 GPUs x 400 TFLOP/s), "
                   "Llama 3 405B's step (Dubey et al. 2024, table 4), each GPU's share of the "
                   "batch kept at every scale; sweep: the same batch over 98,304 GPUs, 2 s, 2x"),
        "decision_s": replace(
            decision, value=decision.value * factor,
            sweep=tuple(v * factor for v in decision.sweep),
            source=decision.source + (f"; x{factor:.2f} for {hosts:,} hosts against "
                                      f"{evidence.decision_nodes:,} measured (linear)"
                                      if factor > 1 else f"; {hosts:,} hosts")),
        "nccl_reinit_s": Input(
            value=reinit, kind=MODEL, sweep=(0.0, reinit / NCCLX_SPEEDUP, replica_init),
            source=f"{nccl}: {replicas} ranks (one per replica); sweep: none (communicators "
                   f"built ahead), NCCLX's 11x, a replica-wide rebuild ({replica_gpus:,} ranks)"),
        "store_connect_s": Input(
            value=STORE_CONNECT_S, kind=PUBLISHED,
            sweep=(0.0, 50e-6, 250e-6, 2 * STORE_CONNECT_S),
            source=f"{PUBLISHED}: the store's time per connecting rank, {STORE_INIT[1]:g} s for "
                   f"a libuv TCPStore's initialisation with {STORE_INIT[0]:,} ranks (PyTorch "
                   "tutorial 'Introduction to Libuv TCPStore Backend') spread evenly, an upper "
                   f"bound; {STORE_CONNECTIONS_PER_RANK} connections per rank and epoch; sweep: "
                   "connections kept across epochs, 20,000 and 4,000 connections a second, 2x"),
        "store_request_s": Input(
            value=STORE_REQUEST_S, kind=ASSUMED, sweep=(2e-6, 50e-6),
            source=f"{ASSUMED}: the store's time per small request on its one event loop; "
                   f"{STORE_REQUESTS_FIXED} requests per rank and epoch plus one read per peer"),
        "host_wait_s": Input(
            value=HOST_WAIT_S, kind=ASSUMED, sweep=HOST_WAIT_SWEEP_S,
            source=f"{ASSUMED}: the paper's {ettr.SYNC_RESTART_S:g} s restart less stock NCCL's "
                   f"{NCCL_INIT_LARGE[1]:g} s init at 96K (scheduling, health checks, process "
                   "start), the same for FT-HSDP; sweep: hot spare, warm spare, base, the "
                   "paper's whole restart"),
        "replica_nccl_init_s": Input(
            value=replica_init, kind=MODEL,
            sweep=(replica_init / NCCLX_SPEEDUP, job_init),
            source=f"{nccl}: {replica_gpus:,} ranks (one replica), the same for FT-HSDP; "
                   f"sweep: NCCLX's 11x, a job-wide init ({gpus:,} ranks)"),
        "time_to_join_s": evidence.time_to_join,
        "join_stall_s": evidence.join_stall,
        "vote_hop_s": Input(
            value=VOTE_HOP_S, kind=ASSUMED, sweep=(5e-6, low_hop, 50e-6, tcp_hop),
            source=f"{ASSUMED}: one hop of Gloo's ring over TCP; {VOTES_PER_STEP} votes per "
                   f"step over the replica's {replica_gpus:,} ranks, 2 x (ranks - 1) hops each; "
                   "sweep: 5 us, the published InfiniBand-verbs (20 us) and TCP (177 us) hops "
                   "of pytorch/gloo#158, 50 us"),
    }


def relaunch_s(parts: dict[str, Input]) -> float:
    """A failed replica, from the failure until its processes run again: a replacement host, then
    the NCCL init of one replica's communicators. One model for FT-HSDP and ftsystem."""
    return parts["host_wait_s"].value + parts["replica_nccl_init_s"].value


def terms(parts: dict[str, Input], gpus: int) -> dict[str, float]:
    """The pieces ftsystem's recovery adds up from its inputs at a job of ``gpus`` (seconds,
    except ``vote_loss``, a fraction of throughput)."""
    value = {name: part.value for name, part in parts.items()}
    replicas, replica_gpus = replica_layout(gpus)
    hang = value["hang_fraction"]
    rendezvous = {name: store_rendezvous_s(members * replica_gpus, members,
                                           value["store_connect_s"], value["store_request_s"])
                  for name, members in (("failure", replicas - 1), ("join", replicas))}
    return {
        "hang_detection_s": hang_detection_s(value["step_s"]),
        "detection_s": (1 - hang) * value["host_stall_s"]
                       + hang * hang_detection_s(value["step_s"]),
        "reconfigure_s": value["decision_s"] + value["nccl_reinit_s"],
        "rendezvous_failure_s": rendezvous["failure"],
        "rendezvous_join_s": rendezvous["join"],
        "relaunch_s": relaunch_s(parts),
        "vote_s": vote_s(replica_gpus, value["vote_hop_s"]),
        "vote_loss": vote_loss(value["step_s"], vote_s(replica_gpus, value["vote_hop_s"])),
    }


def recovery(parts: dict[str, Input], gpus: int) -> ettr.ReplicaRecovery:
    """ftsystem's recovery from its components: a failure stalls the survivors for detection
    (the host stall, or for a hang the straggler bound), the decision, the rebuild of the
    cross-replica communicators and the survivors' rendezvous in the new epoch's store; the failed
    replica relaunches (the model shared with FT-HSDP), then starts and catches up; its join
    stalls the survivors for the measured join stall, a decision, another rebuild and everyone's
    rendezvous. The votes take their share of every step's throughput."""
    t = terms(parts, gpus)
    return ettr.ReplicaRecovery(
        stall_s=t["detection_s"] + t["reconfigure_s"] + t["rendezvous_failure_s"],
        relaunch_s=t["relaunch_s"],
        catchup_s=parts["time_to_join_s"].value,
        join_stall_s=parts["join_stall_s"].value + t["reconfigure_s"] + t["rendezvous_join_s"],
        replica_gpus=replica_layout(gpus)[1],
        throughput=1 - t["vote_loss"])


def fthsdp_recovery(parts: dict[str, Input], gpus: int) -> ettr.ReplicaRecovery:
    """FT-HSDP as published, with the relaunch model ftsystem uses at this scale."""
    return ettr.fthsdp_recovery(relaunch_s(parts), replica_gpus=replica_layout(gpus)[1])


def baseline_inputs(failure_model: str) -> dict[str, Input]:
    """The inputs of the failure process and of the sync and FT-HSDP models at the paper's scale,
    in the same form as ftsystem's (they are not swept: the paper reproduction fixes them)."""
    mttf = {name: curve(ettr.PAPER_GPUS) for name, curve in ettr.FAILURE_MODELS.items()}
    daly = {w: ettr.young_daly_interval_s(w, mttf[failure_model]) for w in (0.5, 5.0)}
    return {
        "mttf_s": Input(
            value=mttf[failure_model], kind=MODEL, sweep=tuple(mttf.values()),
            source=f"model ({failure_model}): job MTTF at {ettr.PAPER_GPUS:,} GPUs through "
                   "published points (Kokolis et al., HPCA 2025: a power law between their 16K "
                   "and 131K points; Llama 3's constant per-GPU rate for the other end of the "
                   "range)"),
        "sync_restart_s": Input(
            value=ettr.SYNC_RESTART_S, kind=PUBLISHED,
            source="FT-HSDP paper (arXiv 2602.00277): a 10-minute stall per failure"),
        "checkpoint_write_s": Input(
            value=ettr.CHECKPOINT_WRITE_S, kind=ASSUMED, sweep=(0.5, 5.0),
            source="assumed: the blocking device-to-host snapshot of an asynchronous checkpoint"),
        "checkpoint_interval_s": Input(
            value=ettr.young_daly_interval_s(ettr.CHECKPOINT_WRITE_S, mttf[failure_model]),
            kind=MODEL, sweep=tuple(daly.values()),
            source="model: Young/Daly sqrt(2 x write x MTTF); sweep: writes of 0.5 and 5 s"),
        "fthsdp_stall_s": Input(
            value=ettr.FTHSDP_STALL_S, kind=PUBLISHED,
            source="FT-HSDP paper (arXiv 2602.00277): a 3-minute stall per failure, whole job"),
        "fthsdp_catchup_s": Input(
            value=0.0, kind=MODEL,
            source="model: the FT-HSDP paper's non-blocking catch-up with minimal stall, "
                   "modelled as free (and so is its join)"),
        "replica_gpus": Input(
            value=float(ettr.REPLICA_GPUS), kind=ASSUMED, unit=GPUS, sweep=(4_096.0, 16_384.0),
            source="assumed: not published; 12 replicas at 98,304 GPUs (4,096 to 16,384 all "
                   "reproduce the paper)"),
    }


def sensitivity(parts: dict[str, Input], gpus: int,
                evaluate: Callable[[ettr.ReplicaRecovery], dict]) -> list[dict]:
    """ETTR against each input: every point of its sweep, the others at their base values.
    ``evaluate`` maps a recovery to ``{"work": .., "time": ..}``. Returns one row per input,
    ranked by how far it moves the work-based ETTR over its sweep (``swing``), largest first:
    {"input", "kind", "unit", "base", "swing", "swing_time", "points": [{"value", "work",
    "time"}, ...]}."""
    rows = []
    for name, part in parts.items():
        points = []
        for value in part.points():
            varied = {**parts, name: replace(part, value=value)}
            points.append({"value": value, **evaluate(recovery(varied, gpus))})
        work, time = ([p[k] for p in points] for k in ("work", "time"))
        rows.append({"input": name, "kind": part.kind, "unit": part.unit, "base": part.value,
                     "swing": max(work) - min(work), "swing_time": max(time) - min(time),
                     "points": points})
    return sorted(rows, key=lambda row: row["swing"], reverse=True)
