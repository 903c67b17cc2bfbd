"""raven/deadline.py: one deadline value from the front door to the node's socket, on one clock, in one unit, with
the contract's one clamp (raven/protocol/terms.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from raven.deadline import NO_DEADLINE, Deadline
from raven.protocol import OpenFields, terms_of, wire
from raven.protocol.headers import DEADLINE_HEADER
from raven.protocol.terms import clamp_deadline_ms


def test_the_one_clamp_bounds_what_is_sent_and_what_is_read() -> None:
    assert [clamp_deadline_ms(ms) for ms in (-5, 0, 1, 2500, wire.MAX_DEADLINE_MS + 1)] == \
        [1, 1, 1, 2500, wire.MAX_DEADLINE_MS]
    assert Deadline.after(10 * 86_400).ms() == wire.MAX_DEADLINE_MS  # sent: at most a day
    assert NO_DEADLINE.ms() == 1 and NO_DEADLINE.left() == 0.0  # passed: the least the contract states
    legacy = wire.Open(1, wire.StreamKind.HTTP, "edge-1", 9100, "GET", "/", ((DEADLINE_HEADER, "999999999"),), True)
    assert terms_of(legacy).deadline_ms == wire.MAX_DEADLINE_MS  # read from a version-1/2 header: the same rule


def test_a_stated_deadline_never_extends_the_agents_own() -> None:
    assert Deadline.stated(0, 10.0).budget == 10.0  # none stated: the agent's own
    assert Deadline.stated(2500, 10.0).budget == 2.5
    assert Deadline.stated(60_000, 10.0).budget == 10.0
    assert Deadline.stated(wire.MAX_DEADLINE_MS * 10, 10.0).budget == 10.0


def test_what_the_gateway_states_the_agent_never_outlives() -> None:
    """The gateway states what is left in whole milliseconds (rounded down): the agent's deadline, made from it
    as the OPEN arrives, is never later than the gateway's own."""
    start = time.monotonic()
    gateway = Deadline.after(2.0, start)
    assert gateway.at == start + 2.0 and gateway.budget == 2.0
    stated = gateway.ms()
    assert 0 < stated <= 2000
    agent = Deadline.stated(stated, 30.0)
    assert agent.at <= gateway.at + 1e-3 and agent.budget == stated / 1000
    assert OpenFields(stated).deadline_ms == stated  # within the wire's bounds as it is


async def test_a_wait_ends_at_the_deadline_not_after_it() -> None:
    deadline = Deadline.after(0.2)
    await asyncio.sleep(0.1)  # part of the budget is spent before the wait starts
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with deadline.timeout():
            await asyncio.sleep(5)
    assert time.monotonic() - started < 0.2  # what was left, not a fresh budget
    assert deadline.left() == 0.0
