"""One way for tests to wait for a condition: poll it, with a deadline and a message."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    timeout: float = 15.0,
    what: str = "condition",
    *,
    interval: float = 0.1,
    tolerate: tuple[type[BaseException], ...] = (),
) -> float:
    """Poll ``check`` (plain or async) until it is true; return how long that took.

    Exceptions listed in ``tolerate`` (a server not up yet, say) count as "not yet".
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return loop.time() - start
        except tolerate:
            pass
        if loop.time() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(interval)
