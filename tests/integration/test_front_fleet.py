"""Prometheus's own connection pattern against the front end's connection caps, with real sockets.

In DNS mode every node name resolves to the Raven Service, so one Prometheus holds one keep-alive connection
per target, all from one address. These tests hold more such connections than the old per-address cap (2,048)
with the shipped defaults, attack the front end with unauthenticated connections meanwhile, and fill a small
``front.max_connections`` to see a refused node named in ``raven status`` and in a metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import secrets
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

NODES = 1100  # x 2 allowed ports: the gateway allows 1.25 x 2,200 = 2,750 authenticated connections per address
KEEPALIVE = 2200  # beyond the old cap of 2,048 connections per client address
ATTACKER = "127.0.10.60"
STRANGER = "127.0.10.61"  # a third address: its own unauthenticated budget
PROMETHEUS = "127.0.0.1"


@pytest.fixture(scope="module", autouse=True)
def _descriptors() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = KEEPALIVE + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the open-files hard limit {hard} is below the {want} this test holds")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class Fleet:
    def __init__(self, cluster: LocalCluster, port: int, token: str) -> None:
        self.cluster = cluster
        self.port = port
        self.token = token

    @property
    def front(self) -> tuple[str, int]:
        return "127.0.0.1", self.cluster.front_port

    def request(self, node: str, port: int | None = None, token: str | None = None) -> bytes:
        return (f"GET /metrics HTTP/1.1\r\nHost: {node}:{port or self.port}\r\n"
                f"Authorization: Bearer {token or self.token}\r\n\r\n").encode()


def _cluster(workdir: object, port: int, names: list[str], token: str, front: dict[str, object]) -> LocalCluster:
    # Many node names share a few simulated exporters, as the fleet benchmark does.
    nodes = [SimNode(name, HOSTS[i % 4], port) for i, name in enumerate(names)]
    return LocalCluster(
        workdir,  # type: ignore[arg-type]
        [PoolSpec("pool-f", nodes, agents=1)],
        allowed_ports=[port, 9100],
        front_token=token,
        gateway_settings={"front": front, "ready_max_wait": 3, "log_level": "warning"},
        agent_settings={"log_level": "warning"},
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def exporter_port() -> AsyncIterator[int]:
    port = pick_node_port(HOSTS[:4])
    exporter = SimExporter([SimNode(f"sim-{i}", HOSTS[i], port, gpus=1, size=2048) for i in range(4)])
    await exporter.start()
    try:
        yield port
    finally:
        await exporter.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory, exporter_port: int) -> AsyncIterator[Fleet]:
    token = secrets.token_hex(20)
    # The shipped front-end defaults: only the head deadline is short, so that the attack ends quickly.
    cluster = _cluster(tmp_path_factory.mktemp("front-fleet"), exporter_port,
                       [f"fleet-{k}" for k in range(NODES)], token, {"head_timeout": 3})
    try:
        await cluster.start(timeout=60)
        yield Fleet(cluster, exporter_port, token)
    finally:
        await cluster.close()


async def connect(fleet: Fleet, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.setblocking(False)
    sock.bind((source, 0))
    try:
        await asyncio.get_running_loop().sock_connect(sock, fleet.front)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bytes]:
    """One request on a keep-alive connection: (status, body); (0, b"") when the gateway closed it instead."""
    writer.write(request)
    await writer.drain()
    async with asyncio.timeout(30):
        status_line = await reader.readline()
        if not status_line:
            return 0, b""
        status = int(status_line.split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, await reader.readexactly(length)


async def close_all(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    for _, w in conns:
        w.close()
    for _, w in conns:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(w.wait_closed(), 2)


async def in_batches(coros: list, size: int = 200) -> list:  # type: ignore[type-arg]
    out = []
    for i in range(0, len(coros), size):
        out.extend(await asyncio.gather(*coros[i:i + size]))
    return out


async def test_prometheus_keepalive_connections_beyond_the_old_cap_all_scrape_during_an_attack(fleet: Fleet) -> None:
    ports = (fleet.port, 9100)
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    attack: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async def open_target(i: int) -> tuple[int, bytes]:
            """A target's connection, its first scrape sent at once, as Prometheus does."""
            conn = await connect(fleet, PROMETHEUS)
            conns.append(conn)
            return await exchange(*conn, fleet.request(f"fleet-{i % NODES}", ports[i // NODES]))

        # One connection per target, from one address, as Prometheus holds them, opened 100 at a time. Each
        # target's first scrape makes its connection an authenticated one. Port 9100 may have no exporter
        # here: such a scrape ends 502 from the node, which authenticates the connection all the same.
        first = await in_batches([open_target(i) for i in range(KEEPALIVE)], 100)
        assert all(s in (200, 502) for s, _ in first), [b for s, b in first if s not in (200, 502)][:3]
        assert [s for s, _ in first[:NODES]] == [200] * NODES
        ops = fleet.cluster.gateway_metrics_port
        held = await metric_values(ops, "raven_gateway_front_connections")
        assert held[(("state", "authenticated"),)] >= KEEPALIVE

        # The attacker: idle connections that never send anything, from one address, up to the unauthenticated
        # per-address cap (256 by default); the next one is refused at once.
        for _ in range(256):
            attack.append(await connect(fleet, ATTACKER))

        async def unauthenticated_held() -> bool:
            return (await metric_values(ops, "raven_gateway_front_connections")).get(
                (("state", "unauthenticated"),), 0) >= 256

        await eventually(unauthenticated_held, 10, what="the attacker's connections counted")
        over = await connect(fleet, ATTACKER)
        attack.append(over)
        async with asyncio.timeout(10):
            answer = await over[0].read()
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections from this address" in answer, answer

        # During the attack: every Prometheus connection scrapes again, and a new one from its address gets in.
        again = await in_batches([exchange(r, w, fleet.request(f"fleet-{i % NODES}"))
                                  for i, (r, w) in enumerate(conns)])
        assert [s for s, _ in again] == [200] * KEEPALIVE
        fresh = await connect(fleet, PROMETHEUS)
        conns.append(fresh)
        assert (await exchange(*fresh, fleet.request("fleet-7")))[0] == 200
        # A wrong token does not make a connection an authenticated one: it is answered 401 and closed.
        wrong = await connect(fleet, STRANGER)  # the attacker's own budget is used up (503)
        attack.append(wrong)
        status, _ = await exchange(*wrong, fleet.request("fleet-7", token="x" * 40))
        assert status == 401
        async with asyncio.timeout(10):
            assert await wrong[0].read() == b""
    finally:
        await close_all(attack)
        await close_all(conns)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small(tmp_path_factory: pytest.TempPathFactory, exporter_port: int) -> AsyncIterator[Fleet]:
    token = secrets.token_hex(20)
    cluster = _cluster(tmp_path_factory.mktemp("front-small"), exporter_port, [f"small-{k}" for k in range(40)],
                       token, {"max_connections": 30, "max_connections_per_client": 10})
    try:
        await cluster.start(timeout=60)
        yield Fleet(cluster, exporter_port, token)
    finally:
        await cluster.close()


async def test_a_node_whose_connection_is_refused_shows_in_status_and_a_metric(small: Fleet) -> None:
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for i in range(30):  # front.max_connections, all authenticated (40 nodes x 2 ports allow 100 per address)
            conns.append(await connect(small, PROMETHEUS))
            assert (await exchange(*conns[-1], small.request(f"small-{i}")))[0] == 200
        extra = await connect(small, PROMETHEUS)
        conns.append(extra)
        status, body = await exchange(*extra, small.request("small-33"))
        assert status == 503, body
        assert b"small-33" in body and b"front.max_connections 30" in body, body
        async with asyncio.timeout(10):
            assert await extra[0].read() == b""  # and closed
        ops = small.cluster.gateway_metrics_port
        refusals = await metric_values(ops, "raven_gateway_front_connection_refusals_total")
        assert refusals[(("pool", "pool-f"), ("reason", "over-capacity"))] >= 1
        async with aiohttp.ClientSession(headers=small.cluster.auth_headers) as http, \
                http.get(f"http://127.0.0.1:{ops}/status") as resp:
            status_doc = await resp.json()
        text = str(status_doc)
        assert "small-33" in text and "front.max_connections 30" in text, text[:2000]
        # The connections already held go on.
        assert (await exchange(*conns[0], small.request("small-0")))[0] == 200
    finally:
        await close_all(conns)
