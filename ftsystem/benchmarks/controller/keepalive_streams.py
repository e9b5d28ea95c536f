"""Keep-alives over long-lived LeaseKeepAlive streams, as etcd's Go client keeps one per client:
keep-alives due together go out in one write. etcd still renews each lease on its own request;
only the transport is shared.

Not grpcio: its asyncio stream costs ~165 us of Python per keep-alive (measured), so 5,000/s
would take most of a core of a 2-core machine. A gRPC stream is HTTP/2 DATA frames carrying
length-prefixed protobuf messages, so this module speaks it directly with ``h2`` (a sans-I/O
HTTP/2 state machine) under an asyncio protocol: no task wakes up per chunk of replies.
"""

from __future__ import annotations

import asyncio
import struct
import sys
import time
from collections.abc import Callable

from aetcd.rpc import LeaseKeepAliveResponse
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (ConnectionTerminated, DataReceived, RemoteSettingsChanged, StreamEnded,
                       StreamReset, TrailersReceived, WindowUpdated)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings

from ftsystem.control.store import parse_endpoints

KEEPALIVES_PER_FRAME = 1000
"""A keep-alive request on the wire: 5-byte gRPC prefix, 1-byte tag, a varint of at most 9
bytes. This many fit in one HTTP/2 DATA frame of the default maximum size (16 KiB)."""
OUR_WINDOW = 2**31 - 1
"""A huge receive window, for every stream and the connection: the replies never wait for our
WINDOW_UPDATEs."""
ENDED = (StreamEnded, StreamReset, TrailersReceived, ConnectionTerminated)
"""Events after which a stream carries no more replies: one stream ended ends them all, and
the connection is opened again."""


def keepalive_request(lease: int) -> bytes:
    """One gRPC message ``LeaseKeepAliveRequest{ID: lease}``, length-prefixed."""
    body = b"\x08" + _varint(lease)
    return b"\x00" + struct.pack(">I", len(body)) + body


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


class BatchedKeepAlives:
    """Keep-alives over ``num_streams`` LeaseKeepAlive streams of one connection of their own.

    etcd may end a stream: 3.4 does when its apply falls more than a second behind its
    commits ("waiting for the applied index took too long", seen on a starved machine). Its
    clients open another and carry on, and so does this one (``restarts`` counts them).
    """

    RECONNECT_FOR_S = 30.0

    def __init__(self, url: str, on_reply: Callable[[int, int], None],
                 num_streams: int = 64) -> None:
        self.endpoint = parse_endpoints(url)[0]
        self.on_reply, self.num_streams = on_reply, num_streams
        self.restarts = 0
        self._streams: KeepAliveStreams | None = None
        self._up = asyncio.Event()
        self.reader_task: asyncio.Task | None = None
        """Fails only when no stream can be opened again for RECONNECT_FOR_S."""

    async def open(self) -> None:
        await self._connect()
        self.reader_task = asyncio.create_task(self._keep_open())

    async def close(self) -> None:
        if self.reader_task is not None:
            self.reader_task.cancel()
            await asyncio.gather(self.reader_task, return_exceptions=True)
        if self._streams is not None:
            self._streams.close()

    async def send(self, leases: list[int]) -> None:
        await self._up.wait()  # while a stream is being opened again, the keep-alives wait
        await self._streams.send(leases)

    async def _connect(self) -> None:
        host, port = self.endpoint.host, self.endpoint.port
        _, self._streams = await asyncio.get_running_loop().create_connection(
            lambda: KeepAliveStreams(f"{host}:{port}", self.num_streams, self.on_reply),
            host, port)
        self._up.set()

    async def _keep_open(self) -> None:
        while True:
            try:
                await self._streams.ended
            except ConnectionError as e:
                print(f"keep-alive stream ended ({e}); opening another", file=sys.stderr)
            self._up.clear()
            self._streams.close()
            self.restarts += 1
            await self._reconnect()

    async def _reconnect(self) -> None:
        deadline = time.monotonic() + self.RECONNECT_FOR_S
        while True:
            try:
                return await self._connect()
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no keep-alive stream to etcd for "
                                          f"{self.RECONNECT_FOR_S:.0f} s: {e}") from e
                await asyncio.sleep(0.1)


