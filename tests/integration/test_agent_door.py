"""The agent trusts nothing its gateway sends: a hand-written malicious gateway drives a real agent.

The fake gateway is a TLS WebSocket server with a real gateway certificate from the test CA; it speaks the
wire protocol by hand (HELLO -> WELCOME, REGISTER -> REGISTERED, then OPENs of its choosing). Listeners on
addresses and ports outside the agent's inventory count every connection they accept: they must see none,
every malicious OPEN must be answered with a RESET, and a well-formed OPEN must still get the node's page.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from aiohttp import web

from raven.config import TLSConfig
from raven.demo.launch import LocalCluster, PoolSpec, Proc, free_port
from raven.demo.simexporter import SimExporter, SimNode
from raven.protocol import wire
from raven.transport.tls import server_context
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.fakegateway import serve_agent
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

OUTSIDE = "127.0.10.99"  # in no inventory


@dataclass
class FakeGateway:
    """The gateway side of one agent session, driven by the test."""

    frames: asyncio.Queue[wire.Frame] = field(default_factory=asyncio.Queue)
    ws: web.WebSocketResponse | None = None
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    next_id: int = 1

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)

        def welcomed() -> None:
            self.ws = ws
            self.connected.set()

        await serve_agent(ws, wire.Welcome(1, "evil-1", 1, 30.0, 120.0), self.frames.put, welcomed)
        return ws

    async def open(self, frame: wire.Open) -> int:
        assert self.ws is not None
        sid = self.next_id
        self.next_id += 2
        await self.ws.send_bytes(wire.encode(
            wire.Open(sid, frame.kind, frame.node, frame.port, frame.method, frame.target, frame.headers, True)))
        return sid

    async def outcome(self, sid: int, timeout: float = 10) -> tuple[str, int, str, bytes]:
        """('reset', code, reason, b'') or ('head', status, '', body) for stream ``sid``."""
        body = bytearray()
        status = 0
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.frames.get()
                if getattr(frame, "stream_id", None) != sid:
                    continue
                if isinstance(frame, wire.Reset):
                    return "reset", frame.code, frame.reason, b""
                if isinstance(frame, wire.Head):
                    status = frame.status
                    if frame.fin:
                        return "head", status, "", bytes(body)
                elif isinstance(frame, wire.Data):
                    body += frame.data
                    assert self.ws is not None
                    if len(frame.data):
                        await self.ws.send_bytes(wire.encode(wire.Window(sid, len(frame.data))))
                    if frame.fin:
                        return "head", status, "", bytes(body)
                elif isinstance(frame, wire.End):
                    return "head", status, "", bytes(body)


@dataclass
class Trap:
    """Listeners where no connection may ever arrive."""

    accepted: list[tuple[str, int]] = field(default_factory=list)
    servers: list[asyncio.Server] = field(default_factory=list)

    async def listen(self, host: str, port: int) -> None:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted.append((host, port))
            writer.close()

        self.servers.append(await asyncio.start_server(on_conn, host, port))


class ScriptedNode:
    """A node that answers by path: /echo (its request head back), /sNNN (odd status lines), /stall (never)."""

    ODD = {
        "/s100": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        "/s103": b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        "/s101": b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        "/s999": b"HTTP/1.1 999 Weird\r\nContent-Length: 0\r\n\r\n",
        "/s42": b"HTTP/1.1 42 X\r\n\r\n",
    }

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.open_stalls = 0
        self.max_stalls = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upgraded = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                path = head.split(b" ", 2)[1].decode()
                if path == "/stall":
                    self.open_stalls += 1
                    self.max_stalls = max(self.max_stalls, self.open_stalls)
                    try:
                        await reader.read()  # until the agent closes the connection
                    finally:
                        self.open_stalls -= 1
                    return
                if path in self.ODD:
                    writer.write(self.ODD[path])
                    await writer.drain()
                    if path not in ("/s101", "/s999"):
                        return
                    upgraded = True  # keep the connection: a client that reuses it gets "reused"
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nreused" if upgraded else
                             b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


DOWN = HOSTS[7]  # in the inventory, nothing listens there


@dataclass
class Evil:
    gateway: FakeGateway
    trap: Trap
    node_port: int
    other_port: int
    agent: Proc
    node: ScriptedNode

    @property
    def ws(self) -> web.WebSocketResponse | None:
        return self.gateway.ws


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def evil(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Evil]:
    port = pick_node_port([*HOSTS, OUTSIDE])
    other_port = pick_node_port([*HOSTS, OUTSIDE])
    node = SimNode("edge-e-1", HOSTS[5], port)
    exporter = SimExporter([node])
    await exporter.start()
    scripted = ScriptedNode()
    await scripted.start(HOSTS[6], port)
    trap = Trap()
    await trap.listen(OUTSIDE, port)  # another host, same port
    await trap.listen(OUTSIDE, other_port)  # another host, another port
    await trap.listen(HOSTS[5], other_port)  # the node itself, a port not allowed
    tunnel_port = free_port()
    inventory = [node, SimNode("edge-e-node", HOSTS[6], port), SimNode("edge-e-down", DOWN, port)]
    cluster = LocalCluster(tmp_path_factory.mktemp("agent-door"), [PoolSpec("pool-e", inventory, agents=1)],
                           allowed_ports=[port], gateway_url=f"wss://127.0.0.1:{tunnel_port}/tunnel")
    cluster.make_pki()
    certs = cluster.certs
    fake = FakeGateway()
    app = web.Application()
    app.router.add_get("/tunnel", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    ctx = server_context(TLSConfig(cert=certs / "raven-gateway.pem", key=certs / "raven-gateway-key.pem",
                                   ca=certs / "ca.pem"))
    await web.TCPSite(runner, "127.0.0.1", tunnel_port, ssl_context=ctx).start()
    agent: Proc | None = None
    try:
        agent = await cluster.start_agent(cluster.pools[0], cluster.agent_names(cluster.pools[0])[0], wait=False)
        async with asyncio.timeout(20):
            await fake.connected.wait()
        yield Evil(fake, trap, port, other_port, agent, scripted)
    finally:
        await cluster.close()
        await runner.cleanup()
        for server in [*trap.servers, scripted.server]:
            if server is not None:
                server.close()
        await exporter.close()


def http_open(node: str, port: int, target: str = "/metrics", method: str = "GET",
              headers: wire.Headers = ()) -> wire.Open:
    return wire.Open(0, wire.StreamKind.HTTP, node, port, method, target, headers, True)


async def refused_count(evil: Evil) -> float:
    return sum((await metric_values(evil.agent.metrics_port, "raven_agent_refused_streams_total")).values())


async def test_malicious_opens_are_reset_and_reach_nothing(evil: Evil) -> None:
    p, q = evil.node_port, evil.other_port
    attacks = [
        http_open("edge-e-1", p, f"@{OUTSIDE}:{p}/x"),
        http_open("edge-e-1", p, f"@{OUTSIDE}:{q}/x"),
        http_open("edge-e-1", p, f"//{OUTSIDE}:{p}/x"),
        http_open("edge-e-1", p, f"http://{OUTSIDE}:{p}/x"),
        http_open("edge-e-1", p, f":{q}/x"),
        http_open("edge-e-1", p, "/metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /"),
        http_open("edge-e-1", p, "/metrics\tx"),
        http_open("edge-e-1", p, "/a b"),
        http_open("edge-e-1", p, "/x#frag"),
        http_open("edge-e-1", p, "\\\\evil/x"),
        http_open("edge-e-1", p, "/" + "a" * 9000),
        http_open("edge-e-1", p, "/caf\u00e9"),
        http_open("edge-e-1", q),  # a port not allowed
        http_open("other-node", p),  # a node not in the inventory
        http_open(OUTSIDE, p),  # an address as a node name
        http_open("edge-e-1", p, method="POST"),
        http_open("edge-e-1", p, method="TRACE"),
        http_open("edge-e-1", p, method="DELETE"),
        wire.Open(0, wire.StreamKind.TCP, "edge-e-1", p),  # CONNECT not enabled on this agent
    ]
    before = await refused_count(evil)
    for attack in attacks:
        sid = await evil.gateway.open(attack)
        kind, code, reason, _ = await evil.gateway.outcome(sid)
        assert kind == "reset", (attack, kind, code)
        assert code in (wire.ResetCode.REFUSED, wire.ResetCode.PROTOCOL), (attack, code, reason)
        assert reason, attack
    # A well-formed OPEN still works, through the inventory address only.
    sid = await evil.gateway.open(http_open("edge-e-1", p, "/metrics?x=1"))
    kind, status, _, body = await evil.gateway.outcome(sid)
    assert (kind, status) == ("head", 200)
    assert b'Hostname="edge-e-1"' in body
    await asyncio.sleep(0.3)
    assert evil.trap.accepted == []
    assert await refused_count(evil) >= before + len(attacks) - 2  # a few die in the decoder (PROTOCOL) instead


async def test_raven_headers_and_framing_from_the_gateway_are_not_forwarded(evil: Evil) -> None:
    headers = (("X-Raven-Client", "abc"), ("X-Raven-Timeout-Ms", "5000"), ("X-Raven-Other", "1"),
               ("Transfer-Encoding", "chunked"), ("Content-Length", "5"), ("Accept", "text/plain"))
    sid = await evil.gateway.open(http_open("edge-e-node", evil.node_port, "/echo", headers=headers))
    kind, status, _, _ = await evil.gateway.outcome(sid)
    assert (kind, status) == ("head", 200)
    got = evil.node.heads[-1].lower()
    assert b"accept: text/plain" in got
    for name in (b"x-raven-", b"transfer-encoding", b"content-length"):
        assert name not in got, got


async def test_connect_failures_do_not_name_internal_addresses(evil: Evil) -> None:
    sid = await evil.gateway.open(http_open("edge-e-down", evil.node_port))
    kind, code, reason, _ = await evil.gateway.outcome(sid)
    assert (kind, code) == ("reset", wire.ResetCode.CONNECT_FAILED)
    assert "edge-e-down" in reason
    assert DOWN not in reason, reason


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        ("/s100", ("head", 200)),  # interim responses are skipped: the final one follows
        ("/s103", ("head", 200)),
        ("/s101", ("reset", wire.ResetCode.UPSTREAM_BROKEN)),
        ("/s999", ("reset", wire.ResetCode.UPSTREAM_BROKEN)),
        ("/s42", ("reset", wire.ResetCode.CONNECT_FAILED)),  # not even a status line: aiohttp refuses it
    ],
)
async def test_odd_statuses_from_a_node(evil: Evil, path: str, expect: tuple[str, int]) -> None:
    sid = await evil.gateway.open(http_open("edge-e-node", evil.node_port, path))
    kind, code, reason, body = await evil.gateway.outcome(sid)
    assert (kind, code) == expect, reason
    if kind == "head":
        assert body == b"ok"
    if path == "/s101":
        assert "101 Switching Protocols without an upgrade request" in reason
    if path in ("/s101", "/s999"):
        # The connection that carried it (the node keeps it open) never carries another request.
        for _ in range(3):
            sid = await evil.gateway.open(http_open("edge-e-node", evil.node_port, "/echo"))
            kind, code, _, body = await evil.gateway.outcome(sid)
            assert (kind, code, body) == ("head", 200, b"ok")


async def agent_streams(evil: Evil) -> float:
    return sum((await metric_values(evil.agent.metrics_port, "raven_agent_streams_in_flight")).values())


async def test_a_reset_from_the_gateway_aborts_the_upstream_requests_at_once(evil: Evil) -> None:
    """20 scrapes of a node that never answers; the gateway resets them after 1 s (its clients left):
    the agent's streams and its connections to the node return to zero at once."""
    sids = [await evil.gateway.open(http_open("edge-e-node", evil.node_port, "/stall")) for _ in range(20)]
    await eventually(lambda: evil.node.open_stalls == 8, timeout=5, what="8 upstream connections (the share)")
    await asyncio.sleep(1.0)
    assert evil.ws is not None
    loop = asyncio.get_running_loop()
    start = loop.time()
    for sid in sids:
        await evil.ws.send_bytes(wire.encode(wire.Reset(sid, wire.ResetCode.CANCEL, "client went away")))
    await eventually(lambda: evil.node.open_stalls == 0, timeout=5, interval=0.005, what="node connections closed")
    closed = loop.time() - start

    async def no_streams() -> bool:
        return await agent_streams(evil) == 0

    await eventually(no_streams, timeout=5, interval=0.01, what="agent streams at zero")
    released = loop.time() - start
    print(f"node connections closed {closed * 1000:.0f} ms, agent streams at zero {released * 1000:.0f} ms after "
          "the resets")
    assert closed < 0.5 and released < 0.5, (closed, released)


