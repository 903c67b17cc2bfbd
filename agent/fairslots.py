"""Fair shares of a node's upstream connections: a bounded slot pool with per-client caps and round-robin.

Each node gets at most ``limit`` requests (HTTP or TCP) at once from this agent. One client (the gateway's
opaque fairness key) holds at most ``per_key`` of them, so one stalled or hostile client cannot take a node
from everybody else. Streams that must wait queue per client, and a freed slot goes to the next client in
turn (round robin), not to whoever asked most. The queue is bounded; a waiter that leaves (its stream was
reset, its deadline passed) leaves the queue. A waiter may also say how to tell that nobody wants it any more
(``gone``: its stream was reset, its client left): such a waiter is never handed a slot, even when the news
arrived in the same loop turn as the free slot and its task has not run yet; it is dropped from the queue and
told so (:class:`Abandoned`), and the slot goes to the next waiter in turn. Pure asyncio futures, no polling.

Clients that leave at once (a Prometheus restarting, a network cut at the gateway) reach the agent as RESETs
spread over several messages, tens of milliseconds apart: the gateway notices each departure in its own turn. A
slot freed by an early RESET must not go to a queued request whose own RESET is still on its way. So while
requests leave (:meth:`FairSlots.settle`: the forwarder calls it on every RESET from the gateway for a request
of this node), free slots are held back until none has left for ``SETTLE_QUIET`` seconds, at most
``SETTLE_MAX`` after the first: then the queue is looked at, and the requests whose clients left in the same
burst are dropped, never dialled. A slot freed by a request that ended normally is handed on at once, as
before, unless a burst of departures is being settled.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from raven.counters import KeyedCounter
from raven.errors import RavenError


class QueueFull(RavenError):
    """Too many requests are already waiting for this node."""


class Abandoned(RavenError):
    """The waiter's request was abandoned (its ``gone`` said so) while it waited: it was given no slot."""


@dataclass(slots=True)
class _Waiter:
    fut: asyncio.Future[None]
    gone: Callable[[], bool] | None

    def dead(self) -> bool:
        """Nobody waits for this any more: cancelled, or abandoned by its request."""
        return self.fut.done() or (self.gone is not None and self.gone())


class FairSlots:
    SETTLE_QUIET = 0.1  # seconds without a departure before slots freed by departures are handed on
    SETTLE_MAX = 0.5  # seconds: a steady stream of departures holds the queue no longer than this

    def __init__(self, limit: int, per_key: int, max_waiting: int) -> None:
        self.limit = limit
        self.per_key = max(1, min(per_key, limit))
        self.max_waiting = max_waiting
        self.active = 0
        self.held: KeyedCounter[str] = KeyedCounter()  # slots taken per client key
        self.waiting = 0
        self._queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        self._settle_timer: asyncio.TimerHandle | None = None  # pending while a burst of departures settles
        self._settle_start = 0.0

    @property
    def idle(self) -> bool:
        return self.active == 0 and self.waiting == 0

    def _may_take(self, key: str) -> bool:
        return self.active < self.limit and self.held.count(key) < self.per_key

    def _take(self, key: str) -> None:
        self.active += 1
        self.held.add(key)

    @property
    def settling(self) -> bool:
        """Requests are leaving: free slots wait (see :meth:`settle`)."""
        return self._settle_timer is not None

    def try_acquire(self, key: str) -> bool:
        """Take a slot for ``key`` if one is free for it now, without waiting; say whether it did."""
        if self._queues and (key in self._queues or self._settle_timer is not None):
            return False  # behind its own queue, or behind a queue that waits for departures to settle
        if self._may_take(key):
            self._take(key)
            return True
        return False

    async def acquire(self, key: str, gone: Callable[[], bool] | None = None) -> None:
        """Take a slot for ``key``; wait in ``key``'s queue when none is free (cancel the wait to leave).

        ``gone()`` says whether the request still wants its slot; one that is gone when its turn comes is dropped
        from the queue and raises :class:`Abandoned` instead of taking a slot.
        """
        if self.try_acquire(key):
            return
        if self.waiting >= self.max_waiting:
            self._drop_dead()  # abandoned waiters whose tasks have not run yet hold no place in a full queue
            if self.waiting >= self.max_waiting:
                raise QueueFull(f"{self.waiting} requests already waiting")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append(_Waiter(fut, gone))
        self.waiting += 1
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(key)  # granted just as the waiter left: hand the slot on
            else:
                self._forget(key, fut)
            raise

    def _forget(self, key: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(key)
        if queue is None:
            return
        for waiter in queue:
            if waiter.fut is fut:
                queue.remove(waiter)
                self.waiting -= 1
                if not queue:
                    del self._queues[key]
                return

    def _drop_dead(self) -> None:
        """Take every waiter that is cancelled or abandoned out of the queue (and tell the abandoned ones)."""
        for key in list(self._queues):
            queue = self._queues[key]
            live = deque(w for w in queue if not w.dead())
            for waiter in queue:
                if waiter.dead():
                    self.waiting -= 1
                    _abandon(waiter)
            if live:
                self._queues[key] = live
            else:
                del self._queues[key]

    def resize(self, limit: int, per_key: int) -> None:
        """New limits (a configuration reload): more room is handed out at once, less takes effect as slots free."""
        self.limit = limit
        self.per_key = max(1, min(per_key, limit))
        self._grant()

    def release(self, key: str) -> None:
        self.active -= 1
        self.held.remove(key)
        self._grant()

    def settle(self) -> None:
        """A request of this node left (the gateway reset its stream: its client is gone), and others may be leaving
        with it: hold free slots back until none has left for ``SETTLE_QUIET``, at most ``SETTLE_MAX`` after the
        first, so that a queued request whose RESET is still on its way is dropped, not dialled. Nothing to hold
        back while nobody waits."""
        if not self._queues:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._settle_timer is None:
            self._settle_start = now
        else:
            self._settle_timer.cancel()
        when = min(now + self.SETTLE_QUIET, self._settle_start + self.SETTLE_MAX)
        self._settle_timer = loop.call_at(when, self._settled)

    def _settled(self) -> None:
        self._settle_timer = None
        self._grant()

    def close(self) -> None:
        """Forget a pending settle (the node's slots are dropped)."""
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None

    def _grant(self) -> None:
        """Hand free slots to waiting clients in turn: the first client in line that is under its share."""
        if self._settle_timer is not None:
            return  # departures are settling: the queue is looked at once they have
        while self.active < self.limit and self._queues:
            for key in self._queues:
                if self.held.count(key) < self.per_key:
                    break
            else:
                return  # every waiting client is at its share
            queue = self._queues.pop(key)
            waiter = queue.popleft()
            self.waiting -= 1
            if queue:
                self._queues[key] = queue  # to the back of the line: round robin
            if waiter.dead():
                _abandon(waiter)  # cancelled and not run yet, or its request is gone: never given a slot
                continue
            self._take(key)
            waiter.fut.set_result(None)


def _abandon(waiter: _Waiter) -> None:
    if not waiter.fut.done():
        waiter.fut.set_exception(Abandoned("the request was abandoned while it waited"))
