"""A gateway cannot make the agent dial, hold links or log without bound (found by issue 29, item 5).

A hand-written gateway (a real TLS WebSocket server with the test CA's gateway certificate) answers every HELLO
with WELCOME replicas=200. Before the fix the agent opened 200 links to it: 1,769 dials in 6 s, 230 descriptors,
~3,800 log lines. Now it holds at most ``gateway.max_replicas`` links (16), dials at most ``dial_burst`` at once and
``dial_rate`` a second after that, and says once that the gateway claims more replicas than it will hold. Whether
every connection reaches the same replica (each extra link is a duplicate, redialled with backoff) or a new one
each time (the agent would hold every session it is given), the numbers stay small.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from raven.config import TLSConfig
from raven.demo.launch import LocalCluster, PoolSpec, Proc, free_port
from raven.demo.simexporter import SimNode
from raven.protocol import wire
from raven.transport.tls import server_context
from tests.support.cluster import HOSTS
from tests.support.fakegateway import serve_agent
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

CLAIMED = 200  # replicas the lying gateway claims
CAP = 16  # the agent's default gateway.max_replicas
BURST, RATE = 8, 2.0  # the agent's default gateway.dial_burst and dial_rate
WATCH = 6.0  # seconds of the agent's dialling watched


@dataclass
class ReplicaLiar:
    """Answers every HELLO with WELCOME replicas=200: as one replica (``distinct`` False) or a new one each time."""

    distinct: bool
    dials: int = 0
    open_now: int = 0
    max_open: int = 0

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        self.dials += 1
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)
        replica = f"liar-{self.dials}" if self.distinct else "liar-1"
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        try:
            await serve_agent(ws, wire.Welcome(1, replica, CLAIMED, 30.0, 120.0))
        finally:
            self.open_now -= 1
        return ws


@dataclass
class Watched:
    liar: ReplicaLiar
    agent: Proc
    max_fds: int = 0
    log_lines: int = 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _watch(tmp_path: Path, distinct: bool) -> AsyncIterator[Watched]:
    tunnel_port = free_port()
    cluster = LocalCluster(tmp_path, [PoolSpec("pool-l", [SimNode("edge-l-1", HOSTS[5], 9100)], agents=1)],
                           gateway_url=f"wss://127.0.0.1:{tunnel_port}/tunnel")
    cluster.make_pki()
    liar = ReplicaLiar(distinct)
    app = web.Application()
    app.router.add_get("/tunnel", liar.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    certs = cluster.certs
    ctx = server_context(TLSConfig(cert=certs / "raven-gateway.pem", key=certs / "raven-gateway-key.pem",
                                   ca=certs / "ca.pem"))
    await web.TCPSite(runner, "127.0.0.1", tunnel_port, ssl_context=ctx).start()
    try:
        pool = cluster.pools[0]
        agent = await cluster.start_agent(pool, cluster.agent_names(pool)[0], wait=False)
        await eventually(lambda: liar.dials > 0, timeout=20, what="the agent's first dial")
        watched = Watched(liar, agent)
        loop = asyncio.get_running_loop()
        end = loop.time() + WATCH
        while loop.time() < end:
            assert agent.running, agent.log_tail()
            watched.max_fds = max(watched.max_fds, _fds(agent.process.pid))
            await asyncio.sleep(0.05)
        watched.log_lines = len(agent.log.read_text(errors="replace").splitlines())
        yield watched
    finally:
        await cluster.close()
        await runner.cleanup()


@pytest.fixture
async def same_replica(tmp_path: Path) -> AsyncIterator[Watched]:
    async for watched in _watch(tmp_path, distinct=False):
        yield watched


@pytest.fixture
async def new_replicas(tmp_path: Path) -> AsyncIterator[Watched]:
    async for watched in _watch(tmp_path, distinct=True):
        yield watched


async def test_a_gateway_claiming_200_replicas_gets_few_dials_and_log_lines(same_replica: Watched) -> None:
    """Every connection reaches the same replica: all links but one are duplicates, dialled again and again."""
    w = same_replica
    # The dials of the first second after the first, then RATE a second: with room for a slow start.
    assert w.liar.dials <= BURST + RATE * (WATCH + 1) + 2, f"{w.liar.dials} dials in {WATCH:.0f}s"
    assert w.liar.max_open <= CAP, f"{w.liar.max_open} connections at once"
    assert w.max_fds <= CAP + 30, f"{w.max_fds} descriptors"
    # A line per link dialled, then a few a minute however often the duplicates are dialled again.
    assert w.log_lines <= CAP + 20, f"{w.log_lines} log lines:\n{w.agent.log_tail(80)}"
    text = w.agent.log.read_text(errors="replace")
    claims = [line for line in text.splitlines() if f"claims {CLAIMED} replicas" in line]
    assert len(claims) == 1, claims  # said once, not per WELCOME
    reported = await metric_values(w.agent.metrics_port, "raven_agent_gateway_replicas_reported")
    links = await metric_values(w.agent.metrics_port, "raven_agent_gateway_links")
    assert list(reported.values()) == [CLAIMED] and list(links.values()) == [CAP], (reported, links)
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{w.agent.metrics_port}/readyz") as resp:
        why = await resp.text()
    assert resp.status == 503, why  # one replica is all it holds: not ready, and it says why
    assert f"sessions to 1 of {CAP} gateway replica(s) (the gateway claims {CLAIMED}" in why, why


async def test_a_gateway_that_is_a_new_replica_each_time_gets_at_most_max_replicas(new_replicas: Watched) -> None:
    """Every connection reaches a 'new' replica: the agent holds the sessions it gets, up to its own cap."""
    w = new_replicas
    assert w.liar.max_open == CAP, f"{w.liar.max_open} sessions held at once, the cap is {CAP}"
    assert w.liar.dials <= CAP + 2, f"{w.liar.dials} dials"
    assert w.max_fds <= CAP + 30, f"{w.max_fds} descriptors"
    # Per link: dialled, connected, its nodes accepted.
    assert w.log_lines <= 3 * CAP + 20, f"{w.log_lines} log lines:\n{w.agent.log_tail(80)}"
    sessions = await metric_values(w.agent.metrics_port, "raven_agent_sessions")
    assert list(sessions.values()) == [CAP], sessions
