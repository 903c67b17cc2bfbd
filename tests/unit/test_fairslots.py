"""FairSlots.try_acquire: the forwarder's fast path takes a free slot without a timer, never past the queue."""

from __future__ import annotations

import asyncio

import pytest

from agent.fairslots import Abandoned, FairSlots, QueueFull


async def test_try_acquire_takes_free_slots_within_the_share() -> None:
    slots = FairSlots(limit=3, per_key=2, max_waiting=4)
    assert slots.try_acquire("a") and slots.try_acquire("a")
    assert not slots.try_acquire("a")  # a's share is full
    assert slots.try_acquire("b")
    assert not slots.try_acquire("c")  # the node's limit is reached
    assert slots.active == 3
    slots.release("b")
    assert slots.try_acquire("c")


async def test_try_acquire_does_not_jump_the_queue() -> None:
    slots = FairSlots(limit=1, per_key=1, max_waiting=4)
    assert slots.try_acquire("a")
    waiter = asyncio.ensure_future(slots.acquire("b"))
    await asyncio.sleep(0)
    assert slots.waiting == 1
    slots.release("a")  # the freed slot goes to b, who waited, not to whoever asks next
    assert not slots.try_acquire("c")
    await waiter
    assert slots.held == {"b": 1}
    slots.release("b")
    assert slots.idle and slots.try_acquire("c")


async def test_an_abandoned_waiter_is_never_granted_a_slot() -> None:
    """A waiter whose request is gone (its RESET arrived in the same loop turn as the free slot, before its task
    was cancelled) is dropped and told so; the slot goes to the next waiter, and the counts stay exact."""
    slots = FairSlots(limit=1, per_key=1, max_waiting=4)
    assert slots.try_acquire("a")
    gone = {"b": False, "c": False}
    b = asyncio.ensure_future(slots.acquire("b", gone=lambda: gone["b"]))
    c = asyncio.ensure_future(slots.acquire("c", gone=lambda: gone["c"]))
    await asyncio.sleep(0)
    assert slots.waiting == 2
    gone["b"] = True  # b's stream is reset; its task has not been told yet
    slots.release("a")
    assert slots.held == {"c": 1} and slots.active == 1 and slots.waiting == 0
    with pytest.raises(Abandoned):
        await b
    await c
    slots.release("c")
    assert slots.idle and slots.held == {}


async def test_a_full_queue_makes_room_by_dropping_abandoned_waiters() -> None:
    slots = FairSlots(limit=1, per_key=1, max_waiting=2)
    assert slots.try_acquire("a")
    gone = {"b": False, "c": False}

    def wait(key: str) -> asyncio.Future[None]:
        return asyncio.ensure_future(slots.acquire(key, gone=lambda: gone[key]))

    waiters = [wait("b"), wait("c")]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await slots.acquire("d")
    gone["b"] = True
    d = asyncio.ensure_future(slots.acquire("d"))
    await asyncio.sleep(0)
    assert slots.waiting == 2  # c and d: b was dropped
    with pytest.raises(Abandoned):
        await waiters[0]
    slots.release("a")
    await waiters[1]
    slots.release("c")
    await d
    slots.release("d")
    assert slots.idle


async def test_a_cancelled_waiter_leaves_the_counts_exact() -> None:
    slots = FairSlots(limit=1, per_key=1, max_waiting=4)
    assert slots.try_acquire("a")
    b = asyncio.ensure_future(slots.acquire("b", gone=lambda: False))
    await asyncio.sleep(0)
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    assert slots.waiting == 0
    slots.release("a")
    assert slots.idle


async def test_slots_freed_while_requests_leave_wait_for_the_burst_to_settle() -> None:
    """Departures settle before a freed slot is handed on: a waiter whose request leaves within SETTLE_QUIET of the
    last departure is dropped, not granted; a live waiter gets the slot once the burst is over."""
    slots = FairSlots(limit=1, per_key=1, max_waiting=4)
    slots.SETTLE_QUIET, slots.SETTLE_MAX = 0.05, 1.0
    assert slots.try_acquire("a")
    gone = {"b": False, "c": False}
    b = asyncio.ensure_future(slots.acquire("b", gone=lambda: gone["b"]))
    c = asyncio.ensure_future(slots.acquire("c", gone=lambda: gone["c"]))
    await asyncio.sleep(0)
    slots.settle()  # a's client left
    slots.release("a")
    assert slots.settling and slots.active == 0 and slots.waiting == 2  # held back, nobody granted
    assert not slots.try_acquire("d")  # a newcomer does not take the held-back slot past the queue
    await asyncio.sleep(0.03)
    gone["b"] = True  # b's RESET arrives 30 ms later
    slots.settle()
    await asyncio.sleep(0.03)
    assert slots.settling  # the quiet period started again with b's departure
    await c
    with pytest.raises(Abandoned):
        await b
    assert not slots.settling and slots.held == {"c": 1} and slots.waiting == 0


async def test_a_steady_stream_of_departures_holds_the_queue_at_most_settle_max() -> None:
    slots = FairSlots(limit=1, per_key=1, max_waiting=4)
    slots.SETTLE_QUIET, slots.SETTLE_MAX = 0.05, 0.15
    assert slots.try_acquire("a")
    waiter = asyncio.ensure_future(slots.acquire("b"))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    slots.settle()
    slots.release("a")
    while not waiter.done():
        slots.settle()  # departures keep coming, every 20 ms
        await asyncio.sleep(0.02)
    assert loop.time() - start < 0.15 + 0.1
    assert slots.held == {"b": 1}


async def test_settle_without_waiters_holds_nothing() -> None:
    slots = FairSlots(limit=1, per_key=1, max_waiting=4)
    assert slots.try_acquire("a")
    slots.settle()
    slots.release("a")
    assert not slots.settling and slots.try_acquire("b")
