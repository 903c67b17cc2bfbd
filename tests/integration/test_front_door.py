"""The front door against hostile clients: each limit attacked for real while a normal scrape still succeeds.

A gateway and agents run as real processes with small limits (so that attacks are cheap); the attacker
connects from its own loopback address (127.0.10.50/51/...), the well-behaved client from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port, start_echo
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

ATTACKERS = [f"127.0.10.{i}" for i in range(50, 56)]
HEAD_TIMEOUT = 1.0
WRITE_STALL = 2.0


class Door:
    def __init__(self, cluster: LocalCluster, exporter: SimExporter, port: int, seen: list[dict[str, str]]) -> None:
        self.cluster = cluster
        self.exporter = exporter
        self.port = port
        self.seen = seen  # headers the echo node received

    @property
    def front(self) -> tuple[str, int]:
        return "127.0.0.1", self.cluster.front_port

    @property
    def ops_port(self) -> int:
        return self.cluster.gateway_metrics_port

    async def refused(self, reason: str) -> float:
        values = await metric_values(self.ops_port, "raven_gateway_front_refused_total")
        return values.get((("reason", reason),), 0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def door(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Door]:
    port = pick_node_port(HOSTS)
    nodes = [SimNode("door-1", HOSTS[0], port), SimNode("door-big", HOSTS[1], port, size=4 * 1024 * 1024)]
    exporter = SimExporter(nodes)
    await exporter.start()
    # An echo node: answers with the request headers it received, to see what the gateway forwards.
    seen: list[dict[str, str]] = []
    echo_runner = await start_echo(HOSTS[2], port, seen)
    echo_node = SimNode("door-echo", HOSTS[2], port)
    cluster = LocalCluster(
        tmp_path_factory.mktemp("front-door"),
        [PoolSpec("pool-d", [*nodes, echo_node], agents=1)],
        allowed_ports=[port, 9100],
        gateway_settings={
            "front": {
                "request_timeout": 10, "head_timeout": HEAD_TIMEOUT, "idle_timeout": 3, "body_timeout": 1,
                "write_stall_timeout": WRITE_STALL, "max_connections": 120, "max_connections_per_client": 40,
                "max_unauthenticated": 120, "max_unauthenticated_per_client": 40,
                "max_streams_per_node": 8, "client_share": 0.5, "allow_connect": True, "max_connect_tunnels": 4,
                "max_connect_per_client": 2, "connect_idle_timeout": 1.5,
            },
            "limits": {"handshake_timeout": HEAD_TIMEOUT, "heartbeat_interval": 0.5, "heartbeat_timeout": 2.5},
            "ready_max_wait": 3,
            "tunnel": {"max_connections_per_address": 20},
        },
        agent_settings={"allow_connect": True},
    )
    try:
        await cluster.start()
        yield Door(cluster, exporter, port, seen)
    finally:
        await cluster.close()
        await exporter.close()
        await echo_runner.cleanup()


async def scrape(door: Door, node: str = "door-1", session: aiohttp.ClientSession | None = None) -> bytes:
    """A well-behaved Prometheus-like scrape (Host-header mode) that must succeed."""
    url = f"http://127.0.0.1:{door.cluster.front_port}/metrics"
    headers = {"Host": f"{node}:{door.port}"}
    own = session is None
    http = session or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        async with http.get(url, headers=headers) as resp:
            body = await resp.read()
            assert resp.status == 200, body
            return body
    finally:
        if own:
            await http.close()


async def raw(
    door: Door, source: str, data: bytes = b"", rcvbuf: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.setblocking(False)
    if rcvbuf:  # a client that reads nothing should not have megabytes of kernel buffer to fill first
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    try:
        await asyncio.get_running_loop().sock_connect(sock, door.front)
    except BaseException:
        sock.close()
        raise
    reader, writer = await asyncio.open_connection(sock=sock)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except (ConnectionError, TimeoutError):
        return b"<timeout or reset>"


async def close_all(writers: list[asyncio.StreamWriter]) -> None:
    for w in writers:
        w.close()
    for w in writers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(w.wait_closed(), 2)


async def test_half_request_heads_get_408_and_close_while_scrapes_succeed(door: Door) -> None:
    before = await door.refused("head-timeout")
    conns = [await raw(door, ATTACKERS[0], b"GET /metrics HTTP/1.1\r\nHost: door-1:") for _ in range(30)]
    silent = [await raw(door, ATTACKERS[0]) for _ in range(5)]
    try:
        await scrape(door)  # beside the attack
        answers = await asyncio.gather(*(read_all(r, HEAD_TIMEOUT + 5) for r, _ in conns + silent))
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:3]
        assert b"no complete request head within" in answers[0]
        await scrape(door)
        assert await door.refused("head-timeout") >= before + 35
    finally:
        await close_all([w for _, w in conns + silent])


async def test_connections_per_client_are_capped_and_a_keepalive_scrape_goes_on(door: Door) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as prometheus:
        await scrape(door, session=prometheus)  # an established keep-alive connection, as Prometheus holds
        before = await door.refused("client-connections")
        conns = []
        try:
            for _ in range(40):  # the per-client cap
                conns.append(await raw(door, ATTACKERS[1]))
            over = await raw(door, ATTACKERS[1])
            conns.append(over)
            answer = await read_all(over[0], 5)
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert b"too many connections from this address" in answer
            assert await door.refused("client-connections") >= before + 1
            await scrape(door, session=prometheus)
            await scrape(door)  # another address still gets in
        finally:
            await close_all([w for _, w in conns])


async def test_total_connection_cap_keeps_ops_tunnel_and_open_connections_working(door: Door) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as prometheus:
        await scrape(door, session=prometheus)
        conns = []
        try:
            for source in ATTACKERS[2:5]:  # 3 x 40 = 120: the front end's total cap
                for _ in range(40):
                    with contextlib.suppress(OSError):
                        conns.append(await raw(door, source))
            extra = await raw(door, ATTACKERS[5])
            conns.append(extra)
            answer = await read_all(extra[0], 5)
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer, answer
            # The front end is saturated: its established connection, the ops port and the tunnel still work.
            await scrape(door, session=prometheus)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as ops:
                for path in ("/healthz", "/readyz", "/metrics"):
                    async with ops.get(f"http://127.0.0.1:{door.ops_port}{path}") as resp:
                        assert resp.status == 200, path
            _, writer = await asyncio.open_connection("127.0.0.1", door.cluster.tunnel_port)
            await close_all([writer])  # the tunnel port still accepts connections, and the agent's session is up
            assert sum((await metric_values(door.ops_port, "raven_gateway_sessions")).values()) == 1
            assert await door.refused("too-many-connections") >= 1
        finally:
            await close_all([w for _, w in conns])
    await scrape(door)


async def test_idle_keepalive_connection_is_closed(door: Door) -> None:
    reader, writer = await raw(door, ATTACKERS[0], f"GET /metrics HTTP/1.1\r\nHost: door-1:{door.port}\r\n\r\n"
                               .encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length")))
        await reader.readexactly(length)
        assert await asyncio.wait_for(reader.read(), 3 + 5) == b""  # idle_timeout 3 s: closed, nothing more
    finally:
        await close_all([writer])


async def test_methods_outside_the_allowlist_get_405_with_allow(door: Door) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for method in ("POST", "PUT", "DELETE", "TRACE", "PATCH", "OPTIONS"):
            async with http.request(method, f"http://127.0.0.1:{door.cluster.front_port}/metrics",
                                    headers={"Host": f"door-1:{door.port}"}) as resp:
                assert resp.status == 405, method
                assert resp.headers["Allow"] == "GET, HEAD, CONNECT"
                assert "not allowed" in await resp.text()
        async with http.head(f"http://127.0.0.1:{door.cluster.front_port}/metrics",
                             headers={"Host": f"door-1:{door.port}"}) as resp:
            assert resp.status == 200
    assert await door.refused("method") >= 6
    await scrape(door)


async def test_a_slow_request_body_is_cut_off(door: Door) -> None:
    # GET with a body (allowed method): the body never completes within body_timeout.
    reader, writer = await raw(door, ATTACKERS[0], f"GET /metrics HTTP/1.1\r\nHost: door-1:{door.port}\r\n"
                               "Content-Length: 1000\r\n\r\nabc".encode())
    try:
        await scrape(door)
        answer = await read_all(reader, 10)
        assert answer.startswith(b"HTTP/1.1 408"), answer
    finally:
        await close_all([writer])


async def agent_streams(door: Door) -> float:
    agent = next(iter(door.cluster.agents.values()))
    values = await metric_values(agent.metrics_port, "raven_agent_streams_in_flight")
    return sum(values.values())


async def gateway_streams(door: Door) -> float:
    values = await metric_values(door.ops_port, "raven_gateway_streams_in_flight")
    return sum(values.values())


async def test_a_client_that_does_not_read_is_reset_and_others_keep_their_share(door: Door) -> None:
    """Six non-reading requests for a 4 MiB page: four get slots (half the node's 8), two are refused 503;
    the stalled four are reset after the write-stall deadline and the node's slots come back."""
    request = f"GET /metrics HTTP/1.1\r\nHost: door-big:{door.port}\r\n\r\n".encode()
    before = await door.refused("write-stall")
    conns = []
    for _ in range(6):
        conns.append(await raw(door, ATTACKERS[1], request, rcvbuf=4096))
        await asyncio.sleep(0.05)
    try:
        heads = await asyncio.gather(*(asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5) for r, _ in conns))
        assert sum(h.startswith(b"HTTP/1.1 200") for h in heads) == 4, heads
        assert sum(h.startswith(b"HTTP/1.1 503") for h in heads) == 2, heads
        # While they hold their share, another client still scrapes the same node in full.
        body = await scrape(door, "door-big")
        assert len(body) >= 4 * 1024 * 1024 - 1024
        assert all(b"requests in flight to node 'door-big'" in h for h in heads if h.startswith(b"HTTP/1.1 503"))

        async def released() -> bool:
            return await door.refused("write-stall") >= before + 4 and await gateway_streams(door) == 0

        async def agent_released() -> bool:
            return await agent_streams(door) == 0

        await eventually(released, timeout=WRITE_STALL + 10, what="stalled streams reset at the gateway")
        await eventually(agent_released, timeout=5, what="the agent released the stalled streams")
        await scrape(door, "door-big")
    finally:
        await close_all([w for _, w in conns])


