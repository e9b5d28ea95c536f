"""The raw tensor wire format of a state transfer (a snapshot, a piece of the update log).

A state goes out as raw tensor bytes (:func:`encode_state`): a small header, the non-tensor
rest of the state, then every tensor's storage as it lies in memory, written straight from it
to the socket (no pickling, no intermediate buffer). ``sendall`` releases the GIL, so serving
costs the donor's training thread nothing but memory bandwidth.

A joiner receives the tensors' bytes straight into its own state tensors where their layout
matches (:func:`decode_state`; ``recv_into``: no allocation, no copy afterwards), and the rest
(a fresh optimizer's state) into tensors it allocates and zeroes from the donor's layout
(:func:`state_layout`) while the donor waits for its next commit (:func:`receiving_buffers`).

The walks over a state's tree (:func:`map_tensors`, :func:`tree_tensors`,
:func:`tensor_places`) serve the rest of the training side too.
"""

from __future__ import annotations

import io
import json
import struct
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import torch

from ftsystem.training import carriable
from ftsystem.training.transport import DonorUnavailableError

WIRE_CHUNK_BYTES = 4 << 20
"""Largest single write or read of tensor bytes: a bound on one call's blocking (and on how
long :meth:`EncodedState.freeze` waits for a write in flight), not a copy."""
_LENGTH = struct.Struct("!Q")


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy: it goes on the wire as it lies in memory."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


class EncodedState:
    """A state (a snapshot, a piece of the log) as it goes on the wire: ``prefix`` (header and
    the state's non-tensor rest), then each of ``tensors``' bytes in order.

    ``live``: the tensors are the replica's own, valid until :meth:`freeze` (called before
    they are mutated); otherwise they never change.
    """

    def __init__(self, prefix: bytes, tensors: list[torch.Tensor], live: bool = False) -> None:
        self.prefix, self.tensors = prefix, tensors
        self.nbytes = len(prefix) + sum(t.nbytes for t in tensors)
        self._live = live
        self._lock = threading.Lock()  # held while a chunk is written: freeze() waits for it
        self._positions: dict[Transfer, int] = {}  # open transfers: first tensor left to send

    def open(self) -> Transfer:
        """A transfer of this state; what it has still to send survives :meth:`freeze`."""
        transfer = Transfer(self)
        with self._lock:
            self._positions[transfer] = 0
        return transfer

    def write_to(self, out: BinaryIO) -> None:
        """Write it all; each tensor is written from its own memory (``sendall`` on a socket)."""
        self.open().write_to(out)

    def freeze(self) -> None:
        """The live tensors are about to change: the open transfers go on from copies of the
        tensors they have not sent yet. Waits for a chunk in flight (it reads live memory)."""
        with self._lock:
            if not self._live:
                return
            self._live = False
            first = min(self._positions.values(), default=len(self.tensors))
            for i in range(first, len(self.tensors)):
                self.tensors[i] = cpu_copy(self.tensors[i])

    def _write(self, transfer: Transfer, out: BinaryIO) -> None:
        try:
            out.write(self.prefix)
            for i in range(len(self.tensors)):
                nbytes = self.tensors[i].nbytes
                for start in range(0, nbytes, WIRE_CHUNK_BYTES):
                    with self._lock:  # self.tensors[i] may be replaced by its copy meanwhile
                        out.write(as_bytes(self.tensors[i])[start:start + WIRE_CHUNK_BYTES])
                with self._lock:
                    self._positions[transfer] = i + 1
        finally:
            with self._lock:
                del self._positions[transfer]


@dataclass(eq=False, slots=True)
class Transfer:
    """One sending of an :class:`EncodedState` (open until written)."""

    state: EncodedState

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def write_to(self, out: BinaryIO) -> None:
        self.state._write(self, out)


def encode_state(step: int, state: Any, live: bool = False) -> EncodedState:
    """``state`` of ``step`` ready to send: its tensors (made contiguous) travel as raw bytes,
    and what is left (the tree with a meta tensor of each one's shape and dtype in its place,
    and the non-tensor values) is small enough to go through ``torch.save``. ``live``: the
    tensors are the replica's own (see :class:`EncodedState`)."""
    tensors: list[torch.Tensor] = []

    def take(tensor: torch.Tensor) -> torch.Tensor:
        tensors.append(tensor.detach().cpu().contiguous())
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    skeleton = io.BytesIO()
    torch.save(map_tensors(state, take), skeleton)
    header = json.dumps({"step": step, "skeleton_bytes": skeleton.tell(),
                         "tensor_bytes": [t.nbytes for t in tensors]}).encode()
    return EncodedState(_LENGTH.pack(len(header)) + header + skeleton.getvalue(), tensors, live)


