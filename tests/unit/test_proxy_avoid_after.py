"""Only a wait the agent had for long enough makes a node avoid its agent (gateway/proxy.py, AVOID_AFTER).

The gateway's own deadline passing before the response head says the path is slow only when the agent had the
request for at least ``AVOID_AFTER`` (1 s): a client's tiny scrape timeout, or a budget spent before the agent was
asked, says nothing about the agent, and must not move the node off it (found by a review of issue 32's
avoidance, which had no test of its own until now). Without sockets: the agent's session is joined to the
gateway's in memory (tests/support/memsession.py), and the agent never answers here."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.admission import Exchange
from gateway.aiocall import AiohttpCall
from gateway.avoidance import AVOID_AFTER
from gateway.proxy import Proxy
from gateway.registry import Registry
from gateway.request import Target
from raven.config.gateway import GatewayFront
from raven.deadline import Deadline
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.ops.metrics import GatewayMetrics
from raven.protocol import wire
from raven.refusals import Reason, Refusal
from raven.transport.tunnel import Stream, Tunnel
from tests.support import memsession


def proxy_and_exchange(budget: float, session: Tunnel) -> tuple[Proxy, Exchange]:
    """A proxy whose one agent is at the other end of ``session``."""
    cfg = GatewayFront.model_validate({"listen": "127.0.0.1:1"})
    p = Proxy(cfg, Registry(), GatewayMetrics(), lambda: False, ConnectionGuard("front", GuardLimits()))
    agent: Any = SimpleNamespace(agent="agent-1", session=session)
    p.registry.select = mock.Mock(side_effect=lambda entry, tried: None if tried else agent)  # type: ignore[method-assign]
    transport = mock.Mock()
    transport.get_extra_info.return_value = None
    request = make_mocked_request("GET", "/metrics", headers={"Host": "edge-1:9400"}, transport=transport)
    ex = Exchange(AiohttpCall(request), time.monotonic())
    ex.target = Target("edge-1", 9400, "/metrics", wire.StreamKind.HTTP)
    ex.entry = SimpleNamespace(name="edge-1", pool="pool-a", sessions=[agent])  # type: ignore[assignment]
    ex.node, ex.pool = "edge-1", "pool-a"
    ex.deadline = Deadline.after(budget)
    return p, ex


@pytest.mark.parametrize(("budget", "avoided"), [(0.3, False), (AVOID_AFTER + 0.3, True)], ids=["tiny", "long"])
async def test_the_gateways_deadline_counts_against_the_agent_only_after_a_second_of_asking(
        budget: float, avoided: bool) -> None:
    taken: list[Stream] = []
    gw, ag, tasks = await memsession.pair(taken.append)  # the agent takes the stream and never answers
    try:
        p, ex = proxy_and_exchange(budget, gw)
        frame = wire.Open(0, wire.StreamKind.HTTP, "edge-1", 9400, "GET", "/metrics", (), fin=True)
        with pytest.raises(Refusal) as refused:
            await asyncio.wait_for(p._open(ex, frame, retryable=True), budget + 5)
        assert refused.value.reason is Reason.TIMEOUT, refused.value
        (stream,) = taken
        await asyncio.wait_for(stream.wait_finished(), 5)  # the agent lets the node go either way
        assert stream.reset_error is not None and stream.reset_error.code == wire.ResetCode.TIMEOUT
        avoided_now = p.registry.avoidance.avoided("edge-1")
        assert (avoided_now == {"agent-1"}) is avoided, avoided_now
    finally:
        for session in (gw, ag):
            await session.close("test over")
        await asyncio.gather(*tasks, return_exceptions=True)