async def test_connect_tunnels_are_capped_per_client_and_idle_ones_closed(door: Door) -> None:
    request = f"CONNECT door-1:{door.port} HTTP/1.1\r\nHost: door-1:{door.port}\r\n\r\n".encode()
    conns = [await raw(door, ATTACKERS[2], request) for _ in range(3)]
    try:
        heads = [await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5) for r, _ in conns]
        assert sum(h.startswith(b"HTTP/1.1 200") for h in heads) == 2, heads
        refused = [h for h in heads if h.startswith(b"HTTP/1.1 503")]
        assert len(refused) == 1 and b"CONNECT tunnels open" in refused[0]
        await scrape(door)
        # connect_idle_timeout 1.5 s: the open ones are closed.
        for (reader, _), head in zip(conns, heads, strict=True):
            if head.startswith(b"HTTP/1.1 200"):
                assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        await close_all([w for _, w in conns])
    assert await door.refused("connect-client-cap") >= 1


async def test_connect_to_a_port_not_allowed_is_403(door: Door) -> None:
    reader, writer = await raw(door, ATTACKERS[3], b"CONNECT door-1:22 HTTP/1.1\r\nHost: door-1:22\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 403")
    finally:
        await close_all([writer])


async def test_client_forwarded_headers_are_replaced_by_what_the_gateway_saw(door: Door) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(
            f"http://127.0.0.1:{door.cluster.front_port}/metrics",
            headers={"Host": f"door-echo:{door.port}", "X-Forwarded-For": "6.6.6.6", "Forwarded": "for=6.6.6.6",
                     "X-Real-IP": "6.6.6.6", "X-Forwarded-Host": "evil", "X-Raven-Client": "forged"},
        ) as resp:
            assert resp.status == 200
    got = {k.lower(): v for k, v in door.seen[-1].items()}
    assert got["x-forwarded-for"] == "127.0.0.1"
    assert got["x-forwarded-proto"] == "http"
    assert "forwarded" not in got and "x-real-ip" not in got and "x-forwarded-host" not in got
    assert "6.6.6.6" not in str(got)
    assert "forged" not in str(got)