async def test_one_client_holds_at_most_its_share_of_a_node(evil: Evil) -> None:
    """A hostile client key fills its share (8 of 16) with requests that never finish; another client's
    request to the same node is served at once, and the hostile one never holds more than its share."""
    hostile = (("X-Raven-Client", "hostile"),)
    sids = [await evil.gateway.open(http_open("edge-e-node", evil.node_port, "/stall", headers=hostile))
            for _ in range(20)]
    try:
        await eventually(lambda: evil.node.open_stalls == 8, timeout=5, what="the hostile client's share")
        sid = await evil.gateway.open(http_open("edge-e-node", evil.node_port, "/echo",
                                                headers=(("X-Raven-Client", "good"),)))
        kind, status, _, _ = await evil.gateway.outcome(sid, timeout=5)
        assert (kind, status) == ("head", 200)
        await asyncio.sleep(0.3)
        assert evil.node.max_stalls == 8
    finally:
        assert evil.ws is not None
        for sid in sids:
            await evil.ws.send_bytes(wire.encode(wire.Reset(sid, wire.ResetCode.CANCEL, "done")))
        await eventually(lambda: evil.node.open_stalls == 0, timeout=5)


FORGED = "2026-11-25 00:00:00,000 ERROR   raven.agent: FORGED"


