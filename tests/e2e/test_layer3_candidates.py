"""In the layer-3 testbed: an agent whose certificate names pool site-a but carries site b's range cannot
black-hole site a, neither beside the real agents nor by being the only one connected while they restart.

The stray is a real ``raven agent`` on site a's gateway node, with a certificate from the testbed's CA
(``--pool site-a --cidr 10.221.0.0/16``) and that range in its layer-3 configuration.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from raven import pki
from tests.e2e.test_layer3 import NOT_YET, pytestmark  # noqa: F401  (the same marks: root, tools)
from tests.support.l3testbed import CLOUD_NS, GATEWAY_WAN_IP, POD_NS, L3Testbed
from tests.support.polling import eventually

STRAY = "stray-a"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[L3Testbed]:
    tb = L3Testbed(tmp_path_factory.mktemp("raven-l3-candidates"))
    try:
        await tb.start()
        await tb.wait_ready(60)
        yield tb
    finally:
        await tb.close()


async def start_stray(bed: L3Testbed) -> None:
    a, b = bed.site_a, bed.site_b
    pki.issue(bed.certs, bed.certs, "agent", STRAY, pools=[a.pool], cidrs=[b.cidr], days=1)
    bed._write(f"{STRAY}.yaml", {
        "pool": a.pool,
        "gateway": {"url": f"wss://{GATEWAY_WAN_IP}:10262/tunnel", "server_name": "raven-gateway",
                    "backoff_initial": 0.2, "backoff_max": 1.0},
        "nodes": [],
        "metrics_listen": "127.0.0.1:10269",
        "tls": bed.tls(STRAY),
        "layer3": {"enabled": True, "device": "raven2", "addresses": ["10.221.255.9/32"], "cidrs": [b.cidr]},
    })
    await bed.spawn(STRAY, a.gw_ns, bed.raven("agent", "--config", str(bed.workdir / f"{STRAY}.yaml")))


async def test_a_stray_range_never_takes_the_pool(bed: L3Testbed) -> None:
    a = bed.site_a
    routes = await bed.raven_routes(CLOUD_NS)
    active = await bed.active_agent(a.pool)
    await start_stray(bed)
    try:
        await eventually(lambda: "not routing for agent stray-a" in bed.log("gateway", 10**6), 20,
                         "the stray refused by the gateway")
        assert "it is not a candidate" in bed.log("gateway", 10**6)
        assert await bed.active_agent(a.pool) == active
        assert await bed.raven_routes(CLOUD_NS) == routes
        assert (await bed.ping(POD_NS, a.gw_ip, count=3))["received"] == 3
        # The real agents restart: while only the stray is connected, site a has no active agent, and the
        # stray is no candidate; when they are back, site a is carried again.
        for agent in a.agents:
            assert await bed.stop(agent.name, signal.SIGTERM, grace=15) == 0

        async def none_active() -> bool:
            return await bed.active_agent(a.pool) is None

        await eventually(none_active, 15, "site a without an agent", tolerate=NOT_YET)
        status = await bed.status()
        assert status["layer3"]["pools"][a.pool]["candidates"] == []
        assert await bed.active_agent(a.pool) is None
    finally:
        for agent in a.agents:
            await bed.start_agent(agent.name)
            await asyncio.sleep(0.3)
    await bed.wait_ready(60)
    assert await bed.active_agent(a.pool) in {x.name for x in a.agents}
    assert await bed.raven_routes(CLOUD_NS) == routes
    assert await bed.stop(STRAY, signal.SIGTERM, grace=15) == 0
