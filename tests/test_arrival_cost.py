"""bench/arrival_cost.py runs and writes the latency of an arrival mark."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_arrival_cost_writes_positive_latencies(tmp_path):
    out = tmp_path / "arrival.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "arrival_cost.py"), "--json", str(out)],
                   check=True, timeout=120)
    figures = json.loads(out.read_text())["set_us"]
    assert len(figures["rounds"]) == 5
    assert 0 < figures["min"] <= figures["median"] <= figures["max"]
