"""etcd access for every ftsystem process, over the asyncio client aetcd.

One choke point maps client errors to a small typed hierarchy; transient failures (connection
refused, deadline exceeded) are retried with backoff across the configured endpoints until a
deadline, after which :class:`StoreUnavailableError` names the endpoints and says what to do.
Watches resume from the last revision they delivered after a reconnect, so a watcher never
misses an event across an etcd restart or a failover to another member.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import ssl
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import aetcd
import aetcd.exceptions as etcd_errors
import grpc

from ftsystem.control.etcd_tls import (ENV_CA, ENV_CERT, ENV_KEY, ENV_NAMES, WHAT_TO_SET,
                                       ClientTls, EtcdTlsError)

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long an operation keeps retrying a transient failure before giving up.
RETRY_DEADLINE_ENV = "FTSYSTEM_ETCD_RETRY_S"
DEFAULT_RETRY_DEADLINE_S = 10.0
RPC_TIMEOUT_S = 5.0
_TRANSIENT = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
              etcd_errors.InternalError, asyncio.TimeoutError, ConnectionError)


class StoreError(Exception):
    """Any failure talking to etcd."""


class StoreUnavailableError(StoreError):
    """No configured etcd endpoint answered before the retry deadline."""


class LeaseLostError(StoreError):
    """A lease expired or was revoked while its owner still needed it."""


class StoreTlsError(StoreError):
    """The client's and etcd's TLS do not fit (plain against TLS, a refused or missing
    certificate): retrying cannot help, the message says what to set."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    tls: bool = False
    """``https://``: the client speaks TLS to it."""

    def __str__(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"


def parse_endpoints(spec: str) -> list[Endpoint]:
    """Parse ``"https://h1:2379,https://h2:2379"`` into endpoints; no scheme means http://.
    One cluster speaks one scheme: a mix is refused."""
    endpoints = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        scheme, sep, hostport = item.rpartition("://")
        host, colon, port = hostport.rstrip("/").rpartition(":")
        if scheme not in ("", "http", "https") or not colon or not host or not port.isdigit():
            raise ValueError(f"malformed etcd endpoint {item!r}: expected host:port, e.g. "
                             "http://127.0.0.1:2379 (https:// for TLS)")
        endpoints.append(Endpoint(host.strip("[]"), int(port), tls=scheme == "https"))
    if not endpoints:
        raise ValueError("no etcd endpoint given: pass --etcd http://HOST:PORT")
    if len({ep.tls for ep in endpoints}) > 1:
        raise ValueError(f"etcd endpoints {spec!r} mix http:// and https://: the members of "
                         "one cluster speak the same, give them all one scheme")
    return endpoints


def check_tls_fits(endpoints: list[Endpoint], tls: ClientTls | None) -> None:
    """Refuse certificates set for plain endpoints: the user meant TLS and would get none."""
    if tls is not None and not endpoints[0].tls:
        ep = endpoints[0]
        raise EtcdTlsError(
            f"etcd certificates are set ({', '.join(ENV_NAMES)}) but the endpoint {ep} is "
            f"plain http: write it https://{ep.host}:{ep.port}, or unset the certificates")


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "PUT" or "DELETE"
    key: str
    value: bytes
    revision: int

    def json(self) -> Any:
        return json.loads(self.value) if self.value else None


class Store:
    """An etcd client bound to one or several endpoints of the same cluster."""

    def __init__(self, endpoints: str | list[Endpoint], *,
                 retry_deadline_s: float | None = None, tls: ClientTls | None = None) -> None:
        """``tls`` None: the certificates of ``FTSYSTEM_ETCD_CA``/``_CERT``/``_KEY``, if set.
        Raises :class:`EtcdTlsError` (a ValueError) for settings that cannot work."""
        self.endpoints = parse_endpoints(endpoints) if isinstance(endpoints, str) else endpoints
        self.tls = tls if tls is not None else ClientTls.from_env()
        check_tls_fits(self.endpoints, self.tls)
        self.retry_deadline_s = retry_deadline_s if retry_deadline_s is not None else float(
            os.environ.get(RETRY_DEADLINE_ENV, DEFAULT_RETRY_DEADLINE_S))
        self._index = 0
        self._client: aetcd.Client | None = None

    def __str__(self) -> str:
        return ",".join(map(str, self.endpoints))

    async def __aenter__(self) -> "Store":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Check that some endpoint answers; raise :class:`StoreUnavailableError` otherwise."""
        await self._retry(self._status)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    # --- the choke point -------------------------------------------------------------------

    async def _status(self) -> None:
        await self._ensure_client().status()

    def _ensure_client(self) -> aetcd.Client:
        if self._client is None:
            ep = self._endpoint()
            self._client = _TlsClient(ep.host, ep.port, timeout=RPC_TIMEOUT_S,
                                      credentials=(self.tls or ClientTls()).credentials()) \
                if ep.tls else aetcd.Client(ep.host, ep.port, timeout=RPC_TIMEOUT_S)
        return self._client

    def _endpoint(self) -> Endpoint:
        return self.endpoints[self._index % len(self.endpoints)]

    async def _rotate(self, failed: aetcd.Client) -> None:
        """Drop a failed connection and move on to the next endpoint.

        Several tasks share the connection: only the first to see it fail replaces it; the
        others' calls on it end (cancelled by its close) and retry on the new one.
        """
        if self._client is failed:
            self._client = None
            self._index += 1
            await failed.close()

    async def _retry(self, op: Callable[[], Awaitable[T]]) -> T:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_deadline_s
        delay = 0.05
        while True:
            client = self._ensure_client()
            try:
                return await op()
            except (*_TRANSIENT, asyncio.CancelledError) as e:
                _reraise_real_cancellation(e)
                if problem := await tls_mismatch(str(e), self._endpoint()):
                    raise StoreTlsError(problem) from e
                if loop.time() + delay > deadline:
                    raise StoreUnavailableError(
                        f"etcd unreachable at {self} for {self.retry_deadline_s:.0f} s ({e}); "
                        "start it (`ftsystem etcd`) or pass the right --etcd URL") from e
                log.debug("etcd transient error (%s); retrying in %.2fs", e, delay)
                await self._rotate(client)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
            except etcd_errors.ClientError as e:
                raise StoreError(f"etcd at {self} refused the request: {e}") from e

    # --- key-value -------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        result = await self._retry(lambda: self._ensure_client().get(key.encode()))
        return None if result is None else result.value

    async def get_json(self, key: str) -> Any:
        value = await self.get(key)
        return None if value is None else json.loads(value)

    async def get_versioned(self, key: str) -> tuple[bytes | None, int]:
        """The value of ``key`` and its mod revision (0 when absent), for
        :meth:`put_if_unchanged`."""
        result = await self._retry(lambda: self._ensure_client().get(key.encode()))
        return (None, 0) if result is None else (result.value, result.mod_revision)

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """All keys under ``prefix`` and the store revision they were read at."""
        async def op() -> tuple[dict[str, bytes], int]:
            result = await self._ensure_client().get_prefix(prefix.encode())
            items = {kv.key.decode(): kv.value for kv in result}
            return items, result.header.revision
        return await self._retry(op)

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, without their values."""
        async def op() -> list[str]:
            result = await self._ensure_client().get_prefix(prefix.encode(), keys_only=True)
            return [kv.key.decode() for kv in result]
        return await self._retry(op)

    async def put(self, key: str, value: bytes | str, *, lease: int | None = None) -> int:
        """Write ``value``; returns the revision of the write."""
        data = value.encode() if isinstance(value, str) else value
        result = await self._retry(
            lambda: self._ensure_client().put(key.encode(), data, lease=lease))
        return result.header.revision

    async def put_json(self, key: str, value: Any, *, lease: int | None = None) -> int:
        return await self.put(key, json.dumps(value, sort_keys=True), lease=lease)

    async def delete(self, key: str) -> None:
        await self._retry(lambda: self._ensure_client().delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        await self._retry(lambda: self._ensure_client().delete_prefix(prefix.encode()))

    # --- transactions ----------------------------------------------------------------------

    async def put_if_absent(self, key: str, value: bytes | str, *, lease: int | None = None
                            ) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""
        client = self._ensure_client()
        return await self._txn(
            [client.transactions.version(key.encode()) == 0],
            [client.transactions.put(key.encode(), _bytes(value), lease=lease)])

    async def put_if_equal(self, guard_key: str, guard_value: bytes | str,
                           key: str, value: bytes | str) -> bool:
        """Write ``key`` only while ``guard_key`` holds ``guard_value`` (e.g. leadership)."""
        client = self._ensure_client()
        return await self._txn(
            [client.transactions.value(guard_key.encode()) == _bytes(guard_value)],
            [client.transactions.put(key.encode(), _bytes(value))])

    async def put_if_unchanged(self, key: str, mod_revision: int, value: bytes | str, *,
                               lease: int | None = None) -> bool:
        """Write ``key`` only if it was not written since ``mod_revision`` (0: only if absent),
        as read by :meth:`get_versioned`; True if this call wrote it."""
        client = self._ensure_client()
        return await self._txn(
            [client.transactions.mod(key.encode()) == mod_revision],
            [client.transactions.put(key.encode(), _bytes(value), lease=lease)])

    async def _txn(self, compare: list, success: list) -> bool:
        async def op() -> bool:
            ok, _ = await self._ensure_client().transaction(
                compare=compare, success=success, failure=[])
            return ok
        return await self._retry(op)

    # --- leases ----------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """Grant a lease of ``ttl_s`` seconds; returns its id."""
        lease = await self._retry(lambda: self._ensure_client().lease(ttl_s))
        return lease.id

    async def refresh(self, lease_id: int) -> None:
        try:
            reply = await self._retry(lambda: self._ensure_client().refresh_lease(lease_id))
        except StoreError as e:
            if isinstance(e, StoreUnavailableError) or "not found" not in str(e):
                raise
            reply = None
        if reply is None or reply.TTL <= 0:
            raise LeaseLostError(f"lease {lease_id:x} expired or was revoked")

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._retry(lambda: self._ensure_client().revoke_lease(lease_id))
        except StoreError as e:
            if "not found" not in str(e):  # already gone: the outcome wanted
                raise

    async def lease_ttl(self, lease_id: int) -> tuple[int, int] | None:
        """``(remaining, granted)`` seconds of ``lease_id``, remaining truncated to whole seconds
        as etcd reports it; None when the lease does not exist (revoked, or expired)."""
        try:
            reply = await self._retry(
                lambda: self._ensure_client().get_lease_info(lease_id, keys=False))
        except StoreError as e:
            if isinstance(e, StoreUnavailableError) or "not found" not in str(e):
                raise
            return None
        # etcd answers TTL -1 for a lease it does not know, and for one expired over a second
        # ago that awaits revocation.
        return None if reply.TTL < 0 else (reply.TTL, reply.grantedTTL)

    async def keep_alive(self, lease_id: int, ttl_s: int, every_s: float | None = None) -> None:
        """Renew ``lease_id`` every third of its TTL (or ``every_s``) until cancelled.

        Renewals are messages on one long-lived ``LeaseKeepAlive`` stream, as etcd's own
        clients send them: opening a stream per renewal costs etcd about as much again per
        renewal, which matters with thousands of node agents. An outage does not end it: it
        keeps trying on a new stream, because the lease may survive (etcd extends leases across
        a leader change). Raises :class:`LeaseLostError` once etcd answers that the lease is
        gone.
        """
        stream: _KeepAliveStream | None = None
        failing = False
        try:
            while True:
                await asyncio.sleep(every_s or ttl_s / 3)
                client = self._ensure_client()
                if stream is not None and stream.client is not client:
                    stream.close()  # another task reconnected: renew on the new connection
                    stream = None
                try:
                    stream = stream or await _KeepAliveStream.open(client)
                    ttl = await stream.renew(lease_id)
                except (*_TRANSIENT, aetcd.rpc.AioRpcError, etcd_errors.ClientError,
                        asyncio.InvalidStateError, asyncio.CancelledError) as e:
                    _reraise_real_cancellation(e)  # another task's reconnect closed the stream
                    if not failing:
                        log.warning("lease %x not renewed (%s); still trying", lease_id, e)
                    failing = True
                    if stream is not None:
                        stream.close()
                        stream = None
                    await self._rotate(client)  # a no-op if another task already replaced it
                    continue
                if failing:
                    log.info("lease %x renewed again", lease_id)
                    failing = False
                if ttl <= 0:
                    raise LeaseLostError(f"lease {lease_id:x} expired or was revoked")
        finally:
            if stream is not None:
                stream.close()

    # --- watches ---------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, *, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Events under ``prefix`` from ``start_revision`` on, until the caller stops iterating.

        A broken stream (an outage, or another task's reconnect closing the shared channel)
        is resumed from the revision after the last event delivered.
        """
        next_revision = start_revision
        while True:
            client = self._ensure_client()
            try:
                watch = await client.watch_prefix(prefix.encode(), start_revision=next_revision)
                async for event in watch:
                    kv = event.kv
                    next_revision = kv.mod_revision + 1
                    yield WatchEvent(event.kind, kv.key.decode(), kv.value, kv.mod_revision)
                reason: BaseException = ConnectionError("the watch stream ended")
            except etcd_errors.RevisionCompactedError as e:
                raise StoreError(f"watch of {prefix} fell behind compaction ({e}); re-read "
                                 "the prefix and watch again") from e
            except (*_TRANSIENT, aetcd.rpc.AioRpcError, asyncio.CancelledError) as e:
                _reraise_real_cancellation(e)
                reason = e
            log.info("watch of %s interrupted (%s); resuming from revision %d",
                     prefix, reason, next_revision)
            await self._rotate(client)
            await self._wait_reachable()

    async def _wait_reachable(self) -> None:
        """A watch outlives any outage: wait for etcd however long it takes."""
        while True:
            try:
                return await self._retry(self._status)
            except StoreUnavailableError as e:
                log.warning("%s; still waiting", e)


async def tls_mismatch(details: str, endpoint: Endpoint) -> str | None:
    """What to set when a failed connection (gRPC's ``details``) shows that the client's TLS
    and etcd's do not fit; None for any other failure (etcd down, a network outage).

    gRPC names an untrusted server certificate, and reports etcd's refusal of the client's
    certificate (an alert after the handshake) as corrupted data. One side speaking TLS to a
    plain other ends in "Socket closed", as a connection cut by an outage does: a handshake of
    our own then tells which it was.
    """
    if endpoint.tls and "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"etcd's certificate at {endpoint} is not trusted ({details.strip()}): set "
                f"{ENV_CA} to the CA that signed it, and reach etcd by a name or address "
                "its certificate lists")
    if endpoint.tls and "TSI_DATA_CORRUPTED" in details:
        return (f"etcd at {endpoint} refused this client's certificate, or requires one: set "
                f"{ENV_CERT} and {ENV_KEY} to a client certificate signed by the CA etcd "
                "trusts (its --trusted-ca-file)")
    if "Socket closed" not in details:
        return None
    speaks = await speaks_tls(endpoint)  # None: it cannot be asked, e.g. it is down
    if endpoint.tls and speaks is False:
        return (f"etcd at {endpoint} does not speak TLS: write the endpoint "
                f"http://{endpoint.host}:{endpoint.port}, or start etcd with certificates")
    if not endpoint.tls and speaks is True:
        return f"etcd at {endpoint} speaks TLS, not plain http: {WHAT_TO_SET}"
    return None


async def speaks_tls(endpoint: Endpoint, timeout_s: float = 2.0) -> bool | None:
    """Whether the server at ``endpoint`` answers a TLS handshake (an alert counts: it speaks
    TLS); None when it cannot be asked (unreachable, no answer in time)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only asking
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    except OSError:  # refused, unreachable, or timed out (TimeoutError)
        return None
    try:
        async with asyncio.timeout(timeout_s):
            await writer.start_tls(context)
    except ssl.SSLError as e:
        return "ALERT" in (e.reason or "")
    except TimeoutError:
        return None
    except OSError:  # it hung up on the handshake
        return False
    finally:
        writer.close()
    return True


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel: aetcd 1.0 opens plaintext channels only. The stubs
    are made as aetcd's own ``connect`` makes them (no etcd user authentication)."""

    def __init__(self, host: str, port: int, *, credentials: grpc.ChannelCredentials,
                 **kwargs: Any) -> None:
        super().__init__(host, port, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():  # no await below: no other task can be half-way
            return
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                               options=self._options.items())
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                              timeout=self._timeout, metadata=self.metadata)
        self._connected.set()


class _KeepAliveStream:
    """One open ``LeaseKeepAlive`` call: a request written, its reply read, in turn."""

    def __init__(self, client: aetcd.Client, call: Any) -> None:
        self.client, self.call = client, call

    @classmethod
    async def open(cls, client: aetcd.Client) -> "_KeepAliveStream":
        await client.connect()
        return cls(client, client.leasestub.LeaseKeepAlive(metadata=client.metadata))

    async def renew(self, lease_id: int) -> int:
        """The lease's TTL after renewal; 0 when etcd no longer knows it."""
        if self.call.done():  # the connection broke since the last renewal
            raise ConnectionError("the keep-alive stream has ended")
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that
        # lands as the reply arrives (CPython gh-86296), and the cancelled task renews forever.
        async with asyncio.timeout(RPC_TIMEOUT_S):
            await self.call.write(aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id))
        async with asyncio.timeout(RPC_TIMEOUT_S):
            reply = await self.call.read()
        if reply is grpc.aio.EOF:
            raise ConnectionError("etcd closed the keep-alive stream")
        return reply.TTL

    def close(self) -> None:
        self.call.cancel()


class HeldKey:
    """A JSON key kept alive on its own lease while its owner runs (``agents/<rid>``,
    ``controllers/<id>``); if an outage outlived the lease, it is written again on a new one."""

    def __init__(self, store: Store, key: str, ttl_s: int) -> None:
        self.store, self.key, self.ttl_s = store, key, ttl_s
        self.value: Any = None
        self.lease = 0

    async def set(self, value: Any) -> None:
        self.value = value
        if self.lease:
            await self.store.put_json(self.key, value, lease=self.lease)

    async def hold(self) -> None:
        """Run until cancelled; then the key is deleted with its lease."""
        try:
            while True:
                self.lease = await self.store.grant(self.ttl_s)
                await self.store.put_json(self.key, self.value, lease=self.lease)
                try:
                    await self.store.keep_alive(self.lease, self.ttl_s)
                except LeaseLostError:
                    log.warning("%s: lease lost during an etcd outage; writing it again", self.key)
        finally:
            if self.lease:
                await asyncio.shield(self._release())

    async def _release(self) -> None:
        try:
            await self.store.revoke(self.lease)
        except StoreError:
            pass  # it expires by itself


def _reraise_real_cancellation(error: BaseException) -> None:
    """gRPC raises CancelledError in calls whose channel another task closed (a reconnect):
    that is a transient failure. A cancellation of the task itself must propagate."""
    task = asyncio.current_task()
    if isinstance(error, asyncio.CancelledError) and task is not None and task.cancelling():
        raise error


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
