"""A discrete-event simulator (simpy) of HALoS and its baselines in virtual time.

Virtual time follows the time model of the authors' simulator (``timemodel``) for the simulated
model (Pythia-70M by default); the losses come from real optimizer steps of a small model
(``workload``). A worker's real computation happens when its job starts, from the model it
received then; its pseudo-gradient reaches the server when the job's virtual time has passed.

Each method runs until the model it is judged by (the global model, or the one server's) has
absorbed the same budget of local steps; the loss curve samples that model's held-out loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import simpy
import torch

from ftsystem.halos import rules, timemodel
from ftsystem.halos.config import PaperSetup, lps_groups
from ftsystem.halos.rules import ServerState
from ftsystem.halos.workload import CHUNK_SEQUENCES, Workload, WorkloadConfig

METHODS = ("halos", "diloco", "diloco_dynupd", "async_local_sgd", "sync")
SYNCHRONOUS = ("diloco", "diloco_dynupd", "sync")
"""Methods whose model changes only at rounds of equal virtual length: their losses do not
depend on the time model, and their times scale with the round's length."""


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """The scaled-down run: how long, how often to measure, what is really trained."""

    total_iters: int = 1536
    """Global iterations (one local step per worker each) in every method's budget; the paper
    trains 6144. The workers' warmup keeps the paper's share of it."""
    eval_points: int = 64
    """Held-out evaluations over the budget (at most one per server update)."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """The small model and its data."""
    noise_every: int = 0
    """Sync only, when > 0: every ``noise_every``-th step also measures each worker's own
    gradient and their mean (``Curve.noise``) for the gradient noise scale. The step itself is
    unchanged."""

    def __post_init__(self) -> None:
        if self.total_iters < 1 or self.eval_points < 1 or self.noise_every < 0:
            raise ValueError("total_iters and eval_points must be >= 1, noise_every >= 0")
        if not 1 <= self.workload.local_batch <= CHUNK_SEQUENCES:
            raise ValueError(f"local_batch must lie in 1..{CHUNK_SEQUENCES}")


@dataclass(kw_only=True, slots=True)
class Curve:
    """One method's held-out loss against virtual time and local steps."""

    method: str
    """Which method."""
    time_s: list[float] = field(default_factory=list)
    """Virtual seconds at each evaluation."""
    local_steps: list[int] = field(default_factory=list)
    """Local steps absorbed by the judged model at each evaluation."""
    loss: list[float] = field(default_factory=list)
    """Held-out loss at each evaluation."""
    final_accuracy: float | None = None
    """Next-character (next-token) accuracy of the final model on the held-out windows."""
    updates: int = 0
    """Updates of the judged model (GPS updates, DiLoCo rounds, server or sync steps)."""
    noise: list[list[float]] = field(default_factory=list)
    """Sync with ``SimConfig.noise_every``: ``[local steps, mean |g_w|^2, |mean g_w|^2]`` per
    probe, g_w the gradient of worker w's batch (``Workload.gradient_norms``)."""
    wall_s: float = 0.0
    """Real seconds the simulation took."""
    cpu_s: float = 0.0
    """CPU seconds the simulation took (on a shared machine, less than ``wall_s``)."""

    @property
    def final_loss(self) -> float:
        return self.loss[-1]

    def first_reaching(self, target: float) -> int | None:
        """Index of the first evaluation at or below ``target``, if any."""
        return next((i for i, loss in enumerate(self.loss) if loss <= target), None)


