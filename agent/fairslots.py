"""Fair shares of a node's upstream connections: a bounded slot pool with per-client caps and round-robin.

Each node gets at most ``limit`` requests (HTTP or TCP) at once from this agent. One client (the gateway's
opaque fairness key) holds at most ``per_key`` of them, so one stalled or hostile client cannot take a node
from everybody else. Streams that must wait queue per client, and a freed slot goes to the next client in
turn (round robin), not to whoever asked most. The queue is bounded; a waiter that leaves (its stream was
reset, its deadline passed) leaves the queue. Pure asyncio futures, no polling.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from raven.errors import RavenError


class QueueFull(RavenError):
    """Too many requests are already waiting for this node."""


class FairSlots:
    def __init__(self, limit: int, per_key: int, max_waiting: int) -> None:
        self.limit = limit
        self.per_key = max(1, min(per_key, limit))
        self.max_waiting = max_waiting
        self.active = 0
        self.held: dict[str, int] = {}
        self.waiting = 0
        self._queues: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def idle(self) -> bool:
        return self.active == 0 and self.waiting == 0

    def _may_take(self, key: str) -> bool:
        return self.active < self.limit and self.held.get(key, 0) < self.per_key

    def _take(self, key: str) -> None:
        self.active += 1
        self.held[key] = self.held.get(key, 0) + 1

    def try_acquire(self, key: str) -> bool:
        """Take a slot for ``key`` if one is free for it now, without waiting; say whether it did."""
        if self._may_take(key) and key not in self._queues:
            self._take(key)
            return True
        return False

    async def acquire(self, key: str) -> None:
        """Take a slot for ``key``; wait in ``key``'s queue when none is free (cancel the wait to leave)."""
        if self.try_acquire(key):
            return
        if self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.waiting} requests already waiting")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append(fut)
        self.waiting += 1
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(key)  # granted just as the waiter left: hand the slot on
            else:
                self._forget(key, fut)
            raise

    def _forget(self, key: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(key)
        if queue is not None and fut in queue:
            queue.remove(fut)
            self.waiting -= 1
            if not queue:
                del self._queues[key]

    def resize(self, limit: int, per_key: int) -> None:
        """New limits (a configuration reload): more room is handed out at once, less takes effect as slots free."""
        self.limit = limit
        self.per_key = max(1, min(per_key, limit))
        self._grant()

    def release(self, key: str) -> None:
        self.active -= 1
        left = self.held.get(key, 1) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to waiting clients in turn: the first client in line that is under its share."""
        while self.active < self.limit and self._queues:
            for key in self._queues:
                if self.held.get(key, 0) < self.per_key:
                    break
            else:
                return  # every waiting client is at its share
            queue = self._queues.pop(key)
            fut = queue.popleft()
            self.waiting -= 1
            if queue:
                self._queues[key] = queue  # to the back of the line: round robin
            if fut.done():
                continue  # its waiter was cancelled and has not run yet: skip it
            self._take(key)
            fut.set_result(None)
