"""``ftsystem bench failover``: survivor stall per crash, ftsystem against torchft 0.2.0.

One invocation runs the same scenario on both systems: 4 replicas of the same model, step time
and data on loopback; one replica (the victim) is SIGKILLed from outside at a fixed interval,
each time after it has rejoined. Stall = the survivors' longest inter-commit gap around a
failure minus their normal step time (``ftsystem.stall``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from ftsystem import keys, report, stall
from ftsystem.cli import bench_app
from ftsystem.etcd_server import EmbeddedEtcd
from ftsystem.launcher import RunConfig, replica_id, run_job
from ftsystem.store import Store

VICTIM = 1
WARMUP_STEPS = 20


def _registration(etcd: str, job: str, rid: str) -> dict | None:
    async def read() -> dict | None:
        async with Store(etcd) as store:
            return await store.get_json(keys.replica(job, rid))
    return asyncio.run(read())


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"failover benchmark: timed out waiting for {what}")
        time.sleep(0.05)


def run_ftsystem(*, num_replicas: int, num_failures: int, steps: int, kill_interval_s: float,
                 sleep_per_step: float, model_params: int, workdir: Path) -> dict:
    """The scenario on ftsystem: ``run_job`` in a thread, kills from this one."""
    with EmbeddedEtcd(data_dir=workdir / "etcd") as etcd:
        cfg = RunConfig(num_replicas=num_replicas, num_steps=steps, etcd=etcd.url,
                        job="failover", out_dir=workdir / "run", show_progress=False,
                        train_args=["--sleep-per-step", str(sleep_per_step),
                                    "--model-params", str(model_params), "--loop", "plain"])
        summaries: list[dict] = []
        runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)), daemon=True)
        runner.start()
        victim = replica_id(VICTIM)
        kills = _kill_repeatedly(etcd.url, cfg.job, victim, num_failures, kill_interval_s,
                                 runner)
        runner.join()
    results = {p.stem: json.loads(p.read_text())
               for p in (workdir / "run" / "results").glob("*.json")}
    return _stalls({rid: r["commits"] for rid, r in results.items()}, kills, victim) | {
        "bitwise_identical": summaries[0]["bitwise_identical"] if summaries else None,
        "ettr_time": summaries[0]["ettr_time"] if summaries else None}


def _kill_repeatedly(etcd: str, job: str, victim: str, num_failures: int,
                     interval_s: float, runner: threading.Thread) -> list[float]:
    def member_at(generation: int) -> dict | None:
        reg = _registration(etcd, job, victim)
        ok = reg and reg["state"] == "member" and reg["generation"] == generation and \
            reg["step"] >= WARMUP_STEPS
        return reg if ok else None

    kills: list[float] = []
    for generation in range(num_failures):
        _wait(lambda: member_at(generation) or not runner.is_alive(), 300,
              f"{victim} generation {generation} to train")
        if not runner.is_alive():
            break
        time.sleep(max(0.0, (kills[-1] + interval_s if kills else 0) - time.time()))
        reg = member_at(generation)
        if reg is None:
            break
        os.kill(reg["pid"], signal.SIGKILL)
        kills.append(time.time())
    return kills


def run_torchft(*, num_replicas: int, num_failures: int, steps: int, kill_interval_s: float,
                sleep_per_step: float, model_params: int, workdir: Path) -> dict:
    from ftsystem.baselines.torchft_scenario import run_torchft_failover
    out = run_torchft_failover(num_replicas=num_replicas, num_failures=num_failures,
                               steps=steps, model_params=model_params or None,
                               workdir=workdir, kill_interval_s=kill_interval_s, victim=VICTIM,
                               sleep_per_step=sleep_per_step)
    timelines = {str(r["replica"]): r["commits"] for r in out["results"]}
    victim = next((rid for rid in timelines if rid.endswith(str(VICTIM))), str(VICTIM))
    return _stalls(timelines, out["failures"], victim) | {
        "crashed": out["crashed"], "settings": out["settings"]}


def _stalls(timelines: dict, kills: list[float], victim: str) -> dict:
    stalls = [s for t in kills if (s := stall.failure_stall(timelines, t, [victim])) is not None]
    survivors = [tl for rid, tl in timelines.items() if rid != victim]
    return {"failures": len(kills), "stall_s": stall.distribution(stalls),
            "per_failure_stall_s": stalls,
            "step_s": stall.distribution([stall.normal_step_time(t) for t in survivors])}


@bench_app.command("failover")
def failover(json_path: Optional[Path] = typer.Option(None, "--json", help="write results here"),
             quick: bool = typer.Option(False, help="2 failures instead of 5 (about 2 min)"),
             failures: int = typer.Option(0, help="override the number of failures"),
             kill_interval: float = typer.Option(8.0, help="seconds between kills"),
             sleep_per_step: float = typer.Option(0.05, help="emulated compute per step"),
             model_params: int = typer.Option(0, help="model size (0: the small default)"),
             skip_torchft: bool = typer.Option(False, help="run ftsystem only")) -> None:
    """Survivor stall per replica crash: ftsystem vs torchft 0.2.0, same scenario."""
    num_failures = failures or (2 if quick else 5)
    steps = int((num_failures + 2) * kill_interval / sleep_per_step)
    scenario = dict(num_replicas=4, num_failures=num_failures, steps=steps,
                    kill_interval_s=kill_interval, sleep_per_step=sleep_per_step,
                    model_params=model_params)
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-failover-") as tmp:
        ours = run_ftsystem(**scenario, workdir=Path(tmp) / "ftsystem")
        theirs = None if skip_torchft else run_torchft(**scenario, workdir=Path(tmp) / "torchft")
    data = {"scenario": scenario, "ftsystem": ours, "torchft": theirs,
            "median_stall_ratio_torchft_over_ftsystem": _ratio(theirs, ours),
            "target": "ftsystem median stall <= 0.5 s", "machine": report.machine()}
    rows = [(name, r["failures"], r["stall_s"]["median"], r["stall_s"]["max"],
             r["step_s"]["median"]) for name, r in (("ftsystem", ours), ("torchft", theirs)) if r]
    report.print_table("failover: survivor stall per crash",
                       ["system", "failures", "median stall (s)", "max stall (s)",
                        "normal step (s)"], rows)
    report.write_json(json_path, data)


def _ratio(theirs: dict | None, ours: dict) -> float | None:
    if not theirs or not theirs["stall_s"]["median"] or not ours["stall_s"]["median"]:
        return None
    return theirs["stall_s"]["median"] / ours["stall_s"]["median"]