async def test_tunnel_port_handshake_and_upgrade_have_deadlines(door: Door) -> None:
    """A peer that never starts TLS, or never finishes its upgrade request, is dropped after the deadline."""
    reader, writer = await asyncio.open_connection("127.0.0.1", door.cluster.tunnel_port)
    try:
        assert await asyncio.wait_for(reader.read(), HEAD_TIMEOUT + 5) == b""
    finally:
        await close_all([writer])
    from raven.config import TLSConfig
    from raven.transport.tls import client_context

    certs = door.cluster.certs
    agent = next(iter(door.cluster.agents))
    ctx = client_context(TLSConfig(cert=certs / f"{agent}.pem", key=certs / f"{agent}-key.pem", ca=certs / "ca.pem"))
    ctx.check_hostname = False
    reader, writer = await asyncio.open_connection("127.0.0.1", door.cluster.tunnel_port, ssl=ctx)
    try:
        writer.write(b"GET /tunnel HTTP/1.1\r\nHost: x\r\n")  # never finished
        await writer.drain()
        answer = await read_all(reader, HEAD_TIMEOUT + 5)
        assert answer.startswith(b"HTTP/1.1 408") or answer == b"", answer
    finally:
        await close_all([writer])
    await scrape(door)


async def test_tunnel_connections_count_from_the_tcp_accept(door: Door) -> None:
    """Peers that never start TLS are counted against the tunnel port's per-address cap (20 here): the 21st
    is closed at once, and all are gone after the handshake deadline; the agent's session is untouched."""
    conns = []
    try:
        for _ in range(25):
            _, writer = await asyncio.open_connection("127.0.0.1", door.cluster.tunnel_port,
                                                      local_addr=(ATTACKERS[4], 0))
            conns.append(writer)
        async def failures(reason: str, at_least: float) -> bool:
            values = await metric_values(door.ops_port, "raven_gateway_handshake_failures_total")
            return values.get((("reason", reason),), 0) >= at_least

        before = (await metric_values(door.ops_port, "raven_gateway_handshake_failures_total")).get(
            (("reason", "head-timeout"),), 0)
        await eventually(lambda: failures("client-connections", 5), timeout=5, what="the per-address cap")
        await scrape(door)
        await eventually(lambda: failures("head-timeout", before + 20), timeout=HEAD_TIMEOUT + 5,
                         what="handshakes that never came timed out")
        assert sum((await metric_values(door.ops_port, "raven_gateway_sessions")).values()) == 1
        await scrape(door)
    finally:
        await close_all(conns)


