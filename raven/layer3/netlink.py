"""Netlink calls on an event loop that can make them, whatever loop the service runs.

pyroute2's asyncio API opens its netlink socket as an asyncio datagram endpoint, which uvloop (the services'
loop) refuses for AF_NETLINK ("cannot open a UDP handle, invalid family 16"). Netlink work is rare (start, a
route change, stop), so each call runs to completion on a plain selector loop in a worker thread; callers of one
object serialise their calls (a lock), so no two threads touch it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def on_netlink_loop(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``fn()`` on a fresh selector event loop in a worker thread and return its result."""

    def run() -> T:
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            return runner.run(fn())

    return await asyncio.to_thread(run)
