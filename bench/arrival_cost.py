"""What an arrival mark costs the training thread: one ``TCPStore.set`` to a store in another process.

    .venv/bin/python bench/arrival_cost.py [--json bench/results/arrival_cost.json]

A member's rank 0 writes one mark per step (``FaultTolerantAllReduce.arrival``). The store is
served by a forked process, as ``members[0]`` serves it to the other members; the client writes
the same key as a member does, 2,000 times per round, 5 rounds, and reports the median latency
of a ``set`` per round and over the rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from datetime import timedelta

import torch.distributed as dist

ROUNDS, SETS = 5, 2000


def _serve(ports: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ports.put(store.port)
    stop.wait()


def measure() -> dict:
    ports, stop = multiprocessing.Queue(), multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(ports, stop))
    server.start()
    try:
        client = dist.TCPStore("127.0.0.1", ports.get(timeout=60), is_master=False,
                               timeout=timedelta(seconds=60))
        by_round = []
        for _ in range(ROUNDS):
            took = []
            for step in range(SETS):
                start = time.perf_counter()
                client.set("0", str(step))
                took.append(time.perf_counter() - start)
            by_round.append(statistics.median(took) * 1e6)
    finally:
        stop.set()
        server.join()
    return {"set_us": {"median": statistics.median(by_round), "min": min(by_round),
                       "max": max(by_round), "rounds": by_round},
            "sets_per_round": SETS, "what": "latency of one TCPStore.set (an arrival mark) "
            "on the training thread, store served by another process on loopback"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    out = measure()
    print(f"arrival mark (TCPStore.set): {out['set_us']['median']:.1f} us median "
          f"[{out['set_us']['min']:.1f}, {out['set_us']['max']:.1f}] over {ROUNDS} rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
