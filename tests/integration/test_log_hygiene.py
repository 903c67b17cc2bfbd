"""What the gateway writes and accepts at the edges of the rules (issue 21): no secret in any log line, duplicate
credential and framing fields refused, no log line a client or an agent can forge or multiply, and names that
belong to the cluster never published. A normal scrape succeeds throughout."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from raven.protocol import wire
from tests.support.agentpeer import Peer
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

TOKEN = "hygiene-token-5f0e1d2c3b4a69788796a5b4"
FORGED = "2026-11-25 00:00:00,000 ERROR   raven.gateway: FORGED"


@dataclass
class Bed:
    cluster: LocalCluster
    port: int

    @property
    def gateway_log(self) -> Path:
        proc = self.cluster.gateway
        assert proc is not None
        return proc.log

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.cluster.workdir.glob("*.log"))

    async def scrape(self) -> None:
        url = f"http://127.0.0.1:{self.cluster.front_port}/metrics"
        headers = {"Host": f"hy-1:{self.port}", "Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url, headers=headers) as resp:
                assert resp.status == 200, await resp.text()

    async def raw(self, request: bytes, source: str = "127.0.0.1", port: int | None = None) -> bytes:
        """One request on a new connection from ``source`` (its own rate-limit key), asking the server to close
        it after the answer; the whole answer."""
        line, eol, rest = request.partition(b"\r\n") if b"\r\n" in request else request.partition(b"\n")
        request = line + eol + b"Connection: close" + eol + rest
        reader, writer = await asyncio.open_connection("127.0.0.1", port or self.cluster.front_port,
                                                       local_addr=(source, 0))
        try:
            writer.write(request)
            await writer.drain()
            async with asyncio.timeout(10):
                return await reader.read()
        finally:
            writer.close()

    async def refused(self) -> dict[str, float]:
        values = await metric_values(self.cluster.gateway_metrics_port, "raven_gateway_front_refused_total")
        return {dict(k).get("reason", ""): v for k, v in values.items()}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    port = pick_node_port(HOSTS)
    node = SimNode("hy-1", HOSTS[0], port)
    exporter = SimExporter([node])
    await exporter.start()
    cluster = LocalCluster(
        # Two identities of pool-hy: the first runs as a real agent, the second is the hand-written peer.
        tmp_path_factory.mktemp("log-hygiene"), [PoolSpec("pool-hy", [node], agents=2)], allowed_ports=[port],
        front_token=TOKEN,
        gateway_settings={"front": {"allow_connect": True}, "hosts": {"service_addresses": ["10.96.0.10"]}},
    )
    try:
        cluster.make_pki()
        await cluster.start_gateway()
        await cluster.start_agent(cluster.pools[0], "agent-pool-hy-1")
        await cluster.wait_registered(30, agents_per_node=1)
        assert cluster.gateway is not None
        await cluster.wait_ready(cluster.gateway)  # settled: an unknown node is a 404, not "retry"
        yield Bed(cluster, port)
    finally:
        await cluster.close()
        await exporter.close()


def _basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


async def test_no_log_line_holds_the_token(bed: Bed) -> None:
    """The token goes out in every kind of request that is refused, malformed or logged (each from its own
    address, so that rate limiting hides none of the lines); no log of the gateway or the agent holds it."""
    host = f"hy-1:{bed.port}"
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    requests = [
        # Rejected by the HTTP parser, which quotes the raw bytes: bare LF, a control byte, a duplicate Host.
        f"GET /metrics?token={TOKEN} HTTP/1.1\nHost: {host}\nAuthorization: Bearer {TOKEN}\n\n".encode(),
        f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n{auth}Bad\x01Name: x\r\n\r\n".encode(),
        f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nHost: {host}\r\n{auth}\r\n".encode(),
        f"GET /{'x' * 70000}?t={TOKEN} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode(),
        # Refused by the front end: the token in the query string, a cookie, proxy user info, the path.
        f"GET /metrics?token={TOKEN} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),
        f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nCookie: session={TOKEN}\r\n\r\n".encode(),
        f"GET http://prometheus:{TOKEN}@{host}/metrics?x={TOKEN} HTTP/1.1\r\nHost: {host}\r\n"
        f"Proxy-Authorization: Basic {_basic('prometheus', 'wrong-password-123456')}\r\n\r\n".encode(),
        f"GET /metrics?token={TOKEN} HTTP/1.1\r\nHost: no-such-node:{bed.port}\r\n{auth}\r\n".encode(),
        f"GET /metrics?token={TOKEN} HTTP/1.1\r\nHost: hy-1:1\r\n{auth}\r\n".encode(),
        f"DELETE /metrics?token={TOKEN} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode(),
        f"GET /{TOKEN} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer wrong-{TOKEN}\r\n\r\n".encode(),
        f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n{auth}Authorization: Bearer other-token-0123456789\r\n\r\n"
        .encode(),
        f"CONNECT {TOKEN}:{bed.port} HTTP/1.1\r\nHost: {TOKEN}:{bed.port}\r\n"
        f"Proxy-Authorization: Bearer {TOKEN}\r\n\r\n".encode(),
        f"GET /metrics HTTP/1.1\r\nHost: {TOKEN}:{bed.port}\r\n{auth}\r\n".encode(),
    ]
    answers = [await bed.raw(req, source=f"127.0.3.{i + 1}") for i, req in enumerate(requests)]
    statuses = [a.split(b" ", 2)[1] for a in answers]
    assert statuses == [b"400", b"400", b"400", b"400", b"401", b"401", b"407", b"404", b"403", b"405", b"401",
                        b"400", b"404", b"404"], statuses
    # The ops port takes the same token: in a query, and in a request its parser rejects.
    ops = bed.cluster.gateway_metrics_port
    await bed.raw(f"GET /sd?token={TOKEN} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), "127.0.3.100", ops)
    await bed.raw(f"GET /sd HTTP/1.1\nAuthorization: Bearer {TOKEN}\n\n".encode(), "127.0.3.101", ops)
    await bed.scrape()

    def every_line_written() -> bool:
        text = bed.gateway_log.read_text(errors="replace")
        return text.count("not handled") >= 5 and text.count("-> 40") >= 9

    await eventually(every_line_written, timeout=10, what="a log line for every request")
    logs = bed.logs()
    assert TOKEN not in logs, [line for line in logs.splitlines() if TOKEN in line]
    assert "<redacted>" in logs


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (f"Authorization: Bearer {TOKEN}\r\nAuthorization: Bearer wrong-token-0123456789\r\n", "Authorization"),
        (f"Authorization: Bearer wrong-token-0123456789\r\nAuthorization: Bearer {TOKEN}\r\n", "Authorization"),
        (f"Authorization: Bearer {TOKEN}\r\nProxy-Authorization: Bearer {TOKEN}\r\n"
         f"Proxy-Authorization: Bearer {TOKEN}\r\n", "Proxy-Authorization"),
        (f"Authorization: Bearer {TOKEN}\r\nHost: hy-1:PORT\r\n", "Host"),
        (f"Authorization: Bearer {TOKEN}\r\nContent-Length: 0\r\nContent-Length: 0\r\n", "Content-Length"),
    ],
)
async def test_duplicate_singleton_fields_are_refused(bed: Bed, fields: str, says: str) -> None:
    fields = fields.replace("PORT", str(bed.port))
    answer = await bed.raw(f"GET /metrics HTTP/1.1\r\nHost: hy-1:{bed.port}\r\n{fields}\r\n".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") or head.startswith(b"HTTP/1.0 400"), answer[:300]
    assert says.encode() in body, body
    await bed.scrape()


async def test_a_flood_of_refusals_grows_the_log_by_a_few_lines(bed: Bed) -> None:
    """500 requests for each kind of refusal (401, 403, 404, 405) and 150 malformed ones from one client:
    every one is counted, and the log grows by a few lines (a line each would be well over 50 kB; the limit
    is 4 kB)."""
    before_size = bed.gateway_log.stat().st_size
    before = await bed.refused()
    n = 500
    url = f"http://127.0.0.1:{bed.cluster.front_port}/x"
    good = {"Authorization": f"Bearer {TOKEN}"}
    kinds = {
        "auth": ("GET", {"Host": f"hy-1:{bed.port}"}),
        "port": ("GET", {"Host": "hy-1:1", **good}),
        "unknown-node": ("GET", {"Host": f"nope:{bed.port}", **good}),
        "method": ("PUT", {"Host": f"hy-1:{bed.port}", **good}),
    }
    connector = aiohttp.TCPConnector(limit=8, local_addr=("127.0.4.1", 0))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http:
        async def one(method: str, headers: dict[str, str], i: int) -> int:
            async with http.request(method, f"{url}/{i}?q={i}", headers=headers) as resp:
                await resp.read()
                return resp.status

        for method, headers in kinds.values():
            for start in range(0, n, 200):
                await asyncio.gather(*(one(method, headers, i) for i in range(start, start + 200)))
    for _ in range(150):
        await bed.raw(b"GET / HTTP/1.1\nHost: x\n\n", source="127.0.4.2")
    await bed.scrape()
    after = await bed.refused()
    for label in kinds:
        assert after.get(label, 0) - before.get(label, 0) >= n, (label, before, after)
    await asyncio.sleep(0.3)
    grown = bed.gateway_log.read_bytes()[before_size:]
    assert len(grown) < 4096, grown.decode(errors="replace")[-3000:]


async def test_an_agent_cannot_forge_flood_or_publish_cluster_names(bed: Bed) -> None:
    """A hand-written agent of pool-hy registers names that belong to the cluster (refused, counted, told the
    reason), churns its registrations (nodes come and go) and sends DRAIN reasons with newlines and escapes:
    the log grows by a few escaped lines, nothing forged, and the hosts file holds none of those names."""
    before_size = bed.gateway_log.stat().st_size
    reserved = ["kube-dns", "coredns", "metadata", "prometheus", "raven-gateway", "2130706433", "localhost",
                "kubernetes", "x.svc.cluster.local"]
    async with Peer(bed.cluster, "agent-pool-hy-2") as peer:
        welcome = await peer.connect()
        assert isinstance(welcome, wire.Welcome), welcome
        infos = tuple(wire.NodeInfo(n, "10.1.0.1", "pool-hy") for n in reserved)
        await peer.send(wire.encode(wire.Register(infos)))
        answer = await peer.control()
        assert isinstance(answer, wire.Registered), answer
        reasons = dict(answer.refused)
        assert set(reasons) == set(reserved) and not answer.accepted, answer
        assert all("reserved" in r or "IP address" in r for r in reasons.values()), reasons
        # Churn: 300 nodes come and go, as fast as the registration rate lets them.
        churn = tuple(wire.NodeInfo(f"churn-{i}", "10.1.0.1", "pool-hy") for i in range(300))
        for i in range(12):
            await peer.send(wire.encode(wire.Register(churn if i % 2 == 0 else ())))
        for _ in range(200):
            await peer.send(wire.encode(wire.Drain(f"bye\n{FORGED}\x00\x1b[2J")))
        await peer.send(wire.encode(wire.Register(())))

        async def churned() -> bool:
            values = await metric_values(bed.cluster.gateway_metrics_port,
                                         "raven_gateway_registration_refusals_total")
            return sum(values.values()) >= len(reserved)

        await eventually(churned, timeout=10, what="the refusals counted")
        await eventually(lambda: "is draining" in bed.gateway_log.read_text(errors="replace"), timeout=10)
        await asyncio.sleep(1.5)  # the held registrations are applied at the registration rate
    await bed.scrape()
    grown = bed.gateway_log.read_bytes()[before_size:].decode(errors="replace")
    assert FORGED not in [line[: len(FORGED)] for line in grown.splitlines()], grown[-3000:]
    assert "\x1b" not in grown and "\x00" not in grown and "\\x1b[2J" in grown
    assert len(grown.encode()) < 6144, grown[-3000:]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        url = f"http://127.0.0.1:{bed.cluster.gateway_metrics_port}/hosts"
        async with http.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            hosts = await resp.text()
    assert "hy-1" in hosts
    for name in reserved:
        assert f" {name}\n" not in hosts and not any(line.endswith(f" {name}") for line in hosts.splitlines())
