"""Logs a peer cannot grow: rate limit per (peer, kind) with a count."""

from __future__ import annotations

import logging

import pytest

from raven.lograte import RateLimitedLog


def test_rate_limited_per_peer_with_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("t.rate"), interval=60, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "t.rate"):
        assert rl.warning("peer-a", "unknown-stream", "frame for unknown stream %d", 1)
        for i in range(500):
            assert not rl.warning("peer-a", "unknown-stream", "frame for unknown stream %d", i)
        assert rl.warning("peer-b", "unknown-stream", "frame for unknown stream %d", 7)  # another peer: its own budget
        now[0] = 61.0
        assert rl.warning("peer-a", "unknown-stream", "frame for unknown stream %d", 9)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "500 more like it" in lines[2]


def test_keys_are_bounded() -> None:
    rl = RateLimitedLog(logging.getLogger("t.keys"), max_keys=10)
    for i in range(1000):
        rl.info(f"10.0.{i // 256}.{i % 256}", "churn", "x")
    assert len(rl._seen) == 10


def test_descriptor_budget_raises_the_soft_limit_and_keeps_a_reserve() -> None:
    """Run in a child process: it lowers its own soft limit first, as a fresh container would have it."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from raven.http.listener import descriptor_budget\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "budget = descriptor_budget(100)\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "print(now == hard, budget == now - 100)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_many_peers_share_a_ceiling_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    """Peers minting addresses (an IPv6 prefix) get no more lines of one kind than the ceiling per interval."""
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("t.ceiling"), interval=60, clock=lambda: now[0], max_per_kind=5)
    with caplog.at_level(logging.INFO, "t.ceiling"):
        passed = sum(rl.warning(f"2001:db8::{i:x}", "auth", "refused") for i in range(1000))
        assert passed == 5
        assert rl.warning("10.0.0.1", "other-kind", "x")  # another kind has its own ceiling
        now[0] = 61.0
        assert rl.warning("2001:db8::ffff", "auth", "refused")
    assert "995 more like it" in caplog.records[-1].getMessage()
