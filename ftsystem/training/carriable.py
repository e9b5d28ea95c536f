"""Which values replicated state may hold besides tensors, and the one safe way to load them.

Replicas exchange state (snapshots, logged updates, loop-advanced states) as ``torch.save``
output and load it with torch's weights-only unpickler, which builds nothing but tensors,
plain containers and Python scalars unless told otherwise: a peer's bytes must not be able to
run code. Ordinary training loops hold a little more, so this module allowlists, once per
process (:func:`torch.serialization.add_safe_globals`):

- numpy scalars of the standard dtypes (``bool_``, ``int8``..``int64``, ``uint8``..``uint64``,
  ``float16``/``32``/``64``, ``complex64``/``128``) and arrays of them: an LR lambda written
  with numpy puts ``numpy.float64`` learning rates into the optimizer and the scheduler;
- ``bytes``, ``slice``, ``collections.OrderedDict`` (and what torch allows already:
  ``bytearray``, ``set``, ``complex``, ``collections.Counter``);
- ``collections.defaultdict`` whose default factory is allowed itself: ``int``, ``float``,
  ``bool``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``, ``OrderedDict``,
  ``Counter``, ``defaultdict``, or a class passed to :func:`allow`;
- the user's own classes, passed to :func:`allow` (an ``Enum``, a dataclass of plain values).

Functions are never allowlisted (a pickle may call them with any arguments), only classes that
build harmless values. A value outside the list makes :func:`check` raise
:class:`NotCarriable`, naming the object, the value's place in it and its type.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import threading
from typing import Any, BinaryIO

import numpy as np
import torch

try:
    from numpy._core import multiarray as _multiarray  # numpy 2
except ImportError:  # numpy 1.26
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]

_NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64", "complex64", "complex128")
_DEFAULT_FACTORIES = (int, float, bool, str, bytes, list, tuple, dict, set)


class NotCarriable(ValueError):
    """A state holds a value that the safe loader refuses: replicas cannot exchange it."""


def allow(*types: type) -> None:
    """Let instances of ``types`` travel in replicated state (and serve as a defaultdict's
    default factory). For the user's own classes: an ``Enum``, a dataclass of plain values.

    Call it at import time, on every replica, before ``FTReplica.start()``. Loading builds an
    allowed class from whatever fields the sender's bytes hold (``Enum(value)``, or
    ``__new__`` and ``__setstate__``/``__dict__``), so allow only classes for which that is
    harmless: never one that opens files, runs commands or imports by name.
    """
    for cls in types:
        if not isinstance(cls, type):
            raise TypeError(f"allow({cls!r}): only classes can be allowed; a function could be "
                            "called by a peer's bytes with any arguments")
    _user_classes.update(types)
    torch.serialization.add_safe_globals(list(types))


def load(source: bytes | bytearray | memoryview | BinaryIO, map_location: Any = None) -> Any:
    """What ``torch.save`` wrote to ``source`` (its bytes or a file), loaded by torch's
    weights-only unpickler with this module's allowlist: the one load of a peer's state."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    _loading.defaultdicts = made = {}
    try:
        tree = torch.load(source, weights_only=True, map_location=map_location)
    finally:
        del _loading.defaultdicts
    return _with_defaultdicts(tree, made) if made else tree


