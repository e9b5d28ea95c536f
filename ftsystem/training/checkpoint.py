"""Disk checkpoints for cold starts, written with ``torch.distributed.checkpoint`` (DCP).

Catch-up from a peer covers the loss of some replicas; when every replica has died the job
restarts from disk. :class:`Checkpointer` saves every ``interval_steps`` in the background and
loads the newest checkpoint that is *complete*:

.. code-block:: python

    ckpt = Checkpointer("ckpt/", interval_steps=100, keep=3)
    state = {"train": TrainingState(model, optimizer)}
    step = ckpt.load(state) or 0                    # None: nothing to resume from
    while step < num_steps:
        ...                                         # one training step
        step += 1
        ckpt.maybe_save(step, state)                # returns at once; writes in the background
    ckpt.close()                                    # waits for the last save

Layout of ``directory``::

    step-100/            complete: DCP's files + a ``.complete`` marker (sizes, SHA-256s,
                         signed with the job's key)
    step-200.tmp/        being written, or torn by a crash: never loaded

A save is written to ``step-<N>.tmp/``; only once DCP has finished every rank's files does the
coordinator (rank 0 of the group) write the marker and rename the directory to ``step-<N>/``
(atomic on POSIX), so a crash at any moment leaves no complete-looking checkpoint. A checkpoint
whose marker is missing, whose files are missing or differ from what the marker records, or
that still has the ``.tmp`` suffix is torn: asked for by step it raises
:class:`TornCheckpointError`; while looking for the newest one it is skipped with a warning.

A checkpoint is read by something that unpickles: DCP's metadata and the non-tensor values of
its data files. Nothing it holds runs code: the metadata is read by an unpickler that knows only
DCP's own classes (:class:`SafeFileSystemReader`), values are loaded as weights only
(:class:`SafeLoadPlanner`), and with a ``key`` (the replicas' key, which their agent derives
from the job's token) the marker is signed: a checkpoint another job wrote, or anyone without
the key, is refused before a byte of it is read (:class:`UntrustedCheckpointError`).

Several ranks (FSDP shards of one replica) save into one directory, which must then be on a
filesystem they share. DCP runs its collectives from a background thread, so it gets a Gloo group
of its own (created from the default group when none is given): sharing a group with the
training collectives would interleave the two threads' collectives differently on each rank.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ftsystem.training import carriable
from ftsystem.training.shards import canonical_name, model_tensors

log = logging.getLogger(__name__)

MARKER = ".complete"
"""Written last, inside the directory: its presence (and agreement with the files) is what makes
a checkpoint complete."""
TMP_SUFFIX = ".tmp"
MARKER_FORMAT = 2
"""2: SHA-256 of every file and an HMAC of the marker (1 had CRC32s, which anyone can forge)."""
SIGNED_FIELDS = ("format", "step", "files")
_NAME = re.compile(r"^step-(\d+)(\.tmp)?$")
_CHUNK = 16 << 20
# DCP warns on every single-process save and load that it assumes a single process; that is
# exactly what no_dist asks for, so the warning would only hide real ones.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, saved or loaded."""


class TornCheckpointError(CheckpointError):
    """The requested checkpoint is incomplete (an interrupted save, missing or damaged files)."""


class MissingCheckpointError(CheckpointError):
    """No checkpoint of the requested step exists."""


class UntrustedCheckpointError(CheckpointError):
    """The checkpoint is not signed with this job's key, or holds what a checkpoint never
    holds: it was written by another job, or forged. Nothing of it was loaded."""


# --- pure logic -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Entry:
    """A directory entry that names a checkpoint: ``step-<N>`` or ``step-<N>.tmp``."""

    step: int
    tmp: bool

    @property
    def name(self) -> str:
        return step_name(self.step) + (TMP_SUFFIX if self.tmp else "")


def step_name(step: int) -> str:
    return f"step-{step}"


def parse_entry(name: str) -> Entry | None:
    """The checkpoint a directory name stands for, or None for anything else."""
    match = _NAME.match(name)
    return Entry(int(match.group(1)), bool(match.group(2))) if match else None


