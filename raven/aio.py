"""Small asyncio helpers for cleanup paths: cancel tasks and wait for them; stop a process with a grace period."""

from __future__ import annotations

import asyncio
import contextlib
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
