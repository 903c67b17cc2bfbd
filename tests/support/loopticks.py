"""Count the event loop's turns while a test awaits something, and how many of them came while a worker thread's
flag was set: a render done off the loop leaves the loop turning during it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class Ticks:
    turns: int = 0
    while_set: int = 0  # turns seen while the flag was set


@contextlib.asynccontextmanager
async def loop_ticks(flag: threading.Event) -> AsyncIterator[Ticks]:
    """A task that yields to the loop again and again, counting; stopped and awaited on every path."""
    ticks = Ticks()
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.turns += 1
            ticks.while_set += flag.is_set()
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        yield ticks
    finally:
        done.set()
        await task