def marker_problem(marker: dict | None, observed: dict[str, tuple[int, str | None]]) -> str | None:
    """What makes a checkpoint torn, or None when it is complete.

    ``marker``: the parsed ``.complete`` file (None: absent); ``observed``: file name ->
    (size, SHA-256 or None when checksums are not verified) of the files present.
    """
    if marker is None:
        return f"no {MARKER} marker: the save was interrupted"
    files = marker.get("files")
    if marker.get("format") != MARKER_FORMAT or not isinstance(files, dict) or not files \
            or not all(isinstance(v, list) and len(v) == 2 for v in files.values()):
        return (f"its {MARKER} marker is unreadable, or of format {marker.get('format')!r} "
                f"(this version reads {MARKER_FORMAT})")
    for name, (size, digest) in sorted(files.items()):
        if name not in observed:
            return f"file {name} is missing"
        seen_size, seen_digest = observed[name]
        if seen_size != size:
            return f"file {name} is truncated or overwritten: {seen_size} bytes, {size} written"
        if seen_digest is not None and seen_digest != digest:
            return f"file {name} is corrupt: its SHA-256 differs from the one written"
    return None


def marker_mac(marker: dict, key: str) -> str:
    """The marker's signature: an HMAC over what it says of the files."""
    signed = json.dumps({k: marker.get(k) for k in SIGNED_FIELDS}, sort_keys=True)
    return hmac.new(key.encode(), signed.encode(), hashlib.sha256).hexdigest()


def signature_problem(marker: dict, key: str | None) -> str | None:
    """Why the marker is not this job's, or None. Without a key nothing can be checked."""
    if key is None:
        return None
    mac = marker.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, marker_mac(marker, key)):
        return ("it is not signed with this job's key: another job wrote it, or it was "
                "forged. Loading it would read pickles from it, so it is refused: point the "
                "job at its own checkpoints, or delete this one")
    return None


def torn_message(directory: Path, name: str, problem: str, fallback: int | None) -> str:
    """The error for a torn checkpoint: what is wrong, and what to do instead."""
    advice = (f"delete it or load {step_name(fallback)}" if fallback is not None else
              "delete it; there is no complete checkpoint to load instead")
    return f"checkpoint {name} in {directory} is incomplete ({problem}); {advice}"


def to_prune(complete: list[int], keep: int) -> list[int]:
    """The complete steps that retention deletes: all but the ``keep`` newest."""
    return sorted(complete, reverse=True)[keep:]


def is_due(step: int, interval_steps: int, last_saved: int) -> bool:
    """Whether ``maybe_save`` saves at ``step``: a positive multiple of the interval, newer
    than the last checkpoint (a job resumed from step N does not save N again)."""
    return step > 0 and step % interval_steps == 0 and step > last_saved


# --- the state of a training process -----------------------------------------------------------

