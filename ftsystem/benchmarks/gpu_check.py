"""Checks of the CUDA paths on a machine with one GPU: ``python -m ftsystem.benchmarks.gpu_check --json P``.

What a GPU changes is the data plane only, and one GPU cannot hold several NCCL ranks of one
communicator, so the checks are:

- ``snapshot_copy``: the donor's snapshot of CUDA state (``snapshot.host_copy``: asynchronous
  device-to-host copies into pinned memory on a side stream), its bandwidth and exactness, and
  how long the training stream's queued work is delayed by it (it should not be);
- ``nccl_single_rank``: torchft's ``ProcessGroupNCCL`` configured through a store as FTAR does,
  with one rank, an all-reduce of CUDA tensors, an abort, and a reconfiguration;
- ``gloo_cuda_two_replicas``: two processes (two replicas on one GPU) configure torchft's
  ``ProcessGroupGloo`` and all-reduce CUDA tensors;
- ``ftar_nccl_single_rank``: ``FaultTolerantAllReduce`` itself for CUDA tensors (it picks
  ``ProcessGroupNCCL``): an epoch of one member, an all-reduce through its interruptible wait,
  a newer epoch that aborts the old group, and an all-reduce in the new one. Its control plane
  is a stand-in holding the epochs (there is no etcd on the GPU machine).
- ``ftar_nccl_wait``: FTAR's wait on real NCCL, with the collective queued behind most of a
  second of matrix products: NCCL's bare future completes before the data is there (recorded, the
  reason for the check), FTAR's wait returns only once it is (the stream is idle when it
  returns, without a synchronize), and an abort of the group after the future (what torchft's
  timeout does) fails the wait with ``CollectiveFailed``. It runs in a process of its own:
  an aborted communicator can leave a broken CUDA context behind.
- ``ftar_wait_beside_copy``: FTAR's wait for a small all-reduce while a 2 GB snapshot copy runs
  on a side stream returns without waiting for the copy (torchft's ``errored()``, timed beside
  it, synchronizes the calling thread's current stream, not the side one);
- ``pinned_memory_released``: the pinned memory of a snapshot copy goes back once it is freed;
- ``update_log_on_host``: the update log on the host copies GPU averages on a side stream,
  exactly.

Each check records ok, seconds and details; the JSON also states the machine. ``--checks``
runs some of them (to rerun one within a short loan of a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ftsystem.measure import report
from ftsystem.training.snapshot import host_copy
from ftsystem.training.wire import tree_tensors
from ftsystem.training.devices import local_device, use_device
from ftsystem.control.membership import Epoch

SNAPSHOT_BYTES = 2 << 30
ALLREDUCE_ELEMENTS = 16 << 20
BUSY_PRODUCTS = 40
"""8192x8192 matrix products queued ahead of a collective: most of a second of GPU work."""
CHILD_TIMEOUT_S = 300


def check_snapshot_copy() -> dict:
    state = {f"p{i}": torch.randn(SNAPSHOT_BYTES // 8 // 4, device="cuda") for i in range(8)}
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    started = time.perf_counter()
    for _ in range(20):  # queued training work the copy must wait for, then overlap with
        busy = busy @ busy / 4096
    copied: dict = {}
    thread = threading.Thread(target=lambda: copied.update(host_copy(state)))
    thread.start()
    launch_s = time.perf_counter() - started  # the training thread is free to go on
    thread.join()
    copy_s = time.perf_counter() - started
    torch.cuda.synchronize()
    exact = all(torch.equal(a.cpu(), b) for a, b in zip(tree_tensors(state),
                                                          tree_tensors(copied)))
    pinned = all(t.is_pinned() for t in tree_tensors(copied))
    return {"ok": exact and pinned, "bytes": SNAPSHOT_BYTES, "seconds": copy_s,
            "gb_per_s": SNAPSHOT_BYTES / copy_s / 1e9, "pinned": pinned, "exact": exact,
            "training_thread_blocked_s": launch_s}


def check_nccl_single_rank() -> dict:
    from torchft.process_group import ProcessGroupNCCL
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=60))
    times = []
    for epoch in range(2):  # configure, all-reduce, abort, then again: what FTAR does
        started = time.perf_counter()
        pg.configure(f"127.0.0.1:{store.port}/nccl/{epoch}", "gpu-check", 0, 1)
        tensor = torch.ones(ALLREDUCE_ELEMENTS, device="cuda")
        pg.allreduce([tensor], dist.AllreduceOptions()).wait()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        ok = bool(torch.all(tensor == 1))
        pg.abort()
    return {"ok": ok, "configure_allreduce_s": times}


def _gloo_worker(rank: int, port: int, results) -> None:
    from torchft.process_group import ProcessGroupGloo
    use_device(local_device())  # both replicas: LOCAL_RANK 0 of their own, the one GPU
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(f"127.0.0.1:{port}/gloo", f"replica{rank}", rank, 2)
    tensor = torch.full((ALLREDUCE_ELEMENTS,), float(rank + 1), device="cuda")
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    started = time.perf_counter()
    pg.allreduce([tensor], opts).wait()
    torch.cuda.synchronize()
    results[rank] = (bool(torch.all(tensor == 3.0)), time.perf_counter() - started)


def check_gloo_cuda_two_replicas() -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.Manager().dict()
    mp.spawn(_gloo_worker, args=(store.port, results), nprocs=2, join=True)
    return {"ok": all(ok for ok, _ in results.values()),
            "allreduce_s": [s for _, s in results.values()], "bytes": ALLREDUCE_ELEMENTS * 4}


@dataclass
class _Epochs:
    """What FTAR reads from its control plane: the job, this replica, the newest epoch."""

    epoch: Epoch
    ctx: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(job="gpu-check", replica_id="r0"))


def _one_member_ftar(timeout_s: float):
    """FTAR for this process's GPU, its control-plane stand-in, and the store it meets in."""
    from ftsystem.training.ftar import FaultTolerantAllReduce
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control = _Epochs(_one_member_epoch(1, store))
    use_device(local_device())
    ftar = FaultTolerantAllReduce(control, timeout_s=timeout_s, device=local_device())
    return ftar, control, store