class KeepAliveStreams(asyncio.Protocol):
    """One HTTP/2 connection carrying ``num_streams`` LeaseKeepAlive streams, each lease always
    on the same one; what falls due together goes out in one write, whatever the streams.

    Several streams because etcd renews a stream's requests one after the other, and 3.4 makes
    each renewal wait until its apply has caught up with its commits: over a single stream,
    16,384 leases' renewals queue behind each other while etcd writes (at startup they did,
    until leases lapsed). Real agents each have their own stream.
    """

    def __init__(self, authority: str, num_streams: int,
                 on_reply: Callable[[int, int], None]) -> None:
        self.authority, self.on_reply = authority, on_reply
        self.stream_ids = [2 * i + 1 for i in range(num_streams)]  # client streams are odd
        self._h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self._h2.local_settings = Settings(
            client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: OUR_WINDOW})
        self._grpc_bufs = dict.fromkeys(self.stream_ids, b"")
        self._window_open = asyncio.Event()
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(OUR_WINDOW - self._h2.inbound_flow_control_window)
        headers = [(":method", "POST"), (":scheme", "http"),
                   (":path", "/etcdserverpb.Lease/LeaseKeepAlive"),
                   (":authority", self.authority),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        for sid in self.stream_ids:
            self._h2.send_headers(sid, headers)
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except ProtocolError as e:
            self._end(ConnectionError(f"etcd broke the HTTP/2 protocol: {e!r}"))
            return
        for event in events:
            if isinstance(event, DataReceived):
                self._data(event)
            elif isinstance(event, (WindowUpdated, RemoteSettingsChanged)):
                self._window_open.set()
            elif isinstance(event, ENDED):
                self._end(ConnectionError(f"etcd ended a keep-alive stream: {event}"))
        self._flush()  # settings and ping acknowledgements, window updates

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ConnectionError(f"etcd closed the keep-alive connection ({exc})"))

    def close(self) -> None:
        self._transport.close()

    def _end(self, error: ConnectionError) -> None:
        if not self.ended.done():
            self.ended.set_exception(error)
        self._window_open.set()  # a sender waiting for window gives up

    def _flush(self) -> None:
        if out := self._h2.data_to_send():
            self._transport.write(out)

    async def send(self, leases: list[int]) -> None:
        """One DATA frame per stream with leases due, all in one write. No drain: HTTP/2 flow
        control already bounds what can wait in the send buffer."""
        by_stream: dict[int, list[bytes]] = {}
        for lease in leases:
            sid = self.stream_ids[lease % len(self.stream_ids)]
            by_stream.setdefault(sid, []).append(keepalive_request(lease))
        for sid, requests in by_stream.items():
            for start in range(0, len(requests), KEEPALIVES_PER_FRAME):
                payload = b"".join(requests[start:start + KEEPALIVES_PER_FRAME])
                if not await self._window_for(sid, len(payload)):
                    return  # lost, as those in flight are: the next interval sends them again
                self._h2.send_data(sid, payload)
        self._flush()

    async def _window_for(self, sid: int, size: int) -> bool:
        """Wait until etcd has room for ``size`` bytes on ``sid``; False if the streams ended."""
        while not self.ended.done():
            if self._h2.local_flow_control_window(sid) >= size:
                return True
            self._window_open.clear()  # etcd has not read what we sent: wait for it
            await self._window_open.wait()
        return False

    def _data(self, event: DataReceived) -> None:
        self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        sid = event.stream_id
        if sid in self._grpc_bufs:
            self._grpc_bufs[sid] = self._take_replies(self._grpc_bufs[sid] + event.data)

    def _take_replies(self, buf: bytes) -> bytes:
        """Hand each complete gRPC message in ``buf`` to ``on_reply``; the incomplete rest."""
        pos = 0
        while len(buf) - pos >= 5:
            length = int.from_bytes(buf[pos + 1:pos + 5], "big")
            if len(buf) - pos < 5 + length:
                break
            reply = LeaseKeepAliveResponse.FromString(buf[pos + 5:pos + 5 + length])
            self.on_reply(reply.ID, reply.TTL)
            pos += 5 + length
        return buf[pos:]