class TrainingState:
    """A model and its optimizer as one DCP ``Stateful`` (``{"model": ..., "optim": ...}``).

    ``get_state_dict``/``set_state_dict`` key the optimizer state by parameter name and keep
    FSDP2 parameters as DTensors, so DCP saves each rank's shard and can load them into another
    sharding (or none) later.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def check_checkpointable(model: torch.nn.Module) -> None:
    """Refuse a model whose ``state_dict()`` holds names no module has: a hook that renames or
    splits tensors (torchtitan's fused QKV projection saves its one weight as ``wq``, ``wk``
    and ``wv``). :class:`TrainingState` reads the model through DCP's ``get_state_dict``, which
    looks every name up on the modules and fails on these at the first save."""
    held = set(model_tensors(model))
    renamed = sorted(name for name in map(canonical_name, model.state_dict()) if name not in held)
    if renamed:
        shown = ", ".join(renamed[:3]) + (", ..." if len(renamed) > 3 else "")
        raise ValueError(
            f"disk checkpoints cannot hold this model: its state_dict() names {len(renamed)} "
            f"tensors no module holds ({shown}), "
            "which torch.distributed.checkpoint cannot resolve. Run the job without a "
            "checkpoint policy (the replicas still recover from each other), or give the model "
            "a state_dict() under its modules' own names")


# --- file system --------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _observe(path: Path, checksums: bool) -> dict[str, tuple[int, str | None]]:
    """(size, SHA-256) of every file in ``path`` but the marker."""
    return {f.name: (f.stat().st_size, _sha256(f) if checksums else None)
            for f in path.iterdir() if f.is_file() and f.name != MARKER}


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # present but unreadable: marker_problem says so


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(path: Path, step: int, key: str | None) -> None:
    """Record every file DCP wrote (size and SHA-256), signed with ``key``, durably, inside
    ``path``."""
    files = {name: list(v) for name, v in _observe(path, checksums=True).items()}
    marker = {"format": MARKER_FORMAT, "step": step, "time": time.time(), "files": files}
    if key is not None:
        marker["mac"] = marker_mac(marker, key)
    with (path / MARKER).open("w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())


# --- reading without running code ---------------------------------------------------------------

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""What DCP's metadata is made of, and all that its unpickler may construct."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or \
                (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(
            f"the checkpoint's metadata refuses {module}.{name}: DCP's metadata holds only "
            "its own classes, so this checkpoint was forged or damaged; delete it")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader of a directory, with the metadata read by an unpickler that constructs
    nothing but DCP's own metadata classes (DCP's own uses ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except UntrustedCheckpointError:
                raise
            except Exception as e:
                raise UntrustedCheckpointError(f"the checkpoint's metadata {path} is not DCP "
                                               f"metadata ({e}): delete it") from None
        if not isinstance(metadata, dcp.Metadata):
            raise UntrustedCheckpointError(f"the checkpoint's metadata {path} is a "
                                           f"{type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, with the non-tensor values of a checkpoint (hyperparameters, registered
    objects' states) loaded as weights only (DCP's own unpickles them whole)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = carriable.load(value)
        except Exception as e:
            raise UntrustedCheckpointError(
                f"a value in the checkpoint refuses to load as weights only ({e}): the "
                "checkpoint was forged or damaged; delete it") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# --- the checkpointer ---------------------------------------------------------------------------

class Checkpointer:
    """Asynchronous DCP checkpoints every ``interval_steps`` in ``directory``; loads the newest
    complete one.

    ``keep``: how many complete checkpoints to keep (the newest). ``process_group``: the ranks
    that save one sharded state together; None uses a new Gloo group over the default group when
    torch.distributed is initialized, and a single process otherwise. ``verify_checksums``:
    compare the SHA-256 of every file with the marker before loading (reads the files once
    more; the metadata's is compared always). ``key``: signs the markers written, and only
    checkpoints signed with it are loaded; None (a job run ``--insecure``): unsigned.
    """

    def __init__(self, directory: str | os.PathLike, interval_steps: int, *, keep: int = 3,
                 process_group: dist.ProcessGroup | None = None,
                 verify_checksums: bool = True, key: str | None = None) -> None:
        if interval_steps < 1 or keep < 1:
            raise ValueError(f"interval_steps ({interval_steps}) and keep ({keep}) must be >= 1")
        self.directory = Path(directory)
        self.interval_steps, self.keep = interval_steps, keep
        self.verify_checksums = verify_checksums
        self.key = key
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group = process_group
        if self._distributed and process_group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank builds one
        self._coordinator = not self._distributed or dist.get_rank(self._group) == 0
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftsystem-ckpt")
        self._pending: Future | None = None
        self._pending_step = -1
        self.directory.mkdir(parents=True, exist_ok=True)
        self.last_saved = 0
        """The step of the last save started or checkpoint loaded: the next save is newer."""
        self.failed_saves: list[tuple[int, str]] = []
        """(step, error) of saves that failed; training went on without them."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- saving ---------------------------------------------------------------------------

    def maybe_save(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Start an asynchronous save of ``state_dict`` at ``step`` if one is due.

        Waits for the previous save first (one at a time: two would hold two staged copies
        and race for the disk). The state is copied before this returns, so training may
        modify it at once. Returns whether a save started. A failed save is logged and
        recorded in ``failed_saves``; training goes on from the previous complete checkpoint.
        """
        if not is_due(step, self.interval_steps, self.last_saved):
            return False
        self._settle()
        tmp = self.directory / (step_name(step) + TMP_SUFFIX)
        if self._coordinator:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed attempt at the same step
        self._barrier()  # no rank writes into tmp before it is fresh
        upload = dcp.async_save(state_dict, checkpoint_id=str(tmp), process_group=self._group,
                                no_dist=not self._distributed)
        upload = getattr(upload, "upload_completion", upload)  # newer DCPs return a response
        self._pending = self._finisher.submit(self._finish, step, tmp, upload)
        self._pending_step = self.last_saved = step
        return True

    def wait(self) -> int | None:
        """Block until the save in flight is complete; returns its step (None: none was in
        flight). Raises :class:`CheckpointError` if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.result()
        except Exception as e:
            raise CheckpointError(f"saving {step_name(self._pending_step)} in "
                                  f"{self.directory} failed: {e}") from e
        return self._pending_step

    def close(self) -> None:
        """Wait for the save in flight (logging a failure) and stop the background thread."""
        self._settle()
        self._finisher.shutdown(wait=True)

    def _settle(self) -> None:
        try:
            self.wait()
        except CheckpointError as e:
            log.error("%s; training goes on, the previous complete checkpoint stays", e)
            self.failed_saves.append((self._pending_step, str(e)))

    def _finish(self, step: int, tmp: Path, upload: Future) -> None:
        """Runs after DCP's upload: seal the checkpoint (coordinator only) and prune."""
        upload.result()  # every rank's files are written once the coordinator's save returns
        if not self._coordinator:
            return
        _write_marker(tmp, step, self.key)
        final = self.directory / step_name(step)
        if final.exists():  # saved before by a history this job abandoned (it loaded older)
            shutil.rmtree(final)
        os.rename(tmp, final)  # atomic: the checkpoint appears complete or not at all
        _fsync_dir(self.directory)
        self._prune()
        log.info("checkpoint %s complete in %s", final.name, self.directory)

    def _prune(self) -> None:
        """Delete old complete checkpoints beyond ``keep`` and ``.tmp`` leftovers of crashes
        (none is in flight: this runs at the end of the only save)."""
        for entry in self._entries():
            if entry.tmp:
                shutil.rmtree(self.directory / entry.name, ignore_errors=True)
        for step in to_prune(self.complete_steps(), self.keep):
            shutil.rmtree(self.directory / step_name(step), ignore_errors=True)

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._group)

    # --- finding and loading --------------------------------------------------------------

    def _entries(self) -> list[Entry]:
        """Checkpoint entries in the directory, newest step first (at a step, .tmp last)."""
        entries = [e for p in self.directory.iterdir() if p.is_dir()
                   if (e := parse_entry(p.name)) is not None]
        return sorted(entries, key=lambda e: (-e.step, e.tmp))

    def problem(self, entry: Entry, *, checksums: bool | None = None) -> str | None:
        """Why ``entry`` is torn, or None when it is complete."""
        if entry.tmp:
            return "a .tmp directory: the save was interrupted before it finished"
        path = self.directory / entry.name
        marker = _read_marker(path)
        deep = self.verify_checksums if checksums is None else checksums
        return marker_problem(marker, _observe(path, deep and marker is not None)) or \
            signature_problem(marker, self.key)

    def complete_steps(self) -> list[int]:
        """Steps with a complete-looking checkpoint (marker and file sizes; no checksums)."""
        return [e.step for e in self._entries()
                if not e.tmp and self.problem(e, checksums=False) is None]

    def latest_complete(self) -> int | None:
        """The newest complete checkpoint's step; torn ones are skipped with a warning."""
        for entry in self._entries():
            problem = self.problem(entry)
            if problem is None:
                return entry.step
            log.warning("skipping %s", torn_message(self.directory, entry.name, problem,
                                                    self._older_complete(entry.step)))
        return None

    def _older_complete(self, step: int) -> int | None:
        return max((s for s in self.complete_steps() if s < step), default=None)

    def check(self, step: int) -> None:
        """Raise unless ``step-<step>`` is complete: :class:`MissingCheckpointError` if there
        is no such checkpoint, :class:`TornCheckpointError` saying what is wrong if torn."""
        candidates = [e for e in self._entries() if e.step == step]
        if not candidates:
            have = ", ".join(step_name(s) for s in self.complete_steps()) or "none"
            raise MissingCheckpointError(f"no checkpoint {step_name(step)} in "
                                         f"{self.directory} (complete ones: {have})")
        entry = candidates[0]  # the final directory if it exists, else the .tmp one
        problem = self.problem(entry)
        if problem is not None and not entry.tmp and problem == signature_problem(
                _read_marker(self.directory / entry.name) or {}, self.key):
            raise UntrustedCheckpointError(f"checkpoint {entry.name} in {self.directory}: "
                                           f"{problem}")
        if problem is not None:
            raise TornCheckpointError(torn_message(self.directory, entry.name, problem,
                                                   self._older_complete(step)))

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> int | None:
        """Load checkpoint ``step`` (default: the newest complete one) into ``state_dict`` in
        place (``Stateful`` values such as :class:`TrainingState` load themselves).

        Returns the step loaded, or None when there is no complete checkpoint. Every rank of
        the group loads the step rank 0 chose. Raises :class:`TornCheckpointError` when
        ``step`` was asked for and is torn, :class:`MissingCheckpointError` when it does not
        exist.
        """
        self._settle()  # a save still in flight may be the newest checkpoint
        step, error = self._agree(self._choose(step) if self._coordinator else (None, None))
        if error is not None:
            raise error
        if step is None:
            return None
        path = self.directory / step_name(step)
        self._check_before_reading(path)
        try:
            dcp.load(state_dict, storage_reader=SafeFileSystemReader(path),
                     planner=SafeLoadPlanner(), process_group=self._group,
                     no_dist=not self._distributed)
        except CheckpointException as e:  # DCP wraps what its reader and planner raise
            refused = [f[0] for f in e.failures.values()
                       if isinstance(f[0], UntrustedCheckpointError)]
            if refused:
                raise UntrustedCheckpointError(f"checkpoint {path.name} in {self.directory}: "
                                               f"{refused[0]}") from None
            raise
        self.last_saved = step  # a newer checkpoint on disk is another history: overwrite it
        return step

    def _check_before_reading(self, path: Path) -> None:
        """On every rank, right before DCP reads: the marker is this job's, and the metadata
        (which every rank reads) is the file it signed. The coordinator checked the rest."""
        marker = _read_marker(path) or {}
        observed = _observe(path, checksums=False)
        if ".metadata" in observed:
            observed[".metadata"] = (observed[".metadata"][0], _sha256(path / ".metadata"))
        problem = signature_problem(marker, self.key) or marker_problem(marker, observed)
        if problem is not None:
            raise UntrustedCheckpointError(f"checkpoint {path.name} in {self.directory}: "
                                           f"{problem}")
        SafeFileSystemReader(path).read_metadata()  # refused here, not inside DCP's wrapping
        if self.key is None:
            log.warning("loading %s, whose signature nobody checks (no key: the job runs "
                        "--insecure); it is read without running anything it holds", path)

    def _choose(self, step: int | None) -> tuple[int | None, CheckpointError | None]:
        """The step to load, or the error that refuses the request (coordinator only)."""
        if step is None:
            return self.latest_complete(), None
        try:
            self.check(step)
        except CheckpointError as e:
            return None, e
        return step, None

    def _agree(self, decision: tuple) -> tuple:
        """Rank 0's decision on every rank: a save finishing meanwhile must not split them,
        and a refusal must reach the ranks that would otherwise wait in the load."""
        if not self._distributed:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, group=self._group, group_src=0)
        return box[0]
