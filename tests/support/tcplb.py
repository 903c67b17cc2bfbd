"""A small round-robin TCP load balancer, standing in for a Kubernetes Service in front of replicas.

Its copy loop (:func:`pipe`) passes on what kube-proxy's NAT passes on: FIN for FIN, RST for RST.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from raven.aio import reset_connection


class TcpBalancer:
    def __init__(self, listen: tuple[str, int], backends: list[tuple[str, int]]) -> None:
        self.listen = listen
        self.backends = backends
        self._next = itertools.cycle(range(len(backends)))
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, *self.listen)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        up_writer: asyncio.StreamWriter | None = None
        try:
            for _ in range(len(self.backends)):
                host, port = self.backends[next(self._next)]
                try:
                    async with asyncio.timeout(3):
                        up_reader, up_writer = await asyncio.open_connection(host, port)
                    break
                except (OSError, TimeoutError):
                    continue
            if up_writer is None:
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            for w in (writer, up_writer):
                if w is not None:
                    w.close()


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction as kube-proxy's NAT does: a half close passes on (a FIN for a FIN), and so does a
    reset (an RST for an RST), so that the other peer sees at once that the connection broke.

    A write that fails (the receiving peer went away) ends the copy; the other direction's read sees that
    peer's end and passes it on.
    """
    while True:
        try:
            data = await reader.read(65536)
        except OSError:  # the sending peer reset the connection (or it broke): so does the receiving one's
            reset_connection(writer.transport)
            return
        if not data:
            break
        try:
            writer.write(data)
            await writer.drain()
        except OSError:
            return
    if writer.can_write_eof() and not writer.transport.is_closing():
        with contextlib.suppress(OSError):
            writer.write_eof()
