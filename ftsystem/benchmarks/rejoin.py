"""``ftsystem bench rejoin``: what a joining replica costs the members, as the model grows.

For each model size, the same scenario on three systems in one invocation: two members train;
a third replica is launched mid-run and joins. Measured: the members' stall (their longest
inter-commit gap from the joiner's launch to its first commit, minus their normal step time)
and the joiner's time from launch to its first commit.

- ``ftsystem``: non-blocking catch-up (snapshot + update log from a donor, then a join epoch);
- ``blocking``: the first issue's join: the whole state is broadcast inside the join epoch;
- ``torchft``: torchft 0.2.0 healing inside a quorum step.

Every system's joiner runs at the lowest CPU priority (``nice 19``). Replicas of a real job
run on hosts of their own; here three share two cores, and a joiner importing torch and
building its model would otherwise slow the members' compute by up to half, a cost of this
machine, not of any join protocol. What is left is the join's own cost: the donor serving its
state, the members' reconfiguration, the transfer inside the step (torchft).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from ftsystem import report, stall
from ftsystem.cli import bench_app
from ftsystem.etcd_server import EmbeddedEtcd
from ftsystem.launcher import ProcessGroup, RunConfig, agent_command, run_job
from ftsystem.store import Store

WARMUP_STEPS = 5
BATCH_SIZE, LR = 8, 1e-3  # torchft_replica's, so that both train the same thing
# (steps, emulated compute per step) per model size: enough steps to outlast the join.
JOINER_NICENESS = 19
PLANS = {1_000_000: (200, 0.05), 10_000_000: (60, 0.0), 100_000_000: (24, 0.0)}


def _members_step(etcd: str, job: str) -> int:
    import asyncio
    from ftsystem import keys

    async def read() -> int:
        async with Store(etcd) as store:
            items, _ = await store.get_prefix(keys.replicas(job))
        steps = [json.loads(v)["step"] for v in items.values()]
        return min(steps) if len(steps) >= 2 else 0
    return asyncio.run(read())


def run_ftsystem(*, params: int, steps: int, sleep: float, mode: str, workdir: Path) -> dict:
    """Two members via ``run_job``; a third agent launched once they are warm."""
    os.environ["FTSYSTEM_CATCHUP"] = mode  # inherited by every replica
    train_args = ["--model-params", str(params), "--batch-size", str(BATCH_SIZE),
                  "--lr", str(LR), "--sleep-per-step", str(sleep), "--loop", "plain"]
    with EmbeddedEtcd(data_dir=workdir / "etcd") as etcd:
        cfg = RunConfig(num_replicas=2, num_steps=steps, etcd=etcd.url, job="rejoin",
                        out_dir=workdir / "run", train_args=train_args, show_progress=False)
        runner = threading.Thread(target=run_job, args=(cfg,), daemon=True)
        runner.start()
        while _members_step(etcd.url, cfg.job) < WARMUP_STEPS:
            time.sleep(0.1)
        launched = time.time()
        extra = ProcessGroup(cfg.out_dir)
        joiner = extra.start("agent-r2", ["nice", "-n", str(JOINER_NICENESS),
                                          *agent_command(cfg, etcd.url, 2)])
        joiner.wait()
        runner.join()
    results = {p.stem: json.loads(p.read_text())
               for p in (cfg.out_dir / "results").glob("*.json")}
    return _measure({r: results[r]["commits"] for r in ("r0", "r1")},
                    results["r2"]["commits"], launched) | {"catchup": results["r2"]["catchup"]}


def run_torchft(*, params: int, steps: int, sleep: float, workdir: Path) -> dict:
    from ftsystem.baselines.torchft_scenario import run_torchft_rejoin
    out = run_torchft_rejoin(num_replicas=2, steps=steps, model_params=params, workdir=workdir,
                             join_after_s=0.0, sleep_per_step=sleep,
                             joiner_niceness=JOINER_NICENESS)
    by_index = {int(r["replica"]): r for r in out["results"]}
    members = {str(i): by_index[i]["commits"] for i in (0, 1)}
    return _measure(members, by_index[2]["commits"], out["join_started"]) | {
        "crashed": out["crashed"]}


def _measure(members: dict, joiner_commits: list, launched: float) -> dict:
    if not joiner_commits:
        return {"join_stall_s": None, "time_to_join_s": None, "step_s": None}
    joined = joiner_commits[0][1]
    stalls = [s for tl in members.values()
              if (s := stall.window_stall(tl, launched, joined)) is not None]
    return {"join_stall_s": max(stalls, default=None), "time_to_join_s": joined - launched,
            "step_s": stall.distribution([stall.normal_step_time(tl)
                                          for tl in members.values()])["median"]}


@bench_app.command("rejoin")
def rejoin(json_path: Optional[Path] = typer.Option(None, "--json", help="write results here"),
           quick: bool = typer.Option(False, help="1M and 10M parameters only (about 2 min)"),
           skip_torchft: bool = typer.Option(False, help="run ftsystem and blocking only")
           ) -> None:
    """Members' stall and joiner's time to join, ftsystem vs blocking vs torchft 0.2.0."""
    sizes = [s for s in PLANS if not quick or s < 100_000_000]
    rows, entries = [], []
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-rejoin-") as tmp:
        for params in sizes:
            steps, sleep = PLANS[params]
            if quick:
                steps = steps // 2
            entry = {"params": params}
            for name in ("ftsystem", "blocking"):
                mode = "nonblocking" if name == "ftsystem" else "blocking"
                entry[name] = run_ftsystem(params=params, steps=steps, sleep=sleep, mode=mode,
                                           workdir=Path(tmp) / f"{name}-{params}")
            if not skip_torchft:
                entry["torchft"] = run_torchft(params=params, steps=steps, sleep=sleep,
                                               workdir=Path(tmp) / f"torchft-{params}")
            entry["step_s"] = entry["ftsystem"]["step_s"]
            entries.append(entry)
            rows += [(params, name, r["step_s"], r["join_stall_s"], r["time_to_join_s"])
                     for name, r in entry.items() if isinstance(r, dict)]
    os.environ.pop("FTSYSTEM_CATCHUP", None)
    report.print_table("rejoin: members' stall and joiner's time to join",
                       ["params", "system", "normal step (s)", "join stall (s)",
                        "time to join (s)"], rows)
    report.write_json(json_path, {
        "sizes": entries, "target": "ftsystem join_stall_s <= step_s at every size",
        "batch_size": BATCH_SIZE, "joiner_niceness": JOINER_NICENESS,
        "machine": report.machine()})
