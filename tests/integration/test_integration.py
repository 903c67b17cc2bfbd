"""Real processes, real sockets, real TLS on loopback: the gateway and agents as users run them."""

from __future__ import annotations

import asyncio
import gzip
import signal
import ssl
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from raven import pki
from raven.config import TLSConfig
from raven.protocol import wire
from raven.transport.tls import client_context, server_context
from tests.support.cluster import Bed
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]


async def fetch(
    bed: Bed, node: str, port: int | None = None, *, mode: str = "proxy", headers: dict[str, str] | None = None,
    decompress: bool = True, timeout: float = 15,
) -> tuple[int, dict[str, str], bytes]:
    port = port or bed.port
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout), auto_decompress=decompress
    ) as http:
        if mode == "proxy":
            ctx = http.get(f"http://{node}:{port}/metrics", proxy=bed.cluster.front_url, headers=headers)
        else:
            ctx = http.get(f"{bed.cluster.front_url}/metrics", headers={"Host": f"{node}:{port}", **(headers or {})})
        async with ctx as resp:
            return resp.status, dict(resp.headers), await resp.read()








async def test_scrape_every_node_by_absolute_uri(bed: Bed) -> None:
    for pool in bed.cluster.pools:
        for node in pool.nodes:
            status, headers, body = await fetch(bed, node.name)
            assert status == 200, body
            assert f'Hostname="{node.name}"'.encode() in body
            assert b"DCGM_FI_DEV_GPU_UTIL" in body
            assert headers["X-Raven-Agent"].startswith(f"agent-{pool.name}-")


async def test_scrape_by_host_header(bed: Bed) -> None:
    status, headers, body = await fetch(bed, "edge-a-2", mode="host", headers={"Accept-Encoding": "identity"})
    assert status == 200
    assert b'Hostname="edge-a-2"' in body
    assert int(headers["Content-Length"]) == len(body)


async def test_gzip_passes_through_unchanged(bed: Bed) -> None:
    status, headers, body = await fetch(bed, "edge-a-3", headers={"Accept-Encoding": "gzip"}, decompress=False)
    assert status == 200
    assert headers["Content-Encoding"] == "gzip"
    assert b'Hostname="edge-a-3"' in gzip.decompress(body)


