"""The dialler holds what a gateway or its DNS says to the agent's own gateway.max_replicas (issue 29, item 5)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.dialler import Dialler
from agent.targets import DialTarget, Resolution
from raven.config.agent import AgentGateway
from raven.ops.metrics import AgentMetrics


async def _never(*_: object) -> bool:
    raise AssertionError("no dial in this test")


def dialler(max_replicas: int) -> Dialler:
    return Dialler(AgentGateway(max_replicas=max_replicas), _never, AgentMetrics(), lambda: 0)


def test_a_welcome_claiming_more_replicas_than_the_cap_gets_the_cap(caplog: pytest.LogCaptureFixture) -> None:
    d = dialler(max_replicas=4)
    with caplog.at_level(logging.INFO, "raven.agent"):
        for _ in range(50):  # every WELCOME says it again
            d.replicas_reported(200)
    assert d.replicas_expected == 4 and d.wanted == 4
    assert d.metrics.registry.get_sample_value("raven_agent_gateway_replicas_reported") == 200
    claims = [r for r in caplog.records if "claims 200 replicas" in r.getMessage()]
    assert len(claims) == 1  # once, not per WELCOME
    target = DialTarget("gw", "wss://gw:10262/tunnel", "gw")
    assert sorted(d._desired(Resolution((target,), per_address=False))) == [f"gw#{i}" for i in range(1, 5)]
    d.replicas_reported(2)
    assert d.replicas_expected == 2


async def test_a_name_with_more_addresses_than_the_cap_gets_the_cap_keeping_its_links() -> None:
    d = dialler(max_replicas=3)
    targets = tuple(DialTarget(f"10.0.0.{i}", f"wss://10.0.0.{i}:10262/tunnel", "gw") for i in range(1, 21))
    first = d._desired(Resolution(targets, per_address=True))
    assert list(first) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    kept = asyncio.get_running_loop().create_future()
    d._links = {"10.0.0.17": kept}  # type: ignore[dict-item]  # a link already held
    again = d._desired(Resolution(targets, per_address=True))
    assert len(again) == 3 and "10.0.0.17" in again
    kept.cancel()
