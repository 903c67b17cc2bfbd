"""CONNECT: relay a client connection's raw bytes through a tunnel stream, both ways, until either side ends.

After the ``200 Connection established`` the client connection is taken over from the HTTP parser; the
relay waits for transport flow control (no polling) and ends a tunnel idle for ``idle`` seconds or a client
that reads nothing for ``stall`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from raven.aio import cancel_and_wait
from raven.http.call import ServerCall
from raven.transport.tunnel import Stream, StreamReset

log = logging.getLogger("raven.gateway.proxy")


class _TunnelFeeder:
    """Takes over the client connection's bytes after CONNECT (:meth:`~raven.http.call.ServerCall.take_over`)."""

    HIGH = 256 * 1024

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.chunks: list[bytes] = []
        self.size = 0
        self.eof = False
        self.paused = False
        self.wake = asyncio.Event()

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > self.HIGH and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self.wake.set()
        return False, b""

    def feed_eof(self) -> None:
        self.eof = True
        self.wake.set()

    def take(self) -> list[bytes]:
        out, self.chunks, self.size = self.chunks, [], 0
        if self.paused:
            self.paused = False
            with contextlib.suppress(Exception):
                self.transport.resume_reading()
        self.wake.clear()
        return out


async def relay_tcp(request: ServerCall, stream: Stream, idle: float, stall: float) -> tuple[int, int]:
    transport = request.transport
    assert transport is not None
    loop = asyncio.get_running_loop()
    feeder = _TunnelFeeder(transport)
    request.take_over(feeder)
    counts = [0, 0]
    last = [loop.time()]  # activity in either direction keeps the tunnel alive

    async def up() -> None:
        while True:
            await feeder.wake.wait()
            for chunk in feeder.take():
                await stream.write(chunk)
                counts[0] += len(chunk)
                last[0] = loop.time()
            if feeder.eof and not feeder.chunks:
                stream.end()
                return

    async def down() -> None:
        while chunk := await stream.read():
            transport.write(chunk)
            counts[1] += len(chunk)
            last[0] = loop.time()
            try:
                async with asyncio.timeout(stall):  # the transport paused writing: wait until the client reads
                    await request.drained()
            except TimeoutError:
                raise ConnectionResetError(f"the client read nothing for {stall:.0f}s") from None

    async def watchdog() -> None:
        while (quiet := loop.time() - last[0]) < idle:  # noqa: ASYNC110 (a timer, not a condition wait)
            await asyncio.sleep(min(1.0, idle - quiet + 0.01))
        log.info("CONNECT to %s:%d idle for %.0fs: closing", stream.open.node, stream.open.port, idle)

    up_task = asyncio.ensure_future(up())
    down_task = asyncio.ensure_future(down())
    dog_task = asyncio.ensure_future(watchdog())
    tasks = (up_task, down_task, dog_task)
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # re-raise what ended it
        if up_task in done and down_task not in done:
            # The client half-closed: let the node finish its answer (the watchdog still runs).
            done, _ = await asyncio.wait((down_task, dog_task), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
    except (StreamReset, ConnectionError) as exc:
        log.info("CONNECT relay to %s:%d ended: %s", stream.open.node, stream.open.port, exc)
    finally:
        await cancel_and_wait(tasks)
    return counts[0], counts[1]
