"""One timer per connection: every deadline of a connection's life on one event-loop timer handle.

A request on the front port has up to five deadlines one after another (its head, its body, the node's
answer, each write to a client that may stop reading, the keep-alive idle after it); only one is running at any
time. A :class:`Clock` keeps that one as a due time and an action and holds at most one timer handle on the
event loop for it. Moving the due time later costs nothing (the handle fires, finds it early, and is set again
for the new time, once); only moving it earlier replaces the handle. A keep-alive connection's usual sequence
(head, answer, idle for 120 s) so costs about one handle per request, where ``asyncio.timeout`` per wait and a
timer per phase cost five.

:class:`Timeout` is ``asyncio.timeout`` on a clock: a wait in the connection's handler task that ends with
``TimeoutError`` at the due time, with the connection's phase deadlines suspended meanwhile (the handler's
wait is the only deadline while a request is being answered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

__all__ = ["Clock", "Timeout"]


def _nothing() -> None:
    pass


class Clock:
    """A due time and what to do then, on at most one event-loop timer handle."""

    __slots__ = ("_action", "_armed", "_due", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._armed = 0.0  # when the handle fires (loop time)
        self._due = 0.0  # when the action is due (loop time; 0: nothing due)
        self._action: Callable[[], None] = _nothing

    @property
    def due(self) -> float:
        return self._due

    def set(self, at: float, action: Callable[[], None]) -> None:
        """``action`` at loop time ``at`` (instead of whatever was due)."""
        self._due = at
        self._action = action
        if self._handle is None or at < self._armed:
            if self._handle is not None:
                self._handle.cancel()
            self._armed = at
            self._handle = self._loop.call_at(at, self._fire)

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.set(self._loop.time() + delay, action)

    def clear(self) -> None:
        """Nothing due (the handle, if any, is left to fire and find nothing: cheaper than a cancel per phase)."""
        self._due = 0.0
        self._action = _nothing

    def close(self) -> None:
        """Nothing due, and no handle left on the loop (the connection ended)."""
        self.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        due = self._due
        if not due:
            return
        if due > self._loop.time():  # moved later since the handle was made: wait again, once
            self._armed = due
            self._handle = self._loop.call_at(due, self._fire)
            return
        action = self._action
        self.clear()
        action()


class Timeout:
    """``async with Timeout(clock, at):`` the wait inside ends with ``TimeoutError`` at loop time ``at``.

    It takes the clock over for the wait (the caller's phase deadline is off meanwhile) and clears it after.
    Cancelling the task and turning that into ``TimeoutError`` at the end is what ``asyncio.timeout`` does; a
    cancellation from anyone else stays a cancellation.
    """

    __slots__ = ("_at", "_cancelling", "_clock", "_expired", "_task")

    def __init__(self, clock: Clock, at: float) -> None:
        self._clock = clock
        self._at = at
        self._expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> Timeout:
        self._task = task = asyncio.current_task()
        self._cancelling = task.cancelling() if task is not None else 0
        self._clock.set(self._at, self._expire)
        return self

    def _expire(self) -> None:
        if self._task is not None and not self._task.done():
            self._expired = True
            self._task.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._clock.clear()
        if self._expired and self._task is not None:
            if self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
                raise TimeoutError from exc
