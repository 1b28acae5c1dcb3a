"""A direct stream from the ingress to an engine replica: one TCP connection per replica, many requests on it.

Why: a request's hop through a Ray Serve DeploymentHandle crosses Serve's router, Ray's task submission and two
core workers' threads before the replica's event loop sees it; on a loaded two-core machine that was the route
time's whole p99 (BENCHMARKS.md). Ray Serve still owns the replicas (placement, health checks, restarts) and
the control calls (describe, ping, metrics); only the requests' streams take this path.

Frames: a 4-byte big-endian length, then a pickle of (kind, stream id, payload). The ingress opens a stream
with ("open", id, Admission) and may end it early with ("cancel", id, None); the replica answers each
stream with ("msg", id, Admitted | Refused | Batch) frames, then ("end", id, None), or ("error", id, text) if
its generator raised. A connection starts with the replica's secret (from its ping(), over Ray) in plain
bytes, checked before anything is unpickled, so only an ingress that asked Ray can speak. A connection that
breaks fails every stream on it (the replica went away); the next stream opens a new connection.

No Ray and no torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20  # bytes: a frame longer than this is a broken peer, not a message
SECRET_BYTES = 32  # hex characters of a replica's secret, sent first on every connection


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """Where a replica's channel listens, and the secret a connection must open with."""

    host: str
    port: int
    secret: str


class ChannelClosed(ConnectionError):
    """The connection to the replica broke (it died, or closed it): the stream's request is lost there."""


async def _read_frame(reader: asyncio.StreamReader) -> tuple[str, int, Any]:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME:
        raise ChannelClosed(f"a frame of {size} bytes")
    return pickle.loads(await reader.readexactly(size))


def _frame(kind: str, stream: int, payload: Any) -> bytes:
    body = pickle.dumps((kind, stream, payload), protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


# -- the replica's side ---------------------------------------------------------------------------------------
class ChannelServer:
    """Serves `generate(payload) -> async iterator of messages` to the ingress's connections."""

    def __init__(self, generate: Callable[[Any], AsyncIterator[Any]]):
        self._generate = generate
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._secret = secrets.token_hex(SECRET_BYTES // 2)
        self.address: ChannelAddress | None = None

    async def start(self, host: str) -> ChannelAddress:
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = ChannelAddress(host, port, self._secret)
        return self.address

    async def stop(self) -> None:
        """Stop listening and close every connection (their open streams fail at the ingress)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: dict[int, asyncio.Task] = {}
        self._writers.add(writer)
        try:
            secret = await reader.readexactly(SECRET_BYTES)
            if not hmac.compare_digest(secret, self._secret.encode()):
                log.warning("channel: a connection without the replica's secret, closed")
                return
            while True:
                kind, stream, payload = await _read_frame(reader)
                if kind == "open":
                    tasks[stream] = asyncio.get_running_loop().create_task(
                        self._run(stream, payload, writer, tasks))
                elif kind == "cancel" and stream in tasks:
                    tasks.pop(stream).cancel()
        except (asyncio.IncompleteReadError, ConnectionError, ChannelClosed, pickle.UnpicklingError):
            pass  # the ingress went away (or spoke nonsense): its streams end below
        finally:
            for task in tasks.values():
                task.cancel()
            self._writers.discard(writer)
            writer.close()

    async def _run(self, stream: int, payload: Any, writer: asyncio.StreamWriter,
                   tasks: dict[int, asyncio.Task]) -> None:
        async def send(kind: str, message: Any) -> None:
            writer.write(_frame(kind, stream, message))  # a whole frame at once: streams never interleave inside one
            await writer.drain()

        gen = self._generate(payload)
        try:
            async for message in gen:
                await send("msg", message)
            await send("end", None)
        except (asyncio.CancelledError, ConnectionError):
            pass  # the ingress cancelled it, or went away
        except Exception as e:  # the generator raised: the ingress treats it as the replica failing this stream
            with contextlib.suppress(Exception):
                await send("error", f"{type(e).__name__}: {e}")
        finally:
            await gen.aclose()  # its own finally (the request's release) runs now, cancelled or not
            tasks.pop(stream, None)


# -- the ingress's side ---------------------------------------------------------------------------------------
class ChannelStream:
    """One request's messages from the replica: `await anext(stream)`, `async for`, `cancel()` — the same
    interface as Ray Serve's streaming response, so the ingress's client reads either."""

    def __init__(self, channel: "Channel", stream: int):
        self._channel, self._id = channel, stream
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> "ChannelStream":
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        kind, payload = await self._queue.get()
        if kind == "msg":
            return payload
        self._done = True
        self._channel._streams.pop(self._id, None)
        if kind == "end":
            raise StopAsyncIteration
        raise ChannelClosed(payload)

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._channel._cancel(self._id)

    def _put(self, kind: str, payload: Any) -> None:
        self._queue.put_nowait((kind, payload))


class Channel:
    """The ingress's connection to one replica, opened on first use and again after it breaks."""

    def __init__(self, address: ChannelAddress):
        self.address = address
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None
        self._streams: dict[int, ChannelStream] = {}
        self._next = 0

    async def open(self, payload: Any) -> ChannelStream:
        """Start a request on the replica; its messages arrive on the returned stream."""
        writer = await self._connect()
        self._next += 1
        stream = self._streams[self._next] = ChannelStream(self, self._next)
        writer.write(_frame("open", self._next, payload))
        return stream

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()

    async def _connect(self) -> asyncio.StreamWriter:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                a = self.address
                reader, writer = await asyncio.open_connection(a.host, a.port)
                writer.write(a.secret.encode())
                self._writer = writer
                self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, writer))
            return self._writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = "the replica closed the connection"
        try:
            while True:
                kind, stream, payload = await _read_frame(reader)
                if (s := self._streams.get(stream)) is not None:
                    s._put(kind, payload)
        except asyncio.CancelledError:
            reason = "the ingress closed the connection"
        except (asyncio.IncompleteReadError, ConnectionError, ChannelClosed, pickle.UnpicklingError) as e:
            reason = f"the connection to the replica broke ({type(e).__name__})"
        finally:
            writer.close()
            if self._writer is writer:
                self._writer = None
            streams, self._streams = self._streams, {}
            for s in streams.values():
                s._put("error", reason)

    def _cancel(self, stream: int) -> None:
        self._streams.pop(stream, None)
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(_frame("cancel", stream, None))