def _one_member_epoch(number: int, store: dist.TCPStore) -> Epoch:
    return Epoch(number=number, members=("r0",), store_addr=f"127.0.0.1:{store.port}")


def check_ftar_nccl_single_rank() -> dict:
    from torchft.process_group import ProcessGroupNCCL
    ftar, control, store = _one_member_ftar(timeout_s=60)
    times, ok = [], True
    for number in (1, 2):  # the second configure aborts the first epoch's group
        control.epoch = _one_member_epoch(number, store)
        started = time.perf_counter()
        ftar.configure(control.epoch)
        tensor = torch.full((ALLREDUCE_ELEMENTS,), 2.0, device=ftar.device)
        ftar.allreduce_sum(tensor)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        ok = ok and isinstance(ftar._pg, ProcessGroupNCCL) and bool(torch.all(tensor == 2))
    ftar.shutdown()
    return {"ok": ok, "configure_allreduce_s": times}


def _queue_busy_work() -> None:
    """Queue GPU work on the current stream and return at once: a collective issued next
    waits for it (NCCL's stream waits for the issuing one)."""
    busy = torch.randn(8192, 8192, device=local_device())
    for _ in range(BUSY_PRODUCTS):
        busy = busy @ busy / 8192


def _ftar_nccl_wait(result) -> None:
    """``check_ftar_nccl_wait``'s body, in its own process; fills ``result`` as it goes."""
    from ftsystem.training.ftar import CollectiveFailed
    ftar, control, _store = _one_member_ftar(timeout_s=30)
    ftar.configure(control.epoch)
    stream = torch.cuda.current_stream(ftar.device)
    tensor = torch.full((ALLREDUCE_ELEMENTS,), 2.0, device=ftar.device)
    _queue_busy_work()
    future = ftar.allreduce_sum_async(tensor)
    future.wait()  # what FTAR's wait did before: NCCL's future is done once queued
    result["bare_future_before_data"] = not stream.query()
    torch.cuda.synchronize()
    _queue_busy_work()
    started = time.perf_counter()
    ftar.wait(ftar.allreduce_sum_async(tensor))
    result["ftar_wait_s"] = time.perf_counter() - started
    result["ftar_wait_returned_with_data"] = stream.query()  # no synchronize in between
    result["exact"] = bool(torch.all(tensor == 2.0))  # a sum over one member
    _queue_busy_work()
    future = ftar.allreduce_sum_async(tensor)
    ftar._pg.abort()  # what torchft's timeout does, reported by errored() after the future
    try:
        ftar.wait(future)
        result["abort_after_future"] = "wait returned"
    except CollectiveFailed as e:
        result["abort_after_future"] = f"CollectiveFailed: {e}"
    ftar.shutdown()
    result["ok"] = (result["ftar_wait_returned_with_data"] and result["exact"]
                    and "failed on the device" in result["abort_after_future"])


