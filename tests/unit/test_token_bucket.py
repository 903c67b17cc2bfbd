"""TokenBucket (raven/protocol/flow.py): the agent's dial allowance and the session's allowance of void frames."""

from __future__ import annotations

import pytest

from raven.protocol.flow import TokenBucket, VoidAllowance
from raven.protocol.wire import ProtocolError


def test_a_burst_at_once_then_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.reserve(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    # Borrowed tokens queue: the 4th event waits 0.5 s, the 5th 1 s, in the order they asked.
    assert bucket.reserve(0.0) == pytest.approx(0.5)
    assert bucket.reserve(0.0) == pytest.approx(1.0)
    assert bucket.reserve(1.0) == pytest.approx(0.5)  # a second later: two refilled, both already promised
    assert bucket.reserve(10.0) == 0.0  # refilled, never beyond the burst
    assert [bucket.reserve(10.0) for _ in range(2)] == [0.0, 0.0]
    assert bucket.reserve(10.0) > 0


def test_take_refuses_without_borrowing() -> None:
    bucket = TokenBucket(rate=1.0, burst=1, now=0.0)
    assert bucket.take(0.0)
    assert not bucket.take(0.5)
    assert bucket.take(1.0)  # the half second before the refusal counted too


def test_void_frames_past_the_allowance_end_the_session() -> None:
    voids = VoidAllowance(rate=10.0, burst=2, now=0.0)
    voids.spend(0.0)
    voids.spend(0.0)
    with pytest.raises(ProtocolError, match="frames per second that do nothing"):
        voids.spend(0.0)