async def test_a_restarted_replica_answers_503_not_404_until_settled(door: Door) -> None:
    gateway = door.cluster.gateway
    assert gateway is not None
    await door.cluster.stop(gateway, signal.SIGKILL)
    start = door.cluster.start_gateway()
    statuses: dict[int, int] = {}
    retry_after: set[str] = set()

    async def hammer(http: aiohttp.ClientSession) -> None:
        url = f"http://127.0.0.1:{door.cluster.front_port}/metrics"
        for _ in range(400):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url, headers={"Host": f"door-1:{door.port}"}) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    if resp.status == 503:
                        retry_after.add(resp.headers.get("Retry-After", ""))
                    if resp.status == 200 and statuses.get(200, 0) > 20:
                        return
            await asyncio.sleep(0.02)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        await asyncio.gather(start, hammer(http))
        await door.cluster.wait_registered(30)
        await hammer(http)
    restarted = door.cluster.gateway
    assert restarted is not None
    await door.cluster.wait_ready(restarted)  # ready_max_wait (the agents' reconnect bound) after its start
    assert 404 not in statuses, statuses
    assert statuses.get(200, 0) > 20, statuses
    if 503 in statuses:
        assert retry_after == {"2"}, retry_after


async def test_clients_that_give_up_release_the_agent_at_once(door: Door) -> None:
    """Eight scrapes (the node's limit here, from two client addresses) of a node that never answers; the
    clients leave after 1 s. The gateway resets their streams and the agent aborts its upstream requests:
    its streams are back to zero at once, and the node serves the next scrape."""
    door.exporter.set_mode("door-1", "stall")
    try:
        async def give_up(source: str) -> None:
            connector = aiohttp.TCPConnector(local_addr=(source, 0))
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1)) as http:
                    await http.get(f"http://127.0.0.1:{door.cluster.front_port}/metrics",
                                   headers={"Host": f"door-1:{door.port}"})

        async def held() -> bool:
            return await agent_streams(door) == 8

        clients = [asyncio.ensure_future(give_up(ATTACKERS[i % 2])) for i in range(8)]
        await eventually(held, timeout=5, what="8 streams at the agent")
        await asyncio.gather(*clients)
        loop = asyncio.get_running_loop()
        left = loop.time()

        async def released() -> bool:
            return await agent_streams(door) == 0 and await gateway_streams(door) == 0

        await eventually(released, timeout=5, interval=0.01, what="streams released")
        took = loop.time() - left
        print(f"agent and gateway streams at zero {took * 1000:.0f} ms after the clients left")
        assert took < 1.0, took
    finally:
        door.exporter.set_mode("door-1", "ok")
    await scrape(door)


