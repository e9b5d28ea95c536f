"""Reading records that anyone with etcd credentials could have written.

etcd holds what the platform's writers put there, but nothing stops another writer: a record
that is not what its writer writes must not stop its reader. Every reader of a record decodes it
through one of these: a malformed one raises :class:`RecordError` naming the key's kind and what
is wrong, and a reader of many (:func:`well_formed`) logs the key, counts it
(``ftsystem_malformed_records_total``) and goes on with the others.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping, TypeVar

from pydantic import TypeAdapter, ValidationError

from ftsystem.measure import metrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class RecordError(ValueError):
    """A record in etcd that is not what its writer writes."""


def decoder(kind: str, type_: Any) -> Callable[[bytes | str], Any]:
    """A strict decoder of JSON records of ``type_`` (a dataclass): wrong types are refused,
    not coerced, and fields it does not know are ignored (a newer writer may add some)."""
    adapter = TypeAdapter(type_)

    def decode(data: bytes | str) -> Any:
        try:
            return adapter.validate_json(data, strict=True)
        except ValidationError as e:
            raise RecordError(f"not a well-formed {kind}: {_summary(e)}") from None
    return decode


def _summary(error: ValidationError) -> str:
    problems = []
    for item in error.errors(include_url=False)[:4]:
        where = ".".join(map(str, item["loc"])) or "the record"
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)


def json_object(data: bytes | str, kind: str = "record") -> dict[str, Any]:
    """A record that must be a JSON object, of any fields (a failure, a divergence event)."""
    try:
        value = json.loads(data)
    except ValueError as e:
        raise RecordError(f"not a well-formed {kind}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise RecordError(f"not a well-formed {kind}: a JSON {type(value).__name__}, "
                          "not an object")
    return value


def report_malformed(key: str, error: Exception) -> None:
    """Log and count a record that is skipped."""
    log.warning("skipping the malformed etcd record %s: %s (delete or rewrite it)", key, error)
    metrics.MALFORMED_RECORDS.labels(*_job_and_kind(key)).inc()


def _job_and_kind(key: str) -> tuple[str, str]:
    """A key's job and kind for the metric's labels: the segments after the root (the kind:
    ``replicas``, ``agents``, ...), bounded, unlike the key itself."""
    parts = key.strip("/").split("/")
    return (parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else "other")


def well_formed(items: Mapping[str, bytes], decode: Callable[[bytes], T]) -> dict[str, T]:
    """Every record of ``items`` that decodes, by key; the others are reported and skipped."""
    out = {}
    for key, value in items.items():
        try:
            out[key] = decode(value)
        except (RecordError, ValueError, TypeError) as e:
            report_malformed(key, e)
    return out


def well_formed_under(items: Mapping[str, bytes], prefix: str, decode: Callable[[bytes], T]
                      ) -> dict[str, T]:
    """The well-formed records among ``items`` under ``prefix``, by the rest of their key."""
    return {k[len(prefix):]: v for k, v in well_formed(
        {k: v for k, v in items.items() if k.startswith(prefix)}, decode).items()}


def objects_under(items: Mapping[str, bytes], prefix: str) -> dict[str, dict[str, Any]]:
    """The well-formed JSON objects among ``items`` under ``prefix``, by the rest of the key."""
    return well_formed_under(items, prefix, json_object)


def object_or_none(items: Mapping[str, bytes], key: str) -> dict[str, Any] | None:
    """The JSON object at ``key``; None when it is absent, or malformed (reported)."""
    raw = items.get(key)
    if raw is None:
        return None
    return well_formed({key: raw}, json_object).get(key)


def time_of(record: Mapping[str, Any]) -> float:
    """A record's ``time`` to sort by; 0 when it has none a sort could use."""
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else 0.0
