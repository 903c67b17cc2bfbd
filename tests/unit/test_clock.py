"""One timer per connection (raven/http/clock.py): a due time moved later costs no new timer handle, the action
runs at the latest due time only, and a Timeout on it behaves as ``asyncio.timeout``."""

from __future__ import annotations

import asyncio

import pytest

from raven.http.clock import Clock, Timeout

pytestmark = pytest.mark.asyncio


class Counting:
    """Counts the timer handles a clock asks the loop for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.handles = 0
        self._call_at = loop.call_at

    def __enter__(self) -> Counting:
        def call_at(when: float, callback: object, *args: object, **kwargs: object) -> asyncio.TimerHandle:
            self.handles += getattr(callback, "__name__", "") == "_fire"  # the clock's, not asyncio.sleep's
            return self._call_at(when, callback, *args, **kwargs)  # type: ignore[arg-type]

        self.loop.call_at = call_at  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.loop.call_at


async def test_phases_moved_later_share_one_handle_and_only_the_last_fires() -> None:
    loop = asyncio.get_running_loop()
    fired: list[str] = []
    clock = Clock(loop)
    with Counting(loop) as counting:
        clock.after(0.05, lambda: fired.append("head"))
        for phase in ("body", "answer", "write", "idle"):  # each later than the one before: no new handle
            clock.after(0.1, lambda phase=phase: fired.append(phase))  # type: ignore[misc]
        assert counting.handles == 1
        await asyncio.sleep(0.3)
        assert fired == ["idle"]
        assert counting.handles == 2  # the first handle fired early and was set again once, for the last time
        clock.after(0.2, lambda: fired.append("late"))
        clock.after(0.01, lambda: fired.append("sooner"))  # earlier than the handle: replaced
        await asyncio.sleep(0.3)
        assert fired == ["idle", "sooner"]
        clock.after(0.01, lambda: fired.append("cleared"))
        clock.clear()
        await asyncio.sleep(0.05)
        assert fired == ["idle", "sooner"]
    clock.close()


async def test_a_timeout_on_the_clock_raises_timeout_error_and_leaves_other_cancels_alone() -> None:
    clock = Clock(asyncio.get_running_loop())
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with Timeout(clock, loop.time() + 0.05):
            await asyncio.sleep(5)
    assert not clock.due  # the clock is free again
    async with Timeout(clock, loop.time() + 5):  # done in time: nothing raised, nothing left due
        await asyncio.sleep(0.01)
    assert not clock.due

    async def waits() -> None:
        async with Timeout(clock, loop.time() + 5):
            await asyncio.sleep(5)

    task = asyncio.ensure_future(waits())
    await asyncio.sleep(0.01)
    task.cancel()  # someone else's cancel stays a cancellation
    with pytest.raises(asyncio.CancelledError):
        await task
    clock.close()