def _fill_in_child(body: Callable[[dict], None], result) -> None:
    try:
        body(result)
    except Exception as e:  # reported like an in-process check's failure
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-2000:]


def _in_child(body: Callable[[dict], None]) -> dict:
    """Run ``body`` in a process of its own, which fills in the result as it goes: a broken
    CUDA context (an abort can leave one) costs this check only, and keeps what it found."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        result = manager.dict()
        child = ctx.Process(target=_fill_in_child, args=(body, result))
        child.start()
        child.join(CHILD_TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()
        out = dict(result)
    if child.exitcode != 0:
        out["error"] = out.get("error", f"the check's process ended with {child.exitcode}")
    out["ok"] = bool(out.get("ok")) and "error" not in out
    return out


def check_ftar_nccl_wait() -> dict:
    return _in_child(_ftar_nccl_wait)


def _side_copy(nbytes: int) -> tuple[torch.cuda.Stream, dict]:
    """Queue a device-to-host copy of ``nbytes`` on a side stream (a donor's snapshot)."""
    source = torch.randn(nbytes // 4, device=local_device())
    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host.copy_(source, non_blocking=True)
    return side, {"source": source, "host": host}


def _ftar_wait_beside_copy(result) -> None:
    """``check_ftar_wait_beside_copy``'s body, in its own process."""
    from torchft.process_group import ProcessGroupNCCL
    ftar, control, _store = _one_member_ftar(timeout_s=60)
    ftar.configure(control.epoch)
    tensor = torch.full((1 << 20,), 2.0, device=ftar.device)
    ftar.allreduce_sum(tensor)  # warm: the communicator's first collective sets it up
    torch.cuda.synchronize()
    side, keep = _side_copy(SNAPSHOT_BYTES)
    started = time.perf_counter()
    ftar.allreduce_sum(tensor)
    result["ftar_wait_s"] = time.perf_counter() - started
    result["copy_still_running_at_return"] = not side.query()
    side.synchronize()
    result["copy_s"] = time.perf_counter() - started
    side, keep = _side_copy(SNAPSHOT_BYTES)
    started = time.perf_counter()
    ProcessGroupNCCL.errored(ftar._pg)  # torchft's own: synchronizes the device
    result["torchft_errored_s"] = time.perf_counter() - started
    result["torchft_errored_waited_for_copy"] = side.query()
    del keep
    ftar.shutdown()
    result["ok"] = result["copy_still_running_at_return"] and bool(torch.all(tensor == 2.0))


def check_ftar_wait_beside_copy() -> dict:
    """FTAR's wait for a small all-reduce while a 2 GB snapshot copy runs on a side stream:
    it returns once its own data is there, without waiting for the copy. torchft's
    ``errored()`` is timed beside it: it synchronizes the current stream only."""
    return _in_child(_ftar_wait_beside_copy)


def _host_reserved() -> int:
    """Pinned bytes the host allocator holds from CUDA, in use or cached."""
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def check_pinned_memory_released() -> dict:
    """A donor's snapshot copy is pinned host memory: once the snapshot is freed, the host
    allocator's cache gives it back."""
    from ftsystem.training.snapshot import Snapshotter
    state = {"w": torch.randn(SNAPSHOT_BYTES // 4 // 4, device=local_device())}
    snapshotter = Snapshotter(lambda: state)
    before = _host_reserved()
    snapshotter.request()
    snapshotter.after_commit(1)
    snapshotter.before_mutation()  # waits for the copy
    held = _host_reserved()
    snapshotter.free()
    after = _host_reserved()
    nbytes = SNAPSHOT_BYTES // 4
    stats = {k: v for k, v in torch.cuda.host_memory_stats().items() if k.endswith("current")}
    return {"ok": held - before >= nbytes and after - before < nbytes // 2,
            "host_memory_stats_after_free": stats, "snapshot_bytes": nbytes, "reserved_before": before, "reserved_with_snapshot": held,
            "reserved_after_free": after}


def check_update_log_on_host() -> dict:
    """The update log on the host: an appended GPU average is copied to pinned memory on a
    thread and a side stream of their own (append returns at once), exactly."""
    from ftsystem.training.fingerprint import GENESIS
    from ftsystem.training.update_log import LoggedUpdate, UpdateLog
    log = UpdateLog(budget_bytes=4 * SNAPSHOT_BYTES, on_host=True)
    grads = [torch.randn(SNAPSHOT_BYTES // 4 // 4, device=local_device()) for _ in range(3)]
    torch.cuda.synchronize()
    appends = []
    for step, grad in enumerate(grads, start=1):
        started = time.perf_counter()
        log.append(step, LoggedUpdate(grad, GENESIS, GENESIS))
        appends.append(time.perf_counter() - started)
    started = time.perf_counter()
    log.wait_for_copies()
    read_s = time.perf_counter() - started
    entries = log.entries()
    exact = all(torch.equal(u.grad, g.cpu()) for (_, u), g in zip(entries, grads))
    on_host = all(not u.grad.is_cuda and u.grad.is_pinned() for _, u in entries)
    return {"ok": exact and on_host and len(entries) == 3, "exact": exact, "pinned": on_host,
            "append_s": appends, "copies_done_s_after_last_append": read_s, "entry_bytes": SNAPSHOT_BYTES // 4}


CHECKS = {"snapshot_copy": check_snapshot_copy, "nccl_single_rank": check_nccl_single_rank,
          "gloo_cuda_two_replicas": check_gloo_cuda_two_replicas,
          "ftar_nccl_single_rank": check_ftar_nccl_single_rank,
          "ftar_nccl_wait": check_ftar_nccl_wait,
          "ftar_wait_beside_copy": check_ftar_wait_beside_copy,
          "pinned_memory_released": check_pinned_memory_released,
          "update_log_on_host": check_update_log_on_host}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where the results go")
    parser.add_argument("--checks", default=",".join(CHECKS), help="the checks to run, "
                        f"comma-separated (default: all of {', '.join(CHECKS)})")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.checks.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"--checks: no check named {', '.join(unknown)}; "
                     f"the checks are {', '.join(CHECKS)}")
    out: dict = {"machine": report.machine(), "cuda": torch.cuda.is_available()}
    if not out["cuda"]:
        out["reason"] = "no CUDA device: run this on a GPU machine"
        args.json.write_text(json.dumps(out, indent=2))
        print(out["reason"], file=sys.stderr)
        return 2
    out["device"] = torch.cuda.get_device_name()
    for name in names:
        started = time.perf_counter()
        try:
            out[name] = CHECKS[name]()
        except Exception as e:  # a failed check is a result too; the others still run
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
        out[name]["wall_s"] = time.perf_counter() - started
        print(f"{name}: {'ok' if out[name]['ok'] else 'FAILED'}", flush=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0 if all(out[name]["ok"] for name in names) else 1


if __name__ == "__main__":
    sys.exit(main())