async def _connect(bed: Bed, node: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", bed.cluster.front_port)
    writer.write(f"CONNECT {node}:{port} HTTP/1.1\r\nHost: {node}:{port}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return reader, writer, head


async def test_connect_relays_raw_tcp(bed: Bed) -> None:
    reader, writer, head = await _connect(bed, "edge-b-1", bed.port)
    try:
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: edge-b-1\r\nConnection: close\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        assert data.startswith(b"HTTP/1.1 200")
        assert b'Hostname="edge-b-1"' in data
    finally:
        writer.close()


async def test_connect_carries_tls_end_to_end(bed: Bed) -> None:
    """A TLS server on a node port (as a kubelet would be): the client's TLS goes through the tunnel."""
    certs = bed.cluster.certs
    tls = TLSConfig(cert=certs / "raven-gateway.pem", key=certs / "raven-gateway-key.pem", ca=certs / "ca.pem")
    server_ctx = server_context(tls)
    server_ctx.verify_mode = ssl.CERT_NONE

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="kubelet says hi")

    app = web.Application()
    app.router.add_get("/healthz", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    host = bed.pools["pool-a"].nodes[0].host
    await web.TCPSite(runner, host, bed.tcp_port, ssl_context=server_ctx).start()
    try:
        reader, writer, head = await _connect(bed, "edge-a-1", bed.tcp_port)
        try:
            assert head.startswith(b"HTTP/1.1 200"), head
            client_ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
            await writer.start_tls(client_ctx, server_hostname="raven-gateway")
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge-a-1\r\nConnection: close\r\n\r\n")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 10)
            assert data.startswith(b"HTTP/1.1 200")
            assert data.endswith(b"kubelet says hi")
        finally:
            writer.close()
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------- errors decided before any header


async def test_unknown_node_is_404_with_reason(bed: Bed) -> None:
    status, _, body = await fetch(bed, "edge-zz-9")
    assert status == 404
    assert b"edge-zz-9" in body and b"not registered" in body
    # A name that only shares a suffix with a registered node is a different node.
    status, _, _ = await fetch(bed, "xedge-a-1")
    assert status == 404


async def test_port_not_allowed_is_403(bed: Bed) -> None:
    status, _, body = await fetch(bed, "edge-a-1", port=22)
    assert status == 403
    assert b"port 22" in body


async def test_bad_host_is_400(bed: Bed) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{bed.cluster.front_url}/metrics", headers={"Host": "Not_A_Node:9400"}) as resp:
            assert resp.status == 400
            assert "not a valid node name" in await resp.text()


@pytest.mark.parametrize(("host", "why"), [
    ("edge-a-1..:9400", b"not a valid node name"),
    ("edge-a-1:\u00b2", b"bad port"),  # a digit to str.isdigit(), not to int()
    ("edge-a-1:99999", b"bad port"),
    ("edge-a-1:-1", b"bad port"),
])
async def test_malformed_authority_is_400_with_a_reason(bed: Bed, host: str, why: bytes) -> None:
    head = await _raw_request(bed, f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode("latin-1"))
    assert head.startswith(b"HTTP/1.1 400"), head
    assert why in head


async def test_discovery_filters_by_port_and_pool_and_says_what_it_takes(bed: Bed) -> None:
    ops = f"http://127.0.0.1:{bed.cluster.gateway_metrics_port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{ops}/sd", params=[("port", str(bed.port)), ("pool", "pool-b")]) as resp:
            groups = await resp.json()
        assert sorted(g["targets"][0] for g in groups) == [f"edge-b-1:{bed.port}", f"edge-b-2:{bed.port}"]
        assert {g["labels"]["pool"] for g in groups} == {"pool-b"}
        async with http.get(f"{ops}/sd", params=[("port", str(bed.port)), ("port", "9100")]) as resp:
            ports = {g["labels"]["port"] for g in await resp.json()}
        assert ports == {str(bed.port), "9100"}
        async with http.get(f"{ops}/sd", params={"job": "x"}) as resp:
            assert resp.status == 400 and "takes port=, pool=, reach=" in await resp.text()
        async with http.get(f"{ops}/nope") as resp:
            assert resp.status == 404 and "/sd" in await resp.text()
        async with http.post(f"{ops}/sd") as resp:  # a known path with the wrong method stays a 405
            assert resp.status == 405 and "GET" in resp.headers["Allow"]


async def _raw_request(bed: Bed, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", bed.cluster.front_port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()


async def test_a_client_that_stalls_its_request_body_gets_408_not_a_node_error(bed: Bed) -> None:
    head = await _raw_request(
        bed, f"POST /metrics HTTP/1.1\r\nHost: edge-a-1:{bed.port}\r\nContent-Length: 1000\r\n"
             "X-Prometheus-Scrape-Timeout-Seconds: 1\r\n\r\nabc".encode(),
    )
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"the client sent 3 bytes of its request body" in head


@pytest.mark.parametrize("body_after", [0.0, 1.0])
async def test_expect_100_continue_is_answered_by_the_gateway(bed: Bed, body_after: float) -> None:
    """The gateway answers 100 Continue; the body goes through the tunnel, and the simulated exporter answers POST
    with its own 405, without reading the body. The agent relays that answer and then tells the gateway to stop
    sending (a RESET after its FIN): a client whose body comes only after that (``body_after``) still gets the
    node's answer, not a 502 (a CI run saw the 502 when the client's body came a moment late)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", bed.cluster.front_port)
    try:
        writer.write(f"POST /metrics HTTP/1.1\r\nHost: edge-a-1:{bed.port}\r\nContent-Length: 5\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        await asyncio.sleep(body_after)
        writer.write(b"hello")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 405") and b"X-Raven-Agent: agent-pool-a-" in head, head
    finally:
        writer.close()
    status, _, _ = await fetch(bed, "edge-a-1")
    assert status == 200


async def test_header_outside_latin1_is_400_and_leaks_no_stream(bed: Bed) -> None:
    for _ in range(3):
        head = await _raw_request(
            bed, f"GET /metrics HTTP/1.1\r\nHost: edge-a-1:{bed.port}\r\nX-Price: 5\u20ac\r\n\r\n".encode()
        )
        assert head.startswith(b"HTTP/1.1 400"), head
        assert b"outside ISO-8859-1" in head
    status, _, _ = await fetch(bed, "edge-a-1")
    assert status == 200
    streams = await metric_values(bed.cluster.gateway_metrics_port, "raven_gateway_streams_in_flight")
    assert sum(streams.values()) == 0


async def test_oversized_header_block_is_431_and_the_tunnel_survives(bed: Bed) -> None:
    big = "".join(f"X-Big-{i}: {'v' * 15000}\r\n" for i in range(6))  # 90 KB > 64 KiB per OPEN
    head = await _raw_request(bed, f"GET /metrics HTTP/1.1\r\nHost: edge-b-1:{bed.port}\r\n{big}\r\n".encode())
    assert head.startswith(b"HTTP/1.1 431"), head
    status, headers, _ = await fetch(bed, "edge-b-1")
    assert status == 200 and headers["X-Raven-Agent"] == "agent-pool-b-1"


async def test_unreachable_node_is_502(bed: Bed) -> None:
    bed.exporter.set_mode("edge-a-1", "refuse")
    try:
        status, _, body = await fetch(bed, "edge-a-1")
        assert status == 502
        assert b"edge-a-1" in body and b"cannot connect" in body
    finally:
        bed.exporter.set_mode("edge-a-1", "ok")


async def test_scrape_timeout_header_gives_504(bed: Bed) -> None:
    bed.exporter.set_mode("edge-a-2", "stall")
    try:
        start = time.monotonic()
        status, _, body = await fetch(bed, "edge-a-2", headers={"X-Prometheus-Scrape-Timeout-Seconds": "1"})
        elapsed = time.monotonic() - start
        assert status == 504, body
        assert b"edge-a-2" in body
        # Prometheus asked for 1 s; the configured deadline is 10 s. Generous bound: it must be the former.
        assert elapsed < 8
    finally:
        bed.exporter.set_mode("edge-a-2", "ok")


async def test_a_client_leaving_while_the_node_is_silent_cancels_the_stream(bed: Bed) -> None:
    port = bed.cluster.gateway_metrics_port
    key = (("code", "cancelled"), ("kind", "http"), ("pool", "pool-a"))
    before = (await metric_values(port, "raven_gateway_requests_total")).get(key, 0.0)
    bed.exporter.set_mode("edge-a-2", "stall")
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", bed.cluster.front_port)
        try:
            writer.write(f"GET /metrics HTTP/1.1\r\nHost: edge-a-2:{bed.port}\r\n\r\n".encode())
            await writer.drain()

            async def stream_open() -> bool:
                return sum((await metric_values(port, "raven_gateway_streams_in_flight")).values()) == 1

            await eventually(stream_open, 5)
        finally:
            writer.close()

        async def counted_and_released() -> bool:
            counted = (await metric_values(port, "raven_gateway_requests_total")).get(key, 0.0) == before + 1
            streams = sum((await metric_values(port, "raven_gateway_streams_in_flight")).values())
            return counted and streams == 0

        await eventually(counted_and_released, 5)
    finally:
        bed.exporter.set_mode("edge-a-2", "ok")


async def test_no_agent_for_pool_is_503(bed: Bed) -> None:
    pool = bed.pools["pool-b"]
    agent = bed.cluster.agents["agent-pool-b-1"]
    try:
        await bed.cluster.stop(agent, signal.SIGKILL)

        async def gone() -> bool:  # still a target (bound to its pool, so up == 0 is recorded), but unconnected
            groups = [g for g in await bed.cluster.sd() if g["labels"]["pool"] == "pool-b"]
            return bool(groups) and all(g["labels"]["__meta_raven_connected"] == "false" for g in groups)

        await eventually(gone)
        status, _, body = await fetch(bed, pool.nodes[0].name)
        assert status == 503
        assert b"pool-b" in body and b"no agent connected" in body
    finally:
        await bed.restore()


# ---------------------------------------------------------------- security


async def _rogue(bed: Bed, agent: str, hello_agent: str | None = None) -> aiohttp.ClientWebSocketResponse:
    certs = bed.cluster.certs
    ctx = client_context(TLSConfig(cert=certs / f"{agent}.pem", key=certs / f"{agent}-key.pem", ca=certs / "ca.pem"))
    http = aiohttp.ClientSession()
    ws = await http.ws_connect(
        f"wss://127.0.0.1:{bed.cluster.tunnel_port}/tunnel", ssl=ctx, server_hostname="raven-gateway"
    )
    ws._rogue_http = http  # type: ignore[attr-defined]
    await ws.send_bytes(wire.encode(wire.Hello(hello_agent or agent, uuid.uuid4().hex, versions=(1,))))
    return ws


async def _close_rogue(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.close()
    await ws._rogue_http.close()  # type: ignore[attr-defined]


async def _next_control(ws: aiohttp.ClientWebSocketResponse) -> wire.Frame:
    while True:
        msg = await asyncio.wait_for(ws.receive(), 10)
        assert msg.type == aiohttp.WSMsgType.BINARY, msg
        frame = wire.decode(msg.data)
        if not isinstance(frame, wire.Ping | wire.Pong):
            return frame


async def test_an_agent_certificate_from_another_ca_is_logged_and_counted(bed: Bed, tmp_path: Path) -> None:
    pki.create_ca(tmp_path)
    pki.issue(tmp_path, tmp_path, "agent", "agent-pool-a-1", pools=["pool-a"])
    certs = bed.cluster.certs
    ctx = client_context(TLSConfig(cert=tmp_path / "agent-pool-a-1.pem", key=tmp_path / "agent-pool-a-1-key.pem",
                                   ca=certs / "ca.pem"))
    port = bed.cluster.gateway_metrics_port
    key = (("reason", "tls CERTIFICATE_VERIFY_FAILED"),)
    before = (await metric_values(port, "raven_gateway_handshake_failures_total")).get(key, 0.0)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            async with http.ws_connect(f"wss://127.0.0.1:{bed.cluster.tunnel_port}/tunnel", ssl=ctx,
                                       server_hostname="raven-gateway"):
                pass

    async def counted() -> bool:
        values = await metric_values(port, "raven_gateway_handshake_failures_total")
        return values.get(key, 0.0) >= before + 1

    await eventually(counted, 5)
    log = (bed.cluster.workdir / "gateway.log").read_text(errors="replace")
    assert "TLS handshake on the tunnel port failed: unable to get local issuer certificate" in log


async def test_impersonation_is_refused(bed: Bed) -> None:
    ws = await _rogue(bed, "agent-pool-a-1")
    try:
        welcome = await _next_control(ws)
        assert isinstance(welcome, wire.Welcome)
        # Claims a pool-b node as pool-b: its certificate only allows pool-a.
        await ws.send_bytes(wire.encode(wire.Register((wire.NodeInfo("edge-b-1", "127.0.0.1", "pool-b"),))))
        answer = await _next_control(ws)
        assert isinstance(answer, wire.Registered)
        assert answer.accepted == ()
        assert answer.refused[0][0] == "edge-b-1"
        assert "pool 'pool-b' is not in this agent's certificate" in answer.refused[0][1]
        # Claims the same node as pool-a: it already belongs to pool-b.
        await ws.send_bytes(wire.encode(wire.Register((wire.NodeInfo("edge-b-1", "127.0.0.1", "pool-a"),))))
        answer = await _next_control(ws)
        assert isinstance(answer, wire.Registered)
        assert "already registered by pool 'pool-b'" in answer.refused[0][1]
    finally:
        await _close_rogue(ws)
    # The real pool-b agent still serves it.
    status, headers, _ = await fetch(bed, "edge-b-1")
    assert status == 200 and headers["X-Raven-Agent"] == "agent-pool-b-1"
    log = bed.cluster.gateway.log.read_text()  # type: ignore[union-attr]
    assert "refused registration of node 'edge-b-1' (pool 'pool-b') from agent agent-pool-a-1" in log


async def test_hello_must_match_certificate(bed: Bed) -> None:
    ws = await _rogue(bed, "agent-pool-a-1", hello_agent="agent-pool-b-1")
    try:
        frame = await _next_control(ws)
        assert isinstance(frame, wire.GoAway)
        assert "certificate is for 'agent-pool-a-1'" in frame.reason
    finally:
        await _close_rogue(ws)


async def test_tunnel_requires_client_certificate(bed: Bed) -> None:
    ctx = ssl.create_default_context(cafile=str(bed.cluster.certs / "ca.pem"))
    async with aiohttp.ClientSession() as http:
        with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
            ws = await http.ws_connect(
                f"wss://127.0.0.1:{bed.cluster.tunnel_port}/tunnel", ssl=ctx, server_hostname="raven-gateway"
            )
            await ws.send_bytes(wire.encode(wire.Hello("x", "y", versions=(1,))))
            msg = await asyncio.wait_for(ws.receive(), 5)
            if msg.type != aiohttp.WSMsgType.BINARY:
                raise ConnectionError("closed")


# ---------------------------------------------------------------- never lose data silently


async def _read_until_broken(resp: aiohttp.ClientResponse, on_first: object = None) -> tuple[int, bool]:
    got = 0
    first = True
    try:
        async for chunk in resp.content.iter_any():
            got += len(chunk)
            if first and on_first is not None:
                first = False
                await on_first()  # type: ignore[operator]
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError):
        return got, True
    return got, False


async def test_agent_killed_mid_response_breaks_the_response(bed: Bed) -> None:
    bed.exporter.set_mode("edge-a-3", "slow")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), auto_decompress=False) as http:
            async with http.get(f"http://edge-a-3:{bed.port}/metrics", proxy=bed.cluster.front_url,
                                headers={"Accept-Encoding": "identity"}) as resp:
                assert resp.status == 200
                victim = bed.cluster.agents[resp.headers["X-Raven-Agent"]]
                expected = int(resp.headers["Content-Length"])

                async def kill() -> None:
                    await bed.cluster.stop(victim, signal.SIGKILL)

                got, broken = await _read_until_broken(resp, kill)
        assert broken, "a response cut by a dead agent must not look complete"
        assert got < expected
    finally:
        await bed.restore()


async def test_exporter_breaking_mid_body_breaks_the_response(bed: Bed) -> None:
    bed.exporter.set_mode("edge-a-1", "break")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            async with http.get(f"http://edge-a-1:{bed.port}/metrics", proxy=bed.cluster.front_url) as resp:
                if resp.status == 502:
                    # The break came before any body bytes reached the gateway (the reset can overtake
                    # the half body): nothing was sent yet, so the client gets a clean 502 that says why.
                    assert "edge-a-1" in await resp.text()
                    return
                assert resp.status == 200
                got, broken = await _read_until_broken(resp)
        assert broken and got > 0
    finally:
        bed.exporter.set_mode("edge-a-1", "ok")


async def test_a_response_cut_before_its_body_is_a_clean_502(bed: Bed) -> None:
    # The node sends a 200 head and resets before any body byte: nothing has reached the client
    # yet, so the gateway still answers with a status and a reason instead of a bare reset.
    bed.exporter.set_mode("edge-a-2", "cut")
    try:
        status, headers, body = await fetch(bed, "edge-a-2", timeout=10)
    finally:
        bed.exporter.set_mode("edge-a-2", "ok")
    assert status == 502
    assert b"edge-a-2" in body and b"pool-a" in body
    assert "edge-a-2" in headers["X-Raven-Error"]


async def test_slow_reader_does_not_stall_its_session(bed: Bed) -> None:
    # pool-b has a single agent: both requests share one session.
    reader, writer = await asyncio.open_connection("127.0.0.1", bed.cluster.front_port)
    try:
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: edge-b-2:{bed.port}\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.5)  # 4 MiB pending, nobody reading: the stream is out of credit
        for _ in range(3):
            status, headers, body = await fetch(bed, "edge-b-1", timeout=10)
            assert status == 200 and headers["X-Raven-Agent"] == "agent-pool-b-1"
            assert b'Hostname="edge-b-1"' in body
        # The slow stream then completes when its reader catches up.
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        body = await asyncio.wait_for(reader.readexactly(length), 30)
        assert b'Hostname="edge-b-2"' in body
    finally:
        writer.close()


# ---------------------------------------------------------------- selection and failover


async def test_load_spreads_over_the_pool_and_a_node_stays_on_one_agent(bed: Bed) -> None:
    """The pool's nodes are shared by its agents, and every request to a node goes through the same one (the
    agent that keeps it through an outage, gateway/rendezvous.py; docs/backfill.md)."""
    seen: dict[str, set[str]] = {}
    for _ in range(4):
        for node in bed.pools["pool-a"].nodes:
            status, headers, _ = await fetch(bed, node.name)
            assert status == 200
            seen.setdefault(node.name, set()).add(headers["X-Raven-Agent"])
    assert all(len(agents) == 1 for agents in seen.values()), seen
    assert set().union(*seen.values()) == {"agent-pool-a-1", "agent-pool-a-2"}, seen


async def test_failover_and_retry_on_the_other_agent(bed: Bed) -> None:
    victim = bed.cluster.agents["agent-pool-a-1"]
    try:
        await bed.cluster.stop(victim, signal.SIGKILL)
        # Straight away, before the gateway may have noticed: a retry on the other agent covers it.
        for _ in range(3):
            for node in bed.pools["pool-a"].nodes:
                status, headers, body = await fetch(bed, node.name)
                assert status == 200, body
                assert headers["X-Raven-Agent"] == "agent-pool-a-2"
    finally:
        await bed.restore()


async def test_drain_lets_a_stream_in_flight_finish(bed: Bed) -> None:
    bed.exporter.set_mode("edge-a-2", "slow")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(f"http://edge-a-2:{bed.port}/metrics", proxy=bed.cluster.front_url) as resp:
                assert resp.status == 200
                victim = bed.cluster.agents[resp.headers["X-Raven-Agent"]]
                victim.process.send_signal(signal.SIGTERM)
                body = await resp.read()
        assert b'Hostname="edge-a-2"' in body
        assert await asyncio.wait_for(victim.process.wait(), 15) == 0
        bed.exporter.set_mode("edge-a-2", "ok")
        status, headers, _ = await fetch(bed, "edge-a-2")
        assert status == 200 and headers["X-Raven-Agent"] != victim.name
    finally:
        await bed.restore()


async def test_frozen_agent_is_detected_by_the_heartbeat(bed: Bed) -> None:
    """SIGSTOP keeps the TCP connection open but silent: only the heartbeat deadline can notice."""
    agent = bed.cluster.agents["agent-pool-b-1"]
    agent.process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()

        async def gone() -> bool:  # still a target (bound to its pool, so up == 0 is recorded), but unconnected
            groups = [g for g in await bed.cluster.sd() if g["labels"]["pool"] == "pool-b"]
            return bool(groups) and all(g["labels"]["__meta_raven_connected"] == "false" for g in groups)

        await eventually(gone, timeout=20)
        assert time.monotonic() - start < 15  # deadline 2.5 s in this suite; generous bound
        status, _, body = await fetch(bed, "edge-b-1")
        assert status == 503, body
    finally:
        agent.process.send_signal(signal.SIGCONT)
    # Thawed, the agent notices its dead session and comes back by itself.
    await bed.cluster.wait_registered(30)
    status, _, _ = await fetch(bed, "edge-b-1")
    assert status == 200
    log = bed.cluster.gateway.log.read_text()  # type: ignore[union-attr]
    assert "heartbeat timeout" in log


# ---------------------------------------------------------------- cleanup


async def test_gauges_return_to_zero(bed: Bed) -> None:
    cluster = bed.cluster

    async def settled() -> bool:
        streams = await metric_values(cluster.gateway_metrics_port, "raven_gateway_streams_in_flight")
        return sum(streams.values()) == 0

    await eventually(settled)
    sessions = await metric_values(cluster.gateway_metrics_port, "raven_gateway_sessions")
    assert sum(sessions.values()) == 3
    for proc in cluster.agents.values():
        assert sum((await metric_values(proc.metrics_port, "raven_agent_streams_in_flight")).values()) == 0
        assert sum((await metric_values(proc.metrics_port, "raven_agent_sessions")).values()) == 1
    requests = await metric_values(cluster.gateway_metrics_port, "raven_gateway_requests_total")
    assert requests[(("code", "200"), ("kind", "http"), ("pool", "pool-a"))] > 0
    refusals = await metric_values(cluster.gateway_metrics_port, "raven_gateway_registration_refusals_total")
    assert sum(refusals.values()) >= 2


async def test_everything_back_at_zero_after_agents_stop(bed: Bed) -> None:
    cluster = bed.cluster
    codes = await asyncio.gather(*(cluster.stop(p) for p in cluster.agents.values()))
    assert codes == [0] * len(codes)  # SIGTERM: drained and exited cleanly

    async def empty() -> bool:
        sessions = await metric_values(cluster.gateway_metrics_port, "raven_gateway_sessions")
        return sum(sessions.values()) == 0

    await eventually(empty)
    streams = await metric_values(cluster.gateway_metrics_port, "raven_gateway_streams_in_flight")
    assert sum(streams.values()) == 0
    nodes = await metric_values(cluster.gateway_metrics_port, "raven_gateway_nodes")
    assert sum(nodes.values()) == 0
    # Their nodes stay bound to their pools (node_rebind_after): targets Prometheus records as down, not gone.
    groups = await cluster.sd()
    assert groups and {g["labels"]["__meta_raven_connected"] for g in groups} == {"false"}
    assert {g["labels"]["__meta_raven_agents"] for g in groups} == {""}
