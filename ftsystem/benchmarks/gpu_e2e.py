"""The main job on a GPU: ``python -m ftsystem.benchmarks.gpu_e2e --json P``.

``ftsystem run`` with three replicas on this machine's GPU, a kill between steps and a kill in
the middle of an all-reduce, once with the update log on the device and once on the host
(``FTSYSTEM_CATCHUP_LOG_PLACE``). The replicas share one GPU, and one GPU cannot hold two
ranks of an NCCL communicator, so their cross-replica groups use Gloo over CUDA tensors
(``FTSYSTEM_FTAR_BACKEND=gloo``); everything else (the model, the step, the snapshots, the
update log, the replays, the digests) runs on CUDA. Each run must end with every replica on
the GPU, at the last step, bitwise identical, with no divergence reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ftsystem.measure import report

JOB_ARGS = ["--replicas", "3", "--steps", "300", "--kill-at", "100:1",
            "--kill-at", "200:2:allreduce", "--model-params", "10000000",
            "--sleep-per-step", "0.01"]
RUN_TIMEOUT_S = 150


def run_job(place: str, workdir: Path) -> dict:
    env = {**os.environ, "FTSYSTEM_FTAR_BACKEND": "gloo", "FTSYSTEM_CATCHUP_LOG_PLACE": place}
    summary_path = workdir / "summary.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ftsystem.cli", "run", *JOB_ARGS,
                           "--out", str(workdir), "--json", str(summary_path)],
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out: dict = {"log_place": place, "args": JOB_ARGS, "exit_code": done.returncode,
                 "wall_s": time.monotonic() - started, "output_tail": done.stdout[-3000:] +
                 done.stderr[-3000:]}
    if summary_path.exists():
        out["summary"] = json.loads(summary_path.read_text())
    results = [json.loads(p.read_text()) for p in sorted((workdir / "results").glob("*.json"))]
    out["replicas"] = [{key: r.get(key) for key in ("replica", "generation", "step", "device",
                                                    "state_hash", "divergences", "catchup")}
                       for r in results]
    devices = {r.get("device", "") for r in results}
    out["ok"] = (done.returncode == 0 and len(results) == 3 and all(d.startswith("cuda")
                                                                    for d in devices)
                 and len({r["state_hash"] for r in results}) == 1
                 and not any(r.get("divergences") for r in results))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where the results go")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ftsystem-gpu-e2e"))
    args = parser.parse_args(argv)
    out: dict = {"machine": report.machine(), "runs": []}
    for place in ("device", "host"):
        try:
            run = run_job(place, args.workdir / place)
        except subprocess.TimeoutExpired as e:
            run = {"log_place": place, "ok": False, "error": f"timed out: {e}"}
        out["runs"].append(run)
        print(f"log on the {place}: {'ok' if run['ok'] else 'FAILED'}", flush=True)
    report.write_json(args.json, out)
    return 0 if all(run["ok"] for run in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