class Run:
    """One method's simulation: the clock, the budget, the schedule and the loss curve."""

    def __init__(self, setup: PaperSetup, cfg: SimConfig, method: str) -> None:
        self.setup, self.cfg = setup, cfg
        self.env = simpy.Environment()
        self.work = Workload(cfg.workload, setup.network.worker_regions, setup.worker)
        self.num_workers = len(setup.network.speeds)
        self.budget = cfg.total_iters * self.num_workers
        self.curve = Curve(method=method)
        self.done = self.env.event()
        self._handed_out = 0
        self._applied = 0
        self._eval_every = max(1, self.budget // cfg.eval_points)
        self._next_eval = self._eval_every
        self._links: dict[tuple[int, int], timemodel.SharedLink] = {}

    @property
    def model_bytes(self) -> int:
        return self.setup.time_model.model_bytes

    def gbps(self, a: int, b: int) -> float:
        return self.setup.network.bandwidth_gbps[a][b]

    @property
    def link_sharing(self) -> bool:
        return self.setup.time_model.link_sharing

    def move(self, src: int, dst: int) -> Generator:
        """Move the model from region ``src`` to ``dst`` (``src == dst``: inside a region).

        With link sharing, over the ``(src, dst)`` link shared with the transfers in flight
        on it; without, at the link's whole bandwidth.
        """
        if not self.link_sharing:
            yield self.env.timeout(timemodel.transfer_s(self.model_bytes, self.gbps(src, dst)))
            return
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[src, dst] = timemodel.SharedLink(self.env, self.gbps(src, dst))
        yield link.transfer(self.model_bytes)

    def claim(self, steps: int) -> int:
        """Hand out ``steps`` local steps of data; returns the global iteration they start at.

        As in the authors' simulator the workers' schedule follows the data handed out so far
        (one iteration per ``num_workers`` local steps) and advances one iteration per step.
        """
        start = self._handed_out // self.num_workers
        self._handed_out += steps
        return start

    def lrs(self, start: int, steps: int) -> list[float]:
        """Learning rates of ``steps`` local steps from iteration ``start``.

        As the authors' worker does, the schedule is stepped *before* each step: the j-th step
        (from 0) runs at iteration ``start + j + 1``, so the first step of the run is not at lr 0.
        """
        opt, total = self.setup.worker, self.cfg.total_iters
        return [rules.warmup_cosine_lr(start + j + 1, max_lr=opt.lr, total=total,
                                       warmup=round(opt.warmup_fraction * total))
                for j in range(steps)]

    def train(self, worker: int, theta: torch.Tensor, start: int, steps: int) -> torch.Tensor:
        """Worker ``worker``'s pseudo-gradient after ``steps`` local steps from ``theta``."""
        return self.work.train(worker, theta, self.lrs(start, steps))[0]

    def record(self, steps: int, theta: torch.Tensor) -> None:
        """The judged model absorbed ``steps`` more local steps and is now ``theta``."""
        if self.done.triggered:  # events due at the very instant the budget was reached
            return
        self._applied += steps
        self.curve.updates += 1
        finished = self._applied >= self.budget
        if self._applied >= self._next_eval or finished:
            self._evaluate(theta)
            self._next_eval = (self._applied // self._eval_every + 1) * self._eval_every
        if finished and not self.done.triggered:
            self.curve.final_accuracy = self.work.accuracy(theta)
            self.done.succeed()

    def _evaluate(self, theta: torch.Tensor) -> None:
        self.curve.time_s.append(self.env.now)
        self.curve.local_steps.append(self._applied)
        self.curve.loss.append(self.work.evaluate(theta))

    def execute(self, process: Callable[["Run"], Generator]) -> Curve:
        """Run ``process`` (a method) from the initial model until the budget is absorbed."""
        start, cpu = time.perf_counter(), time.process_time()
        self._evaluate(self.work.theta0)
        self.env.process(process(self))
        self.env.run(until=self.done)
        self.curve.wall_s = time.perf_counter() - start
        self.curve.cpu_s = time.process_time() - cpu
        return self.curve


def simulate(setup: PaperSetup, cfg: SimConfig, method: str) -> Curve:
    """Run one method of ``METHODS`` to its budget; its loss curve in virtual time."""
    if method not in PROCESSES:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return Run(setup, cfg, method).execute(PROCESSES[method])


def local_steps(setup: PaperSetup, h: int, dynamic: bool) -> list[int]:
    """Each worker's H, rescaled by its speed for dynamic local updates."""
    speeds = setup.network.speeds
    return [rules.scaled_local_steps(h, s, max(speeds)) if dynamic else h for s in speeds]


def sync_round_s(setup: PaperSetup, steps: list[int]) -> float:
    """A synchronous round (sync's step, DiLoCo's round) in which worker i runs ``steps[i]``
    local steps: the slowest worker's compute, then a ring all-reduce of the model."""
    net, tm = setup.network, setup.time_model
    compute = max(timemodel.compute_s(h, s, tm.local_step_time_s)
                  for h, s in zip(steps, net.speeds))
    ring = timemodel.best_ring_gbps(net.bandwidth_gbps)
    return compute + timemodel.ring_allreduce_s(tm.model_bytes, len(net.speeds), ring)


def round_steps(setup: PaperSetup, method: str) -> list[int]:
    """Each worker's local steps per round of a synchronous method (sync, DiLoCo's two)."""
    if method == "sync":
        return [1] * len(setup.network.speeds)
    if method in ("diloco", "diloco_dynupd"):
        return local_steps(setup, setup.diloco.local_steps, method == "diloco_dynupd")
    raise ValueError(f"{method!r} has no rounds; synchronous methods: {', '.join(SYNCHRONOUS)}")


def _sync(run: Run) -> Generator:
    """Synchronous data parallel: every step, the mean gradient of all workers, one AdamW step.

    The mean of equal-sized workers' gradients is the gradient of their concatenated batch, so
    one backward pass over that batch stands for the all-reduce.
    """
    theta, opt = run.work.theta0, run.work.adamw()
    step_s = sync_round_s(run.setup, round_steps(run.setup, "sync"))
    every = run.cfg.noise_every
    while True:
        start = run.claim(run.num_workers)
        batches = [run.work.batches(w, 1)[0] for w in range(run.num_workers)]
        if every and (start + 1) % every == 0:
            run.curve.noise.append([start * run.num_workers,
                                    *run.work.gradient_norms(theta, batches)])
        batch = torch.cat(batches)
        update, _ = rules.local_sgd(run.work.model, opt, theta, [batch], run.lrs(start, 1),
                                    grad_clip=run.setup.worker.grad_clip)
        yield run.env.timeout(step_s)
        theta = theta - update
        run.record(run.num_workers, theta)


def _diloco(run: Run, *, dynamic: bool) -> Generator:
    """DiLoCo rounds: every worker H local steps from the global model, outer Nesterov step.

    Each worker claims its data in turn and its schedule starts where its data starts, as in
    the authors' simulator; when all workers run the same H that start is rounded down to a
    multiple of H, so they all share the round's schedule (with dynamic local updates they do
    not: a worker later in the round starts later in the schedule).
    """
    cfg = run.setup.diloco
    steps = round_steps(run.setup, "diloco_dynupd" if dynamic else "diloco")
    same = len(set(steps)) == 1
    round_s, state = sync_round_s(run.setup, steps), ServerState.start(run.work.theta0)
    while True:
        starts = [run.claim(h) for h in steps]
        starts = [s - s % steps[0] for s in starts] if same else starts
        grads = [run.train(w, state.theta, s, h) for w, (s, h) in enumerate(zip(starts, steps))]
        yield run.env.timeout(round_s)
        state = rules.diloco_round(state, grads, cfg.outer)
        run.record(sum(steps), state.theta)


def _async_worker(run: Run, worker: int, steps: int, server_region: int,
                  pull: Callable[[int], torch.Tensor],
                  push: Callable[[int, torch.Tensor, int], None]) -> Generator:
    """An asynchronous worker: fetch its server's model, H local steps, send the pseudo-gradient.

    Without link sharing the job is one span of virtual time (``timemodel.async_job_s``); with
    it, the fetch and the send are transfers on the shared links between the two regions.
    """
    net, tm = run.setup.network, run.setup.time_model
    region = net.worker_regions[worker]
    compute_s = timemodel.compute_s(steps, net.speeds[worker], tm.local_step_time_s)
    job_s = timemodel.async_job_s(
        model_bytes=run.model_bytes, gbps=run.gbps(server_region, region), steps=steps,
        speed=net.speeds[worker], step_time_s=tm.local_step_time_s)
    while True:
        grad = run.train(worker, pull(worker), run.claim(steps), steps)
        if run.link_sharing:
            yield from run.move(server_region, region)
            yield run.env.timeout(compute_s)
            yield from run.move(region, server_region)
        else:
            yield run.env.timeout(job_s)
        push(worker, grad, steps)


def _async_local_sgd(run: Run) -> Generator:
    """Async-Local-SGD: one server in the GPS region applies each pseudo-gradient on arrival."""
    cfg, region = run.setup.async_local_sgd, run.setup.network.gps_region
    state = ServerState.start(run.work.theta0)

    def push(worker: int, grad: torch.Tensor, steps: int) -> None:
        nonlocal state
        state = rules.server_apply(state, grad, cfg.server)
        run.record(steps, state.theta)

    for w, h in enumerate(local_steps(run.setup, cfg.local_steps, cfg.dynamic_local_updates)):
        run.env.process(_async_worker(run, w, h, region, lambda _: state.theta, push))
    yield run.done


class _Halos:
    """HALoS's servers: one LPS per group of same-region workers, one GPS."""

    def __init__(self, run: Run) -> None:
        self.run, self.cfg = run, run.setup.halos
        net = run.setup.network
        regions, groups = net.worker_regions, lps_groups(self.cfg, net)
        self.lps_of = [0] * run.num_workers
        for i, group in enumerate(groups):
            for w in group:
                self.lps_of[w] = i
        self.region_of_lps = [regions[g[0]] for g in groups]
        self.lps = [rules.LpsState.start(run.work.theta0) for _ in self.region_of_lps]
        self.unsent = [0] * len(self.lps)  # local steps absorbed by an LPS since its last send
        self.gps = ServerState.start(run.work.theta0)

    def pull(self, worker: int) -> torch.Tensor:
        return self.lps[self.lps_of[worker]].server.theta

    def push(self, worker: int, grad: torch.Tensor, steps: int) -> None:
        i = self.lps_of[worker]
        self.lps[i], delta = rules.lps_apply(self.lps[i], grad, self.cfg.lps,
                                             accumulation_k=self.cfg.accumulation_k)
        self.unsent[i] += steps
        if delta is not None:
            self.run.env.process(self._exchange(i, delta, self.unsent[i]))
            self.unsent[i] = 0

    def _exchange(self, i: int, delta: torch.Tensor, steps: int) -> Generator:
        """LPS ``i`` sends its delta, the GPS applies it and returns the global model."""
        run, region = self.run, self.region_of_lps[i]
        gps_region = run.setup.network.gps_region
        yield from run.move(region, gps_region)
        self.gps = rules.server_apply(self.gps, delta, self.cfg.gps)
        run.record(steps, self.gps.theta)
        global_theta = self.gps.theta
        yield from run.move(gps_region, region)
        self.lps[i] = rules.lps_merge(self.lps[i], global_theta, self.cfg.merge_alpha)


def _halos(run: Run) -> Generator:
    """HALoS: workers -> their region's LPS (local momentum) -> GPS (global momentum)."""
    servers = _Halos(run)
    for w, h in enumerate(local_steps(run.setup, run.setup.halos.local_steps, dynamic=True)):
        region = run.setup.network.worker_regions[w]
        run.env.process(_async_worker(run, w, h, region, servers.pull, servers.push))
    yield run.done


PROCESSES: dict[str, Callable[[Run], Generator]] = {
    "halos": _halos,
    "diloco": lambda run: _diloco(run, dynamic=False),
    "diloco_dynupd": lambda run: _diloco(run, dynamic=True),
    "async_local_sgd": _async_local_sgd,
    "sync": _sync,
}
