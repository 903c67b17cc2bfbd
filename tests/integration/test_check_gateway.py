"""``raven check``'s gateway side against real processes: a real gateway and real agents (raven.demo.launch's
LocalCluster, on loopback, mutual TLS, the front end's bearer token from ``raven install``'s secrets folder), with
the cluster side from the fake API server seeded as in test_check.py. The agents' sessions and releases come from
the gateway's own ``/status``; when a pool's agents stop, the check names the pool and the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from raven.demo.launch import LocalCluster, PoolSpec
from raven.protocol import wire
from tests.integration.test_check import (  # noqa: F401 (installed, prometheus: fixtures)
    Cluster,
    check,
    failures,
    installed,
    prometheus,
    seed,
    start_dns,
)
from tests.support.agentpeer import Peer
from tests.support.fakekube import FakeKube
from tests.support.promtargets import PromTargets

Installed = tuple[Path, list[dict[str, Any]]]


@pytest.fixture
async def real(installed: Installed, prometheus: PromTargets, tmp_path: Path  # noqa: F811
               ) -> AsyncIterator[tuple[Cluster, LocalCluster]]:
    """``installed``: test_check.py's module fixture (one real raven install --with-secrets)."""
    secrets, docs = installed
    token = (secrets / "front-token").read_text().strip()
    fake = FakeKube()
    await fake.start()
    local = LocalCluster(tmp_path / "local", [PoolSpec("pool-a", []), PoolSpec("pool-b", [])], front_token=token)
    dns = None
    try:
        seed(fake, docs)
        dns = await start_dns(fake, tmp_path)
        await local.start()
        cluster = Cluster(fake, [], fake.write_kubeconfig(tmp_path / "kubeconfig"), secrets / "front-token", secrets,
                          dns, prometheus)
        yield cluster, local
    finally:
        await local.close()
        if dns is not None:
            await dns.close()
        await fake.close()


async def test_sessions_and_releases_from_a_real_gateway(real: tuple[Cluster, LocalCluster]) -> None:
    cluster, local = real
    ops = f"http://127.0.0.1:{local.gateway_metrics_port}"
    code, doc, text = await check(cluster, "--gateway", ops, token=True)
    assert failures(doc) == {}, text
    assert code == 0
    rows = {c["check"]: c["detail"] for c in doc["checks"]}
    assert rows["agents pool-a"] == "2 ready agent(s), sessions to 1 of 1 replicas"
    # The real agents sent their clocks (Date on the upgrade request), the real gateway its own and its descriptors.
    assert rows["clock-skew"].startswith("6 clocks within 5s of the API server's"), rows["clock-skew"]
    assert "did not send their clock" not in rows["clock-skew"]
    assert " open, needs " in rows["descriptors"], rows["descriptors"]
    assert rows["ops-api"] == "read /status of 1 gateway replica(s)"
    # pool-b's agents stop: the gateway's /status no longer lists a session for it, and the check says so.
    for name in local.agent_names(local.pools[1]):
        await local.stop(local.agents[name])
    for _ in range(50):
        code, doc, text = await check(cluster, "--gateway", ops, token=True)
        if "agents pool-b" in failures(doc):
            break
        await asyncio.sleep(0.2)
    bad = failures(doc)
    assert code == 1 and list(bad) == ["agents pool-b"], text
    assert "no session to replica" in bad["agents pool-b"]["detail"]


async def test_an_agent_with_a_wrong_clock_is_named_by_the_real_gateway(real: tuple[Cluster, LocalCluster]) -> None:
    """An agent whose clock is 90 s ahead connects to the real gateway (its upgrade request's Date says so): the
    gateway keeps the offset, and raven check names the agent and says what to run."""
    cluster, local = real
    ops = f"http://127.0.0.1:{local.gateway_metrics_port}"
    ahead = email.utils.formatdate(time.time() + 90, usegmt=True)
    async with Peer(local, "agent-pool-a-1") as peer:
        assert isinstance(await peer.connect(headers={"Date": ahead}), wire.Welcome)

        async def answer_pings() -> None:  # the session stays up however long the checks take
            while True:
                await peer.control(timeout=600)

        keep = asyncio.create_task(answer_pings())
        try:
            code, doc, text = await check(cluster, "--gateway", ops, token=True)
        finally:
            keep.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await keep
    bad = failures(doc)
    assert code == 1 and list(bad) == ["clock-skew"], text
    assert "agent agent-pool-a-1 (pool pool-a, via replica" in bad["clock-skew"]["detail"]
    assert "s ahead of the API server's clock" in bad["clock-skew"]["detail"]
    assert "timedatectl set-ntp true" in bad["clock-skew"]["fix"]