async def test_what_the_gateway_says_cannot_forge_or_flood_agent_log_lines(evil: Evil) -> None:
    """Reasons in DRAIN, REGISTERED and RESET frames carry newlines, NUL and terminal escapes: the agent's log
    shows them escaped on the line they belong to, and a flood of them grows the log by a few lines only.
    Runs last in this module: the DRAIN leaves the session draining."""
    ws = evil.ws
    assert ws is not None
    evil_text = f"x\n{FORGED}\r\x00\x1b[2J\x1b]0;title\x07\u2028"
    size_before = evil.agent.log.stat().st_size
    sid = await evil.gateway.open(http_open("edge-e-node", evil.node_port, "/stall"))
    await eventually(lambda: evil.node.open_stalls == 1, timeout=5, what="the stalled request")
    await ws.send_bytes(wire.encode(wire.Reset(sid, wire.ResetCode.CANCEL, evil_text)))
    for _ in range(500):
        await ws.send_bytes(wire.encode(wire.Registered((), (("edge-e-1", evil_text),))))
    for _ in range(500):
        await ws.send_bytes(wire.encode(wire.Drain(evil_text)))

    def logged() -> bool:
        text = evil.agent.log.read_text(errors="replace")
        return "is draining" in text and "refused node" in text and "ended by the gateway" in text

    await eventually(logged, timeout=10, what="the agent's lines about the gateway's frames")
    await asyncio.sleep(0.5)  # anything still queued reaches the log
    grown = evil.agent.log.read_bytes()[size_before:]
    text = grown.decode(errors="replace")
    assert FORGED not in [line[: len(FORGED)] for line in text.splitlines()], text[-3000:]
    for raw in ("\x00", "\x1b", "\x07", "\r", "\u2028"):
        assert raw not in text, repr(raw)
    assert "\\x1b[2J" in text and "\\n" + FORGED in text  # escaped, on the line it came with
    # 1,000 frames, a handful of lines (one per kind a minute, then "N more like it").
    assert len(grown) < 4096, f"{len(grown)} bytes logged:\n{text[-3000:]}"
    await eventually(lambda: evil.node.open_stalls == 0, timeout=5)
