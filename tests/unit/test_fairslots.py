"""FairSlots.try_acquire: the forwarder's fast path takes a free slot without a timer, never past the queue."""

from __future__ import annotations

import asyncio

from agent.fairslots import FairSlots


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
