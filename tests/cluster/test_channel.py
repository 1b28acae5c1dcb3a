"""The direct stream channel between the ingress and a replica (cluster/channel.py), without Ray: a ChannelServer
over a fake generate on loopback, and the ingress's Channel.

Checked against what the Ray Serve handle path guarantees: every message of every stream arrives in order and
the stream ends; concurrent streams on one connection do not mix; cancelling a stream runs the replica's
finally (the request's release) and the others go on; a generator that raises fails only its own stream; a
replica that goes away fails every open stream with ChannelClosed (never a hang) and the next stream reconnects;
a connection without the replica's secret is closed before anything it sent is unpickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import struct

import pytest

from twospeed.cluster.channel import Channel, ChannelAddress, ChannelClosed, ChannelServer

DEADLINE = 10.0  # seconds any await here may take before the test fails (never a timing assertion)


class FakeReplica:
    """generate(payload): yields payload["n"] messages (or waits forever with "hold"), raises with "raise";
    records what started and what was released."""

    def __init__(self):
        self.started: list = []
        self.released: list = []
        self.holding = asyncio.Event()

    async def generate(self, payload):
        self.started.append(payload["id"])
        try:
            for i in range(payload.get("n", 0)):
                yield (payload["id"], i)
                await asyncio.sleep(0)
            if payload.get("raise"):
                raise RuntimeError("the engine broke")
            if payload.get("hold"):
                self.holding.set()
                await asyncio.Event().wait()
        finally:
            self.released.append(payload["id"])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE))


@contextlib.asynccontextmanager
async def served():
    """A fake replica's ChannelServer on loopback and an ingress Channel to it; both closed on the way out."""
    replica = FakeReplica()
    server = ChannelServer(replica.generate)
    channel = Channel(await server.start("127.0.0.1"))
    try:
        yield replica, server, channel
    finally:
        channel.close()
        await server.stop()


async def _drain(stream) -> list:
    return [m async for m in stream]


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def test_concurrent_streams_arrive_whole_and_in_order():
    async def main():
        async with served() as (replica, server, channel):
            streams = [await channel.open({"id": k, "n": 20 + k}) for k in range(5)]
            got = await asyncio.gather(*(_drain(s) for s in streams))
            for k, messages in enumerate(got):
                assert messages == [(k, i) for i in range(20 + k)]
            await _until(lambda: len(replica.released) == 5)

    run(main())


def test_cancel_releases_that_request_only():
    async def main():
        async with served() as (replica, server, channel):
            held = await channel.open({"id": "held", "n": 1, "hold": True})
            assert await held.__anext__() == ("held", 0)
            await asyncio.wait_for(replica.holding.wait(), DEADLINE)
            other = await channel.open({"id": "other", "n": 3})
            held.cancel()
            await _until(lambda: "held" in replica.released)
            assert await _drain(other) == [("other", i) for i in range(3)]
            with pytest.raises(StopAsyncIteration):
                await held.__anext__()

    run(main())


def test_a_raising_generator_fails_its_own_stream():
    async def main():
        async with served() as (replica, server, channel):
            bad = await channel.open({"id": "bad", "n": 2, "raise": True})
            good = await channel.open({"id": "good", "n": 4})
            assert [await bad.__anext__() for _ in range(2)] == [("bad", 0), ("bad", 1)]
            with pytest.raises(ChannelClosed, match="the engine broke"):
                await bad.__anext__()
            assert await _drain(good) == [("good", i) for i in range(4)]

    run(main())


def test_a_replica_that_goes_away_fails_every_open_stream_and_the_next_reconnects():
    async def main():
        async with served() as (replica, server, channel):
            streams = [await channel.open({"id": k, "n": 1, "hold": True}) for k in range(3)]
            for s in streams:
                await s.__anext__()
            await server.stop()  # the replica's process would close them the same way when it dies
            for s in streams:
                with pytest.raises(ChannelClosed):
                    await s.__anext__()
            await _until(lambda: len(replica.released) == 3)  # the replica's side let every request go
            # a new replica instance (another port): the old address is refused, the new one serves
            with pytest.raises(OSError):
                await (await channel.open({"id": "late", "n": 1})).__anext__()
            server2 = ChannelServer(replica.generate)
            channel.address = await server2.start("127.0.0.1")
            assert await _drain(await channel.open({"id": "again", "n": 2})) == [("again", 0), ("again", 1)]
            await server2.stop()

    run(main())


class Boom:
    """Unpickling this would run code: the server must never unpickle a frame from a connection without the secret."""

    opened = []

    def __reduce__(self):
        return (Boom.opened.append, ("unpickled",))


def test_a_connection_without_the_secret_is_closed_unread():
    async def main():
        async with served() as (replica, server, _):
            a = server.address
            reader, writer = await asyncio.open_connection(a.host, a.port)
            body = pickle.dumps(("open", 1, Boom()))
            writer.write(b"0" * 32 + struct.pack(">I", len(body)) + body)
            await writer.drain()
            assert await reader.read() == b""  # closed by the server
            assert Boom.opened == [] and replica.started == []
            with pytest.raises(ChannelClosed):  # and a client given the wrong secret gets a closed stream
                stream = await Channel(ChannelAddress(a.host, a.port, "f" * 32)).open({"id": 1, "n": 1})
                await stream.__anext__()

    run(main())
