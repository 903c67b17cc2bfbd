"""Small asyncio helpers for cleanup paths: cancel tasks and wait for them; reset a connection; stop a process
with a grace period."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Future[object] | asyncio.Task[None] | None]) -> None:
    """Cancel every task, then wait for each to finish; their results and errors are dropped."""
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(BaseException):
            await task


def retrieve_exception(fut: asyncio.Future[Any]) -> None:
    """A done callback for a future that may end with nobody awaiting it any more (its awaiter timed out or was
    cancelled through a shield): its error is taken, so asyncio does not report it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def reset_connection(transport: asyncio.WriteTransport) -> None:
    """End a TCP connection with a reset (RST), now: the peer must not take what it got as complete.

    ``abort()`` alone drops what is still to send, but the kernel then sends a FIN, which a reader takes for a
    clean end (an HTTP/1.0 body delimited by the close, a relayed stream); SO_LINGER 0 makes the close an RST.
    """
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def stop_process(process: asyncio.subprocess.Process, sig: int, grace: float) -> int:
    """Send ``sig``, wait up to ``grace`` seconds, then SIGKILL. Returns the exit code."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            async with asyncio.timeout(grace):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    return process.returncode if process.returncode is not None else -1