def check(state: Any, what: str) -> None:
    """Raise :class:`NotCarriable` if :func:`load` would refuse a value of ``state`` (a
    ``state_dict()``); ``what`` names the state's owner in the message ("registered object
    'lr_schedule'", "optimizer state"). Tensors are checked by shape and dtype only."""
    from ftsystem.training.wire import map_tensors  # wire loads through this module

    skeleton = map_tensors(state, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    if _refusal(skeleton) is None:
        return
    path, value, reason = _first_refused(skeleton, "")
    message = (f"{what} cannot be exchanged between replicas: the "
               f"{type(value).__module__}.{type(value).__qualname__} at "
               f"{path or 'its top level'} is refused ({reason}). Keep a tensor or a plain "
               "Python value (int, float, str, list, dict) there in state_dict()")
    refused_class = re.search(r"GLOBAL (\S+) was not an allowed global", reason)
    if refused_class:
        message += (f"; or, if building a {refused_class[1]} from its pickled fields is "
                    "harmless (an Enum, a dataclass of plain values), call "
                    f"ftsystem.training.carriable.allow({refused_class[1]}) on every replica "
                    "before start()")
    raise NotCarriable(message)


def _refusal(tree: Any) -> str | None:
    """Why ``tree`` does not survive ``torch.save`` and :func:`load`; None if it does."""
    out = io.BytesIO()
    try:
        torch.save(tree, out)
        load(out.getvalue())
    except Exception as e:  # noqa: BLE001 - any failure to save or load is the answer
        detail = str(e).split("WeightsUnpickler error:")[-1].strip()
        return detail.split(" Please use")[0].split("\n")[0].rstrip(".")
    return None


def _first_refused(tree: Any, path: str) -> tuple[str, Any, str]:
    """The deepest refused part of a refused ``tree``: its path, value and the reason."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if _refusal(key) is not None:
                return _first_refused(key, f"{path}[{key!r}] (its key)")
        children = [(f"[{key!r}]", value) for key, value in tree.items()]
    elif isinstance(tree, (list, tuple)):
        children = [(f"[{i}]", value) for i, value in enumerate(tree)]
    else:
        children = []
    for step, child in children:
        if _refusal(child) is not None:
            return _first_refused(child, path + step)
    return path, tree, _refusal(tree) or "refused only together with its contents"


# The weights-only unpickler fills only plain dicts (SETITEM), so a pickled defaultdict loads
# as a dict that :func:`load` turns back into a defaultdict afterwards, by identity.
_loading = threading.local()
_user_classes: set[type] = set()


def _defaultdict(*factory: Any) -> dict:
    """Stands in for ``collections.defaultdict`` while :func:`load` runs."""
    made = getattr(_loading, "defaultdicts", None)
    if made is None:
        raise pickle.UnpicklingError(
            "a collections.defaultdict loads only through ftsystem.training.carriable.load")
    stand_in: dict = {}
    default = factory[0] if factory else None
    made[id(stand_in)] = (stand_in, collections.defaultdict if default is _defaultdict
                          else default)
    return stand_in


def _with_defaultdicts(tree: Any, made: dict[int, tuple[dict, Any]]) -> Any:
    """``tree`` (fresh from the unpickler, so changed in place) with every stand-in in ``made``
    replaced by a defaultdict, wherever it is referenced (dicts, lists, tuples, the fields of
    allowed classes)."""
    done: dict[int, Any] = {}

    def visit(x: Any) -> Any:
        if id(x) in done:
            return done[id(x)]
        if isinstance(x, dict):
            done[id(x)] = out = collections.defaultdict(made[id(x)][1]) if id(x) in made else x
            for key, value in list(x.items()):  # item by item: Counter.update would add
                out[key] = visit(value)
        elif isinstance(x, list):
            done[id(x)] = out = x
            x[:] = [visit(v) for v in x]
        elif isinstance(x, tuple):
            items = [visit(v) for v in x]
            done[id(x)] = out = type(x)._make(items) if hasattr(x, "_fields") else type(x)(items)
        elif type(x) in _user_classes and hasattr(x, "__dict__"):
            done[id(x)] = out = x
            vars(x).update([(k, visit(v)) for k, v in vars(x).items()])
        else:
            out = x
        return out
    return visit(tree)


def _numpy_globals() -> list[Any]:
    # Both module names: peers on numpy 1.x pickle ``numpy.core``, on numpy 2 ``numpy._core``.
    named = [(getattr(_multiarray, fn), f"numpy.{core}.multiarray.{fn}")
             for fn in ("scalar", "_reconstruct") for core in ("core", "_core")]
    dtypes = [type(np.dtype(name)) for name in _NUMPY_DTYPES]
    return [*named, np.ndarray, np.dtype, *dtypes]


torch.serialization.add_safe_globals([
    *_numpy_globals(), *_DEFAULT_FACTORIES, slice, collections.OrderedDict,
    (_defaultdict, "collections.defaultdict")])
