"""Count the event loop's turns while a test awaits something, and how many of them came while a worker thread's
flag was set: a render done off the loop leaves the loop turning during it; and how long a call holds the loop before
it first waits."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


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


async def held_before_first_wait(start: Callable[[], Awaitable[T]]) -> tuple[float, T]:
    """How long ``start()`` held the event loop before it first waited (seconds of wall time: for a view, its part on
    the loop up to handing the render to a thread, or the whole read when it finds the page kept), and its result."""
    started = time.perf_counter()
    task = asyncio.ensure_future(start())
    await asyncio.sleep(0)  # the task runs up to its first wait (or to its end) before this returns
    held = time.perf_counter() - started
    return held, await task
