"""Disk checkpoints with real files: roundtrip, asynchronous save, torn checkpoints, retention,
a process SIGKILLed in the middle of a save, and two Gloo ranks saving FSDP2 shards."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ftsystem.training.checkpoint import (
    MARKER,
    CheckpointError,
    Checkpointer,
    Entry,
    MissingCheckpointError,
    TornCheckpointError,
    TrainingState,
    check_checkpointable,
    is_due,
    marker_problem,
    parse_entry,
    to_prune,
)
from ftsystem.control.etcd_server import free_port
from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT
from renaming_model import FusedPair

CFG = ModelConfig()  # the small default model: ~0.1M parameters
# DCP announces every single-process save and load; that is what these tests do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def build(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: TinyGPT, optimizer: torch.optim.Optimizer, steps: range, shard: int = 0
          ) -> None:
    language = MarkovLanguage(vocab_size=CFG.vocab_size, seed=0)
    for step in steps:
        optimizer.zero_grad()
        model.loss(language.batch(shard=shard, step=step, batch_size=4,
                                  seq_len=CFG.seq_len)).backward()
        optimizer.step()


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor by name (optimizer state keyed by parameter name)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    out = {f"model.{k}": v for k, v in model_state.items()}
    for name, state in optim_state["state"].items():
        out |= {f"optim.{name}.{k}": torch.as_tensor(v) for k, v in state.items()}
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), f"{name} differs"


def saved(tmp_path: Path, steps: list[int], **options) -> tuple[Checkpointer, dict]:
    """A checkpointer that saved at ``steps`` (training one step between saves)."""
    model, optimizer = build()
    ckpt = Checkpointer(tmp_path, interval_steps=1, **options)
    expected = {}
    for step in steps:
        train(model, optimizer, range(step - 1, step))
        assert ckpt.maybe_save(step, {"train": TrainingState(model, optimizer)})
        expected[step] = {k: v.clone() for k, v in tensors(model, optimizer).items()}
    ckpt.wait()
    return ckpt, expected


# --- pure logic -------------------------------------------------------------------------------

def test_names_retention_and_schedule() -> None:
    assert parse_entry("step-200") == Entry(200, False)
    assert parse_entry("step-200.tmp") == Entry(200, True)
    assert parse_entry("step-x") is None and parse_entry("latest") is None
    assert Entry(7, True).name == "step-7.tmp"
    assert to_prune([100, 300, 200, 400], keep=2) == [200, 100]
    assert to_prune([100], keep=3) == []
    assert [s for s in range(0, 301, 50) if is_due(s, 100, last_saved=100)] == [200, 300]


def test_marker_problems() -> None:
    marker = {"format": 2, "files": {"a.distcp": [10, 5], ".metadata": [3, 7]}}
    assert marker_problem(marker, {"a.distcp": (10, 5), ".metadata": (3, 7)}) is None
    assert marker_problem(marker, {"a.distcp": (10, None), ".metadata": (3, None)}) is None
    assert "no .complete marker" in marker_problem(None, {})
    assert "unreadable" in marker_problem({}, {})
    assert "missing" in marker_problem(marker, {"a.distcp": (10, 5)})
    assert "truncated" in marker_problem(marker, {"a.distcp": (4, 5), ".metadata": (3, 7)})
    assert "corrupt" in marker_problem(marker, {"a.distcp": (10, 6), ".metadata": (3, 7)})


# --- one process, real files ------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_roundtrip_is_bitwise_and_training_continues_identically(tmp_path: Path) -> None:
    model, optimizer = build()
    train(model, optimizer, range(3))
    with Checkpointer(tmp_path, interval_steps=3) as ckpt:
        assert not ckpt.maybe_save(2, {"train": TrainingState(model, optimizer)})
        assert ckpt.maybe_save(3, {"train": TrainingState(model, optimizer)})
    restored, restored_opt = build(seed=1)
    assert Checkpointer(tmp_path, 3).load({"train": TrainingState(restored, restored_opt)}) == 3
    assert_bitwise_equal(tensors(model, optimizer), tensors(restored, restored_opt))
    # Same next step from the same state: the optimizer's hyper-parameters came back too.
    train(model, optimizer, range(3, 5))
    train(restored, restored_opt, range(3, 5))
    assert_bitwise_equal(tensors(model, optimizer), tensors(restored, restored_opt))


@pytest.mark.timeout(120)
def test_async_save_holds_the_state_of_its_step(tmp_path: Path) -> None:
    model, optimizer = build()
    train(model, optimizer, range(1))
    at_save = {k: v.clone() for k, v in tensors(model, optimizer).items()}
    ckpt = Checkpointer(tmp_path, interval_steps=1)
    started = time.monotonic()
    assert ckpt.maybe_save(1, {"train": TrainingState(model, optimizer)})
    returned = time.monotonic() - started
    train(model, optimizer, range(1, 3))  # training goes on while the save is written
    assert ckpt.wait() == 1
    ckpt.close()
    assert (tmp_path / "step-1" / MARKER).is_file() and not (tmp_path / "step-1.tmp").exists()
    restored, restored_opt = build(seed=1)
    assert ckpt.load({"train": TrainingState(restored, restored_opt)}) == 1
    assert_bitwise_equal(at_save, tensors(restored, restored_opt))
    assert returned < 10, f"maybe_save blocked for {returned:.1f} s"


@pytest.mark.timeout(120)
def test_retention_keeps_the_newest_and_a_resumed_job_does_not_resave(tmp_path: Path) -> None:
    ckpt, _ = saved(tmp_path, [1, 2, 3, 4, 5], keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]
    assert ckpt.latest_complete() == 5
    model, optimizer = build()
    resumed = Checkpointer(tmp_path, interval_steps=1)
    assert resumed.load({"train": TrainingState(model, optimizer)}) == 5
    assert not resumed.maybe_save(5, {"train": TrainingState(model, optimizer)})


def test_nothing_to_load(tmp_path: Path) -> None:
    model, optimizer = build()
    ckpt = Checkpointer(tmp_path, interval_steps=10)
    assert ckpt.latest_complete() is None
    assert ckpt.load({"train": TrainingState(model, optimizer)}) is None
    with pytest.raises(MissingCheckpointError, match="no checkpoint step-10 .*complete ones: none"):
        ckpt.load({"train": TrainingState(model, optimizer)}, step=10)


def _drop_marker(path: Path) -> None:
    (path / MARKER).unlink()


def _truncate_data(path: Path) -> None:
    data = next(path.glob("*.distcp"))
    os.truncate(data, data.stat().st_size // 2)


def _flip_a_byte(path: Path) -> None:
    data = next(path.glob("*.distcp"))
    with data.open("r+b") as f:
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _delete_metadata(path: Path) -> None:
    (path / ".metadata").unlink()


def _back_to_tmp(path: Path) -> None:
    path.rename(path.with_name(path.name + ".tmp"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage, problem", [
    (_drop_marker, r"no \.complete marker: the save was interrupted"),
    (_truncate_data, r"file __0_0\.distcp is truncated or overwritten: \d+ bytes, \d+ written"),
    (_flip_a_byte, r"file __0_0\.distcp is corrupt: its SHA-256 differs from the one written"),
    (_delete_metadata, r"file \.metadata is missing"),
    (_back_to_tmp, r"a \.tmp directory: the save was interrupted before it finished"),
])
def test_torn_checkpoint_is_refused_and_skipped(tmp_path: Path, damage, problem: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    ckpt, expected = saved(tmp_path, [1, 2])
    damage(tmp_path / "step-2")
    model, optimizer = build(seed=1)
    name = "step-2.tmp" if damage is _back_to_tmp else "step-2"
    with pytest.raises(TornCheckpointError) as refused:
        ckpt.load({"train": TrainingState(model, optimizer)}, step=2)
    assert re.fullmatch(rf"checkpoint {re.escape(name)} in {re.escape(str(tmp_path))} is "
                        rf"incomplete \({problem}\); delete it or load step-1", str(refused.value))
    with caplog.at_level(logging.WARNING, logger="ftsystem.training.checkpoint"):
        assert ckpt.load({"train": TrainingState(model, optimizer)}) == 1
    assert f"skipping checkpoint {name}" in caplog.text
    assert_bitwise_equal(expected[1], tensors(model, optimizer))


def test_torn_without_a_fallback_says_so(tmp_path: Path) -> None:
    ckpt, _ = saved(tmp_path, [1])
    _drop_marker(tmp_path / "step-1")
    with pytest.raises(TornCheckpointError, match="there is no complete checkpoint to load"):
        ckpt.check(1)
    assert ckpt.latest_complete() is None


# --- a real process killed in the middle of a save ---------------------------------------------

def _save_then_die_mid_save(directory: str, writing: multiprocessing.Event) -> None:
    """Child: a complete save at step 1, then one at step 2 that stops after DCP wrote the
    data files and before its metadata (the parent SIGKILLs it there)."""
    torch.set_num_threads(1)
    model, optimizer = build()
    state = {"train": TrainingState(model, optimizer)}
    ckpt = Checkpointer(directory, interval_steps=1)
    ckpt.maybe_save(1, state)
    ckpt.wait()

    def stall(self, *args, **kwargs):
        writing.set()
        time.sleep(600)

    FileSystemWriter.finish = stall  # in this child only
    train(model, optimizer, range(1))
    ckpt.maybe_save(2, state)
    time.sleep(600)


@pytest.mark.timeout(180)
def test_process_killed_mid_save_leaves_no_loadable_checkpoint(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    writing = ctx.Event()
    child = ctx.Process(target=_save_then_die_mid_save, args=(str(tmp_path), writing))
    child.start()
    try:
        assert writing.wait(120), "the child never reached the middle of its second save"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2.tmp"]
    assert list((tmp_path / "step-2.tmp").glob("*.distcp")), "the kill came before any data"
    ckpt = Checkpointer(tmp_path, interval_steps=1)
    model, optimizer = build(seed=1)
    with pytest.raises(TornCheckpointError, match=r"step-2\.tmp .*interrupted.*load step-1"):
        ckpt.load({"train": TrainingState(model, optimizer)}, step=2)
    assert ckpt.latest_complete() == 1
    assert ckpt.load({"train": TrainingState(model, optimizer)}) == 1
    initial, _ = build()
    assert torch.equal(model.tok.weight, initial.tok.weight)
    # The next save at step 2 replaces the torn attempt.
    assert ckpt.maybe_save(2, {"train": TrainingState(model, optimizer)})
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


# --- two Gloo ranks, FSDP2 shards -------------------------------------------------------------

def _fsdp_ranks(rank: int, world: int, port: int, directory: str, full_path: str) -> None:
    """Child rank: train a sharded model, save, reload into a fresh sharded model, compare."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def sharded(seed: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
        model, _ = build(seed)
        for layer in model.blocks.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    try:
        model, optimizer = sharded(0)
        train(model, optimizer, range(2), shard=rank)
        with Checkpointer(directory, interval_steps=2) as ckpt:
            assert ckpt.maybe_save(2, {"train": TrainingState(model, optimizer)})
        full = get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, full_path)
        restored, restored_opt = sharded(1)
        assert Checkpointer(directory, 2).load({"train": TrainingState(restored,
                                                                       restored_opt)}) == 2
        for name, tensor in tensors(model, optimizer).items():
            mine = tensors(restored, restored_opt)[name]
            local = [t.to_local() if hasattr(t, "to_local") else t for t in (tensor, mine)]
            assert torch.equal(*local), f"rank {rank}: {name} differs after the reload"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_two_ranks_save_shards_that_reload_sharded_and_whole(tmp_path: Path) -> None:
    directory, full_path = tmp_path / "ckpt", tmp_path / "full.pt"
    torch.multiprocessing.spawn(_fsdp_ranks, args=(2, free_port(), str(directory),
                                                   str(full_path)), nprocs=2)
    assert sorted(p.name for p in (directory / "step-2").iterdir()) == [
        ".complete", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    # A cold start onto another layout: one process, no sharding, same bits.
    model, optimizer = build(seed=1)
    assert Checkpointer(directory, 2).load({"train": TrainingState(model, optimizer)}) == 2
    model_full, optim_full = torch.load(full_path, weights_only=False)
    expected = {f"model.{k}": v for k, v in model_full.items()}
    for name, state in optim_full["state"].items():
        expected |= {f"optim.{name}.{k}": torch.as_tensor(v) for k, v in state.items()}
    assert_bitwise_equal(expected, tensors(model, optimizer))


def test_a_model_whose_state_dict_renames_its_tensors_is_refused_before_a_save_fails() -> None:
    model = torch.nn.Sequential(FusedPair(), torch.nn.Linear(8, 2))
    with pytest.raises(AttributeError):  # what the first save would meet
        get_state_dict(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"2 tensors no module holds \(0.a.weight, 0.b.weight\)"
                                         ".*without a checkpoint policy"):
        check_checkpointable(model)
    check_checkpointable(build()[0])
    check_checkpointable(torch.compile(build()[0]))  # "_orig_mod." is a wrapper's, not a rename


# --- hostile checkpoints ------------------------------------------------------------------------

class _RunsCode:
    """What a forged pickle carries: a call made while it is unpickled."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


def _reseal(path: Path) -> None:
    """What a forger can do without the job's key: rewrite the marker to match the files."""
    from ftsystem.training.checkpoint import _write_marker
    step = int(path.name.split("-")[1])
    _write_marker(path, step, key=None)


def test_a_forged_metadata_file_runs_nothing_and_is_refused(tmp_path: Path) -> None:
    import pickle
    ckpt, _ = saved(tmp_path, [1])
    witness = tmp_path / "pwned"
    (tmp_path / "step-1" / ".metadata").write_bytes(pickle.dumps(_RunsCode(witness)))
    _reseal(tmp_path / "step-1")
    model, optimizer = build()
    with pytest.raises(CheckpointError, match=r"refuses posix\.system|refuses os\.system"):
        Checkpointer(tmp_path, 1).load({"train": TrainingState(model, optimizer)})
    assert not witness.exists()


def test_a_forged_value_in_a_data_file_runs_nothing(tmp_path: Path) -> None:
    # Non-tensor values (hyperparameters, registered objects' blobs) are pickles in the data
    # files: they are loaded as weights only.
    import io
    import pickle
    from ftsystem.training.checkpoint import SafeLoadPlanner
    witness = tmp_path / "pwned"
    planner = SafeLoadPlanner()
    with pytest.raises(CheckpointError, match="refus"):
        planner.load_bytes(None, io.BytesIO(pickle.dumps(_RunsCode(witness))))
    assert not witness.exists()


def test_a_signed_checkpoint_loads_only_with_its_jobs_key(tmp_path: Path) -> None:
    ckpt, expected = saved(tmp_path, [1], key="the job's key")
    model, optimizer = build()
    with pytest.raises(CheckpointError, match="not signed with this job's key"):
        Checkpointer(tmp_path, 1, key="another job's key").load(
            {"train": TrainingState(model, optimizer)}, step=1)
    assert Checkpointer(tmp_path, 1, key="the job's key").load(
        {"train": TrainingState(model, optimizer)}) == 1
    assert_bitwise_equal(tensors(model, optimizer), expected[1])
    _reseal(tmp_path / "step-1")  # a forger's marker: the files match, the signature is gone
    with pytest.raises(CheckpointError, match="not signed with this job's key"):
        Checkpointer(tmp_path, 1, key="the job's key").load(
            {"train": TrainingState(model, optimizer)}, step=1)