def state_layout(state: Any) -> bytes:
    """The shapes and dtypes of ``state``'s tensors, in its tree (meta tensors), serialized:
    what a joiner allocates before the snapshot itself arrives (:func:`receiving_buffers`).
    A donor records it once: a layout does not change while a job trains, and a place that
    appears later (an optimizer that creates some state late) is allocated as it arrives."""
    out = io.BytesIO()
    torch.save(map_tensors(state, lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                        device="meta")), out)
    return out.getvalue()


def receiving_buffers(own: dict[tuple, torch.Tensor], layout: dict[tuple, torch.Tensor]
                      ) -> dict[tuple, torch.Tensor]:
    """``own`` (tensors by place), completed with a zeroed tensor for each place of
    ``layout`` (meta tensors by place) that it has no fitting tensor for.

    Zeroed: a fresh process's new memory is page-faulted in at its first touch, and on this
    machine's VM that touch is slower than the wire (0.2 to 2 GB/s measured, against 2.4 to
    2.9 GB/s over loopback). Touched now, while the donor waits for its next commit, the
    pages are ready when the bytes arrive."""
    return own | {place: torch.zeros(meta.shape, dtype=meta.dtype)
                  for place, meta in layout.items()
                  if place not in own or not _fits(own[place], meta)}


def decode_state(read_into: Callable[[memoryview], None],
                 into: dict[tuple, torch.Tensor] | None = None) -> tuple[int, Any]:
    """(step, state) of an encoded state, read by ``read_into`` (which fills the whole
    buffer it is given): each tensor's bytes land directly in a tensor, the one ``into``
    holds at its place in the state's tree (see :func:`tensor_places`) when its shape and
    dtype match and it is a contiguous CPU tensor, otherwise one allocated for them."""
    length = bytearray(_LENGTH.size)
    read_into(memoryview(length))
    header_bytes = bytearray(_LENGTH.unpack(length)[0])
    read_into(memoryview(header_bytes))
    header = json.loads(header_bytes)
    skeleton_bytes = bytearray(header["skeleton_bytes"])
    read_into(memoryview(skeleton_bytes))
    skeleton = carriable.load(skeleton_bytes)
    sizes = iter(header["tensor_bytes"])
    into = into or {}

    def fill(place: tuple, meta: torch.Tensor) -> torch.Tensor:
        tensor = into.get(place)
        if tensor is None or not _fits(tensor, meta):
            tensor = torch.empty(meta.shape, dtype=meta.dtype)
        raw = as_bytes(tensor)
        if len(raw) != next(sizes):
            raise DonorUnavailableError("the state's header does not match its tensors")
        for start in range(0, len(raw), WIRE_CHUNK_BYTES):
            read_into(raw[start:start + WIRE_CHUNK_BYTES])
        return tensor
    return header["step"], map_tensors(skeleton, fill, with_place=True)


def _fits(tensor: torch.Tensor, meta: torch.Tensor) -> bool:
    return (tensor.device.type == "cpu" and tensor.is_contiguous() and
            tensor.shape == meta.shape and tensor.dtype == meta.dtype)


def tensor_places(tree: Any) -> dict[tuple, torch.Tensor]:
    """Every tensor of ``tree`` by its place in it (the keys and indices leading to it)."""
    places: dict[tuple, torch.Tensor] = {}

    def note(place: tuple, tensor: torch.Tensor) -> torch.Tensor:
        places[place] = tensor
        return tensor
    map_tensors(tree, note, with_place=True)
    return places


def map_tensors(tree: Any, fn: Callable[..., torch.Tensor], *, with_place: bool = False,
                _place: tuple = ()) -> Any:
    """``tree`` (dicts, lists, tuples) with ``fn`` applied to every tensor in it; with
    ``with_place``, ``fn(place, tensor)``, the place being the keys and indices to it.
    Containers keep their kind (an OrderedDict, a defaultdict with its factory, a namedtuple):
    a replica that receives the state must hold what the sender held."""
    if isinstance(tree, torch.Tensor):
        return fn(_place, tree) if with_place else fn(tree)
    if isinstance(tree, dict):
        return _dict_like(tree, {k: map_tensors(v, fn, with_place=with_place, _place=(*_place, k))
                                 for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        items = [map_tensors(v, fn, with_place=with_place, _place=(*_place, i))
                 for i, v in enumerate(tree)]
        return type(tree)._make(items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def _dict_like(tree: dict, items: dict) -> dict:
    if type(tree) is dict:
        return items
    if isinstance(tree, defaultdict):
        return defaultdict(tree.default_factory, items)
    return type(tree)(items)


def tree_tensors(tree: Any):
    """Every tensor in a tree of dicts, lists and tuples, in a deterministic order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from tree_tensors(tree[key])
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from tree_tensors(item)
