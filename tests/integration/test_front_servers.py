"""The front port on each of its servers (``front.server``: lean, the default, and aiohttp's), real processes:
every request-smuggling shape is refused with a 400 and the connection closed before anything reaches a node,
pipelined requests are answered in their order, and a normal scrape succeeds beside them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port, start_echo
from tests.support.metrics import metric_values

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]


class Front:
    def __init__(self, cluster: LocalCluster, port: int, seen: list[dict[str, str]], server: str) -> None:
        self.cluster = cluster
        self.port = port
        self.seen = seen
        self.server = server

    async def exchange(self, data: bytes, source: str = "127.0.0.1") -> bytes:
        """Send ``data`` from ``source``, read until the gateway closes (or 10 s)."""
        reader, writer = await asyncio.open_connection(self.cluster_host, self.cluster.front_port,
                                                       local_addr=(source, 0))
        try:
            writer.write(data)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()

    cluster_host = "127.0.0.1"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["lean", "aiohttp"])
async def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Front]:
    port = pick_node_port(HOSTS)
    node = SimNode("srv-1", HOSTS[0], port, size=2000)
    exporter = SimExporter([node])
    await exporter.start()
    seen: list[dict[str, str]] = []
    echo_runner = await start_echo(HOSTS[2], port, seen)
    cluster = LocalCluster(
        tmp_path_factory.mktemp(f"front-{request.param}"),
        [PoolSpec("pool-s", [node, SimNode("srv-echo", HOSTS[2], port)], agents=1)],
        allowed_ports=[port],
        gateway_settings={"front": {"server": request.param, "idle_timeout": 5, "head_timeout": 2,
                                    "allowed_methods": ["GET", "HEAD", "POST"]}},
    )
    try:
        await cluster.start()
        yield Front(cluster, port, seen, request.param)
    finally:
        await cluster.close()
        await exporter.close()
        await echo_runner.cleanup()


SMUGGLING = {
    "CL+TE": b"POST /metrics HTTP/1.1\r\nHost: srv-echo:%d\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n"
             b"\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: srv-echo:%d\r\n\r\n",
    "duplicate Content-Length": b"POST /metrics HTTP/1.1\r\nHost: srv-echo:%d\r\nContent-Length: 0\r\n"
                                b"Content-Length: 44\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: srv-echo:%d\r\n\r\n",
    "obs-fold": b"GET /metrics HTTP/1.1\r\nHost: srv-echo:%d\r\nX-Folded: a\r\n Transfer-Encoding: chunked\r\n"
                b"X-Port: %d\r\n\r\n",
    "bare LF": b"GET /metrics HTTP/1.1\nHost: srv-echo:%d\nX-Port: %d\n\n",
    "bare LF in a chunk size": b"POST /metrics HTTP/1.1\r\nHost: srv-echo:%d\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"2\nok\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: srv-echo:%d\r\n\r\n",
}


@pytest.mark.parametrize("shape", list(SMUGGLING))
async def test_request_smuggling_is_refused_and_reaches_no_node(front: Front, shape: str) -> None:
    before = len(front.seen)
    answer = await front.exchange(SMUGGLING[shape] % (front.port, front.port), "127.0.10.60")
    # One 400, then the close: no second answer for a request hidden in the first one's body.
    # (aiohttp's server answers its parser's refusals as HTTP/1.0, quoting the request.)
    assert answer.split(b" ", 2)[1] == b"400" and b" 200 " not in answer, (front.server, answer)
    assert len(front.seen) == before  # nothing reached the node
    answer = await front.exchange(b"GET /metrics HTTP/1.1\r\nHost: srv-1:%d\r\nConnection: close\r\n\r\n"
                                  % front.port)
    assert answer.startswith(b"HTTP/1.1 200") and b"DCGM_FI" in answer


async def test_pipelined_requests_are_answered_in_order(front: Front) -> None:
    host = b"Host: srv-1:%d\r\n" % front.port
    answer = await front.exchange(
        b"GET /metrics HTTP/1.1\r\n" + host + b"\r\n"
        b"GET /metrics HTTP/1.1\r\nHost: no-such-node:%d\r\n\r\n" % front.port +
        b"HEAD /metrics HTTP/1.1\r\n" + host + b"\r\n"
        b"GET /echo HTTP/1.1\r\nHost: srv-echo:%d\r\n\r\n" % front.port +
        b"GET /metrics HTTP/1.1\r\n" + host + b"Connection: close\r\n\r\n")
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert statuses == [b"200", b"404", b"200", b"200", b"200"], (front.server, statuses)
    assert answer.count(b"DCGM_FI_DEV_GPU_TEMP{") >= 2
    streams = await metric_values(front.cluster.gateway_metrics_port, "raven_gateway_streams_in_flight")
    assert sum(streams.values()) == 0


async def test_expect_100_continue_and_http10(front: Front) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.cluster.front_port)
    try:
        writer.write(b"POST /metrics HTTP/1.1\r\nHost: srv-echo:%d\r\nContent-Length: 5\r\n"
                     b"Expect: 100-continue\r\n\r\n" % front.port)
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        writer.write(b"hello")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 "), head
    finally:
        writer.close()
    answer = await front.exchange(b"GET /metrics HTTP/1.0\r\nHost: srv-1:%d\r\n\r\n" % front.port)
    assert re.match(rb"HTTP/1\.[01] 200 ", answer) and b"DCGM_FI" in answer  # HTTP/1.0: the close ends it