async def test_readiness_is_live(door: Door) -> None:
    """A replica that loses every agent session for longer than ready_max_wait turns unready, and ready again
    when an agent is back; /readyz says why."""
    url = f"http://127.0.0.1:{door.ops_port}/readyz"

    async def readyz() -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(url) as resp:
                return resp.status, await resp.text()

    assert (await readyz())[0] == 200
    (name, agent), = door.cluster.agents.items()
    await door.cluster.stop(agent, signal.SIGKILL)

    async def unready() -> bool:
        status, text = await readyz()
        return status == 503 and "no agent session for" in text

    await eventually(unready, timeout=30, what="unready without agents")  # ready_max_wait is 3 s here
    await door.cluster.start_agent(door.cluster.pools[0], name)

    async def ready() -> bool:
        return (await readyz())[0] == 200

    await eventually(ready, timeout=30, what="ready again")
    await door.cluster.wait_registered(30)
    await scrape(door)


async def test_a_clean_drain_logs_no_warning(door: Door) -> None:
    """SIGTERM on the agent: it drains and exits 0; the end of its sessions is an INFO line, not a WARNING."""
    (name, agent), = door.cluster.agents.items()
    assert await door.cluster.stop(agent, signal.SIGTERM) == 0
    log = agent.log.read_text()
    drain = log[log.rindex("draining: telling gateways"):]  # earlier tests killed gateways: not a clean end
    ended = [line for line in drain.splitlines() if "session to gateway" in line and "ended" in line]
    assert ended and all(" INFO " in line for line in ended), ended
    # The collector's own report of a long pause (raven.gc, a busy machine) is not about the drain.
    warned = [line for line in drain.splitlines() if " WARNING " in line and " raven.gc: " not in line]
    assert not warned, drain
    await door.cluster.start_agent(door.cluster.pools[0], name)
    await door.cluster.wait_registered(30)
    await scrape(door)
