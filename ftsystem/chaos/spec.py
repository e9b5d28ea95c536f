"""Failure-injection specs (shaped like Chaos Mesh experiments) and the orders they expand to.

A spec says what to do (``action``), to whom (``selector`` and ``mode``), for how long
(``duration``) and when (``schedule``)::

    action: hang            # kill | hang | slow | partition | host-kill | host-partition
                            # | controller-kill | etcd-member-kill | etcd-pause
                            # or a list, e.g. [kill, hang, partition]: each firing picks one
    mode: one               # one | fixed | percent
    value: 1                # how many (fixed) or which share (percent) of the selected
    selector: {replicas: [r1, r2]}   # default: every replica of the job
    duration: 5s            # hang/slow only
    schedule: "@every 30s"  # or {mtbf: 30s} (Poisson arrivals), or omitted: once, now
    horizon: 300s           # how far ahead a schedule is expanded
    after_step: 0           # an order waits, past its time, until the job has reached this step
    seed: 0

``parse_spec`` validates (and says what is wrong) and ``expand`` turns a spec into timed orders
for named replicas, both pure; ``submit`` stores the orders in etcd under ``chaos/``. The agents
execute them (``agent.chaos``) and record each one's outcome.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import yaml

log = logging.getLogger(__name__)

REPLICA_ACTIONS = ("kill", "hang", "slow", "partition")
"""Executed by the agent of the targeted replica."""
HOST_ACTIONS = ("host-kill", "host-partition")
"""One node of a replica, as a machine fails: every process of the node, its agent included, at
once (down for the order's duration, then the host comes back); or its link cut while its
processes live on. Executed by whoever started the hosts (``ftsystem run --netns``)."""
SERVICE_ACTIONS = ("controller-kill", "etcd-member-kill", "etcd-pause")
"""Executed by whoever supervises the services (``ftsystem run``); they target no replica."""
ACTIONS = REPLICA_ACTIONS + HOST_ACTIONS + SERVICE_ACTIONS
NEEDS_DURATION = ("hang", "slow", "partition", "host-partition", "etcd-pause")
MODES = ("one", "fixed", "percent")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_ORDERS = 1000
"""A spec expanding to more orders than this is refused (a typo like '@every 1ms')."""
SLOW_PERIOD_S = 0.2
"""A slowed replica runs, then stops, within each period of this length."""


class ChaosSpecError(ValueError):
    """A malformed chaos spec; nothing was executed."""


MAX_DURATION_S = {"duration": 24 * 3600.0, "horizon": 30 * 24 * 3600.0}
"""The longest fault (24h) and schedule (30 days): beyond, a typo, not an experiment."""


def parse_duration(text: Any, what: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text) or text < 0:
            raise ChaosSpecError(f"{what}: {text!r} is not a finite, non-negative duration")
        seconds = float(text)
    else:
        match = _DURATION.match(str(text).strip())
        if not match:
            raise ChaosSpecError(f"{what}: {text!r} is not a duration; write e.g. 500ms, 30s, "
                                 "5m")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    most = MAX_DURATION_S.get(what)
    if most is not None and seconds > most:
        raise ChaosSpecError(f"{what}: at most {most / 3600:g}h, not {text!r}")
    return seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosSpec:
    actions: tuple[str, ...]
    """One action, or several: then each firing picks one (seeded)."""
    mode: str = "one"
    value: float = 1
    replicas: tuple[str, ...] = ()
    """Selector: the replicas to choose from; empty means all of the job's."""
    duration_s: float = 0.0
    every_s: float | None = None
    mtbf_s: float | None = None
    horizon_s: float = 300.0
    seed: int = 0
    slow_fraction: float = 0.5
    """For ``slow``: the share of each period the replica is stopped."""
    after_step: int = 0
    """Orders wait (past their time) until some replica has reached this step: faults hit a
    job that trains, however long it took to start."""


def parse_spec(text: str) -> ChaosSpec:
    """Parse and validate a YAML or JSON spec; raises :class:`ChaosSpecError` with the reason."""
    specs = parse_specs(text)
    if len(specs) != 1:
        raise ChaosSpecError(f"expected one spec, found {len(specs)} YAML documents")
    return specs[0]


def parse_specs(text: str) -> list[ChaosSpec]:
    """Every spec of a file: one, or several YAML documents separated by ``---``."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise ChaosSpecError(f"not YAML or JSON: {e}") from e
    if not documents or not all(isinstance(d, dict) for d in documents):
        raise ChaosSpecError("a chaos spec is a mapping with at least an 'action' key")
    specs = []
    for i, raw in enumerate(documents):
        try:
            specs.append(spec_from_mapping(raw))
        except ChaosSpecError as e:
            raise ChaosSpecError(f"spec {i + 1}: {e}" if len(documents) > 1 else str(e)) from e
    return specs


def spec_from_mapping(raw: Mapping[str, Any]) -> ChaosSpec:
    known = {"action", "mode", "value", "selector", "duration", "schedule", "horizon", "seed",
             "slow_fraction", "after_step"}
    if unknown := sorted(set(raw) - known):
        raise ChaosSpecError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    actions = _actions(raw.get("action"))
    mode = raw.get("mode", "one")
    if mode not in MODES:
        raise ChaosSpecError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    value = _number(raw.get("value", 100 if mode == "percent" else 1), "value")
    if (mode == "percent" and not 0 < value <= 100) or (mode == "fixed" and value < 1):
        raise ChaosSpecError(f"value {value} does not fit mode {mode}")
    duration = parse_duration(raw.get("duration", 0), "duration")
    if needing := [a for a in actions if a in NEEDS_DURATION and duration <= 0]:
        raise ChaosSpecError(f"action {needing[0]} needs a positive duration, e.g. duration: 5s")
    every, mtbf = _schedule(raw.get("schedule"))
    return ChaosSpec(actions=actions, mode=mode, value=value, replicas=_selector(raw),
                     duration_s=duration, every_s=every, mtbf_s=mtbf,
                     horizon_s=parse_duration(raw.get("horizon", "300s"), "horizon"),
                     seed=int(_number(raw.get("seed", 0), "seed")),
                     slow_fraction=_fraction(raw.get("slow_fraction", 0.5)),
                     after_step=_step(raw.get("after_step", 0)))


def _actions(action: Any) -> tuple[str, ...]:
    actions = tuple(action) if isinstance(action, list) else (action,)
    if not actions or any(not isinstance(a, str) or a not in ACTIONS for a in actions):
        raise ChaosSpecError(f"action must be one of {', '.join(ACTIONS)} or a list of them, "
                             f"not {action!r}")
    return actions


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ChaosSpecError(f"{what} must be a finite number, not {value!r}")
    return float(value)


def _step(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ChaosSpecError(f"after_step must be a whole number of steps >= 0, not {value!r}")
    return value


def _fraction(value: Any) -> float:
    fraction = _number(value, "slow_fraction")
    if not 0 < fraction < 1:
        raise ChaosSpecError(f"slow_fraction must be between 0 and 1, not {fraction}")
    return fraction


def _selector(raw: Mapping[str, Any]) -> tuple[str, ...]:
    from ftsystem.control.keys import InvalidIdError, check_id
    selector = raw.get("selector") or {}
    if not isinstance(selector, dict) or set(selector) - {"replicas"}:
        raise ChaosSpecError("selector supports {replicas: [ids...]} only")
    replicas = selector.get("replicas", [])
    if not isinstance(replicas, list):
        raise ChaosSpecError("selector.replicas must be a list of replica ids")
    try:
        return tuple(check_id("replica", str(r)) for r in replicas)
    except InvalidIdError as e:
        raise ChaosSpecError(f"selector: {e}") from e


def _schedule(schedule: Any) -> tuple[float | None, float | None]:
    if schedule is None:
        return None, None
    if isinstance(schedule, str) and schedule.startswith("@every "):
        every = parse_duration(schedule[len("@every "):], "schedule")
        if every <= 0:
            raise ChaosSpecError("schedule: @every needs a positive interval")
        return every, None
    if isinstance(schedule, dict) and set(schedule) == {"mtbf"}:
        mtbf = parse_duration(schedule["mtbf"], "schedule.mtbf")
        if mtbf <= 0:
            raise ChaosSpecError("schedule: mtbf must be positive")
        return None, mtbf
    raise ChaosSpecError(f"schedule must be '@every 30s' or {{mtbf: 30s}}, not {schedule!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Order:
    """One action on one replica at one time; stored at ``chaos/<id>``."""

    id: str
    action: str
    replica: str
    """The targeted replica; empty for a service action (``SERVICE_ACTIONS``)."""
    at: float
    """Unix time at which the agent acts."""
    duration_s: float = 0.0
    slow_fraction: float = 0.5
    node: int = 0
    """The node rank of a host action (``HOST_ACTIONS``)."""
    after_step: int = 0
    """Executed once the job has reached this step too (``ChaosSpec.after_step``)."""
    state: str = "pending"
    """pending | done | failed (set by the executing agent)."""
    outcome: str = ""
    executed_at: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: bytes | str) -> "Order":
        return cls(**json.loads(data))


def read_orders(items: Mapping[str, bytes]) -> list[Order]:
    """The well-formed orders among etcd ``items``, by the time they are due. Anything can be
    written to etcd directly: a malformed order is logged and skipped, so that it neither
    stops an agent's executor nor breaks the API and the status page for every other order."""
    orders = []
    for key, value in items.items():
        try:
            orders.append(Order.from_json(value))
        except (ValueError, TypeError) as e:
            log.warning("skipping the malformed chaos order %s: %s", key, e)
    return sorted(orders, key=lambda o: o.at)


def expand(spec: ChaosSpec, replicas: Sequence[str], *, now: float, name: str,
           nodes_per_replica: int = 1) -> list[Order]:
    """The orders of ``spec`` against the job's ``replicas``, from ``now`` over its horizon; a
    host action also picks one of the replica's nodes."""
    pool = [r for r in replicas if not spec.replicas or r in spec.replicas]
    if not pool:
        raise ChaosSpecError(f"the selector matches none of the job's replicas "
                             f"({', '.join(replicas) or 'none registered'})")
    rng = random.Random(spec.seed)
    orders = []
    for i, at in enumerate(_times(spec, now, rng)):
        action = spec.actions[0] if len(spec.actions) == 1 else rng.choice(spec.actions)
        targets = [""] if action in SERVICE_ACTIONS else _choose(spec, pool, rng)
        for replica in targets:
            node = rng.randrange(nodes_per_replica) if action in HOST_ACTIONS else 0
            suffix = f"-n{node}" if action in HOST_ACTIONS else ""
            orders.append(Order(id=f"{name}-{i:04d}-{replica or action}{suffix}", action=action,
                                replica=replica, at=at, duration_s=spec.duration_s,
                                slow_fraction=spec.slow_fraction, node=node,
                                after_step=spec.after_step))
        if len(orders) > MAX_ORDERS:
            raise ChaosSpecError(f"the spec makes more than {MAX_ORDERS} orders; select fewer "
                                 "replicas or fire less often")
    return orders


def _times(spec: ChaosSpec, now: float, rng: random.Random) -> list[float]:
    if spec.every_s is None and spec.mtbf_s is None:
        return [now]
    times, t = [], now
    while True:
        t += spec.every_s if spec.every_s is not None else rng.expovariate(1.0 / spec.mtbf_s)
        if t > now + spec.horizon_s:
            return times
        times.append(t)
        if len(times) > MAX_ORDERS:
            raise ChaosSpecError(f"the schedule makes more than {MAX_ORDERS} orders over its "
                                 "horizon: lengthen the interval or shorten the horizon")


def _choose(spec: ChaosSpec, pool: list[str], rng: random.Random) -> list[str]:
    count = {"one": 1, "fixed": int(spec.value),
             "percent": math.ceil(len(pool) * spec.value / 100)}[spec.mode]
    return sorted(rng.sample(pool, min(count, len(pool))))


def slow_pattern(duration_s: float, fraction: float) -> list[tuple[float, float]]:
    """(run, stop) seconds for each period of a ``slow`` action over ``duration_s``."""
    periods = max(1, round(duration_s / SLOW_PERIOD_S))
    stop = SLOW_PERIOD_S * fraction
    return [(SLOW_PERIOD_S - stop, stop)] * periods



async def submit(store, job: str, specs: ChaosSpec | Sequence[ChaosSpec], name: str, *,
                 now: float) -> list[Order]:
    """Expand ``specs`` against the job's replicas (those with an agent) and store the orders.

    The one I/O function of this module, shared by ``ftsystem chaos apply``, ``ftsystem run
    --chaos`` and ``POST /v1/jobs/{job}/chaos``; nothing is stored if any expansion fails.
    """
    from ftsystem.control import keys
    specs = [specs] if isinstance(specs, ChaosSpec) else list(specs)
    agents, _ = await store.get_prefix(keys.agents(job))
    replicas = sorted({keys.agent_replica(job, k) for k in agents})
    nodes = int((await store.get_json(keys.spec(job)) or {}).get("nodes_per_replica", 1))
    orders = [order for i, spec in enumerate(specs)
              for order in expand(spec, replicas, now=now, nodes_per_replica=nodes,
                                  name=name if len(specs) == 1 else f"{name}-s{i}")]
    for order in orders:
        await store.put(keys.chaos(job, order.id), order.to_json())
    return orders
