"""What an agent chooses never writes into the operator's terminal, page or log, nor into an answer's header
(issue 29, items 2 and 4).

A hand-written agent with a valid certificate sends a HELLO session id and RESET reasons made of terminal escapes,
BEL, CR LF and a forged table row; `raven status` (the real CLI against the real gateway's ops API), its JSON,
the status page and the gateway's log show none of it raw. Agent certificates that the CA signed with a CR LF in
the agent name or a pool are refused at the handshake with a reason (counted and logged), so no such name reaches
an `X-Raven-Agent` header. A normal scrape succeeds throughout.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.statuspage import render_html
from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from raven.protocol import wire
from tests.support.agentpeer import Peer, sign_agent_as_given
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

# What a terminal must never be handed raw: C0 controls but the line end, DEL, C1, Unicode line ends and bidi.
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
FORGED_ROW = "ps-1     pool-p  tunnel  agent-pool-p-1  200   1s   FORGED"
# A RESET reason: clear the screen, set the terminal's title, ring the bell, then a row of the nodes table of
# the attacker's making, then a right-to-left override.
EVIL_REASON = f"node down\x1b[2J\x1b]0;pwned\x07\r\n{FORGED_ROW}\n\u202eevil"
# A session id whose first 8 characters (what `raven status` shows) are a line end, a colour and a bell.
EVIL_SESSION = "\n\x1b[31mX\x07" + "0" * 24
CRLF_AGENT = "evil\r\nX-Injected: yes"


@dataclass
class Bed:
    cluster: LocalCluster
    port: int

    @property
    def ops(self) -> str:
        return f"http://127.0.0.1:{self.cluster.gateway_metrics_port}"

    async def get(self, node: str) -> tuple[int, str, dict[str, str]]:
        url = f"http://127.0.0.1:{self.cluster.front_port}/metrics"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            async with http.get(url, headers={"Host": f"{node}:{self.port}"}) as resp:
                return resp.status, await resp.text(), dict(resp.headers)

    async def handshake_failures(self, reason: str) -> float:
        values = await metric_values(self.cluster.gateway_metrics_port, "raven_gateway_handshake_failures_total")
        return values.get((("reason", reason),), 0.0)

    def gateway_log(self) -> str:
        proc = self.cluster.gateway
        assert proc is not None
        return proc.log.read_text(errors="replace")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    port = pick_node_port(HOSTS)
    node = SimNode("ps-1", HOSTS[0], port)
    exporter = SimExporter([node])
    await exporter.start()
    # Three identities of pool-p: the first runs as a real agent, the others are the hand-written peers.
    cluster = LocalCluster(tmp_path_factory.mktemp("peer-strings"), [PoolSpec("pool-p", [node], agents=3)],
                           allowed_ports=[port], gateway_settings={"front": {"allow_connect": True}},
                           agent_settings={"allow_connect": True})
    try:
        cluster.make_pki()
        sign_agent_as_given(cluster.certs, "crlf-agent", CRLF_AGENT, ["pool-p"])
        sign_agent_as_given(cluster.certs, "crlf-pool", "agent-crlf-pool", ["pool-p\r\nX-Injected: yes"])
        await cluster.start_gateway()
        await cluster.start_agent(cluster.pools[0], "agent-pool-p-1")
        await cluster.wait_registered(30, agents_per_node=1)
        yield Bed(cluster, port)
    finally:
        await cluster.close()
        await exporter.close()


def _raven(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raven.cli", *args], capture_output=True, text=True, timeout=30)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON document, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


async def _serve_resets(peer: Peer, resets: int) -> None:
    """Answer the next ``resets`` OPENs with RESET(CONNECT_FAILED, EVIL_REASON)."""
    while resets:
        frame = await peer.control()
        if isinstance(frame, wire.Open):
            await peer.send(wire.encode(wire.Reset(frame.stream_id, wire.ResetCode.CONNECT_FAILED, EVIL_REASON)))
            resets -= 1


async def test_a_session_id_of_control_characters_is_refused_at_the_handshake(bed: Bed) -> None:
    """The session id is kept for the session's life and shown by `raven status`: one that is not a plain token
    ends the handshake with a GOAWAY that says why, counted as bad-hello."""
    before = await bed.handshake_failures("bad-hello")
    async with Peer(bed.cluster, "agent-pool-p-2") as peer:
        answer = await peer.connect(session=EVIL_SESSION)
        assert isinstance(answer, wire.GoAway), answer
        assert "field 'session'" in answer.reason and "[A-Za-z0-9_-]" in answer.reason, answer.reason

    async def counted() -> bool:
        return await bed.handshake_failures("bad-hello") >= before + 1

    await eventually(counted, timeout=10, what="the refused HELLO counted")
    status, _, _ = await bed.get("ps-1")
    assert status == 200


async def test_an_agents_strings_reach_no_terminal_page_or_log_raw(bed: Bed) -> None:
    """The peer tries a session id of escapes, then serves a node of its own and answers its scrapes with RESET
    reasons of escapes, BEL, CR LF and a forged row. What `raven status` prints has no control character and no
    row but the real ones; its JSON, the status page and the log hold none raw either."""
    async with Peer(bed.cluster, "agent-pool-p-2") as liar:
        await liar.connect(session=EVIL_SESSION)  # refused (the test above); without the check it would show
        async with Peer(bed.cluster, "agent-pool-p-3") as peer:
            welcome = await peer.connect()
            assert isinstance(welcome, wire.Welcome), welcome
            await peer.send(wire.encode(wire.Register((wire.NodeInfo("ps-evil", "10.1.0.1", "pool-p"),))))
            registered = await peer.control()
            assert isinstance(registered, wire.Registered) and registered.accepted == ("ps-evil",), registered
            server = asyncio.create_task(_serve_resets(peer, 1))
            status, body, headers = await bed.get("ps-evil")
            await asyncio.wait_for(server, 10)
            assert status == 502, body
            assert "\\x1b[2J" in body and not CONTROL.search(body), body  # the answer's body: escaped too
            assert not CONTROL.search(headers.get("X-Raven-Error", "")), headers

            table = await asyncio.to_thread(_raven, "status", "--gateway", bed.ops)
            as_json = await asyncio.to_thread(_raven, "status", "--gateway", bed.ops, "-o", "json")
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                async with http.get(bed.ops + "/status.html") as resp:
                    page = await resp.text()
    assert table.returncode == 0, table.stderr
    text = table.stdout
    assert not CONTROL.search(text), [line for line in text.splitlines() if CONTROL.search(line)]
    lines = text.splitlines()
    evil = next(line for line in lines if line.startswith("ps-evil"))
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\r\\n" + FORGED_ROW in evil and "\\u202eevil" in evil, evil
    # The forged row is only ever inside a real one (the node's row and its pool's latest error), escaped.
    forged = [line for line in lines if "FORGED" in line]
    assert evil in forged and all("\\r\\n" + FORGED_ROW in line for line in forged), forged
    assert sorted(line.split()[0] for line in lines if line.startswith("ps-")) == ["ps-1", "ps-evil"]
    sessions = [line.split()[5] for line in lines if line.startswith("pool-p")]
    assert all(re.fullmatch(r"[0-9a-f]{8}", s) for s in sessions), sessions  # the refused id is not there

    assert as_json.returncode == 0, as_json.stderr
    snap = json.loads(as_json.stdout)
    assert not [s for s in _strings(snap) if CONTROL.search(s) or "\n" in s or "\r" in s]
    assert any("\\x1b[2J" in s for s in _strings(snap))

    assert not CONTROL.search(page), [line for line in page.splitlines() if CONTROL.search(line)]
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\r\\n" in page and page.count("<td>ps-1</td>") == 1

    log = bed.gateway_log()
    assert not CONTROL.search(log), [line for line in log.splitlines() if CONTROL.search(line)]
    assert not [line for line in log.splitlines() if line.startswith(FORGED_ROW)]
    status, _, _ = await bed.get("ps-1")
    assert status == 200


@pytest.mark.parametrize(("cert", "source", "says"), [
    ("crlf-agent", "127.0.5.1", "the certificate's agent name 'evil\\r\\nX-Injected: yes' is not an RFC 1123 name"),
    ("crlf-pool", "127.0.5.2", "the certificate's pool 'pool-p\\r\\nX-Injected: yes' is not an RFC 1123 label"),
])
async def test_a_ca_signed_identity_with_cr_lf_is_refused_at_the_handshake(bed: Bed, cert: str, source: str,
                                                                             says: str) -> None:
    """The CA signed it, but the name breaks the rule node names follow: the upgrade request is answered 403 with
    the reason (counted as invalid-identity, logged escaped), no session starts, so no such name can reach an
    `X-Raven-Agent` header; the real agent's scrapes go on."""
    before = await bed.handshake_failures("invalid-identity")
    async with Peer(bed.cluster, cert, agent="agent-x", source=source) as peer:
        assert peer.http is not None
        async with peer.http.get(peer.url.replace("wss://", "https://"), ssl=peer.ctx) as resp:
            answer = await resp.text()
            assert resp.status == 403 and says in answer, (resp.status, answer)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await peer.connect()
        assert refused.value.status == 403
    assert await bed.handshake_failures("invalid-identity") == before + 2

    def logged() -> bool:
        return says in bed.gateway_log()

    await eventually(logged, timeout=10, what="the refusal logged")
    assert "\r\nX-Injected" not in bed.gateway_log()
    status, _, headers = await bed.get("ps-1")
    assert status == 200 and headers["X-Raven-Agent"] == "agent-pool-p-1"
    reader, writer = await asyncio.open_connection("127.0.0.1", bed.cluster.front_port)
    try:
        writer.write(f"CONNECT ps-1:{bed.port} HTTP/1.1\r\nHost: ps-1:{bed.port}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
    assert head == b"HTTP/1.1 200 Connection established\r\nX-Raven-Agent: agent-pool-p-1\r\n\r\n", head


def _hostile_snapshot() -> dict[str, Any]:
    """A status as a gateway that kept agents' strings raw (an older release) serves it: every string a peer
    chooses holds escapes, a bell, CR LF and a forged row."""
    agent = {"agent": f"a\x1b[2J{EVIL_REASON}", "session": EVIL_SESSION[:8], "age_seconds": 5.0, "streams": 0,
             "draining": False, "nodes": 1, "version": f"0.2.0\x07{EVIL_REASON}", "protocol": 3, "peer": "127.0.0.1"}
    return {
        "replica": "gw-1", "replicas": 1, "version": "0.2.0", "protocols": [1, 2, 3], "uptime_seconds": 60.0,
        "ready": True, "ready_reason": f"ok\r\n{FORGED_ROW}", "draining": False,
        "pools": [{"pool": f"pool-p\n{FORGED_ROW}", "reach": "tunnel", "reach_from": "default", "agents": [agent],
                   "nodes": 1, "reachable": 1}],
        "nodes": [{"name": "ps-1", "pool": "pool-p", "reach": "tunnel", "agents": [agent["agent"]],
                   "last": {"seconds_ago": 1.0, "code": "502", "reason": EVIL_REASON}}],
        "layer3": {"device": "raven0\x1b[2J", "pools": {"pool-p": {"active": agent["agent"], "routed": ["10.0.0.0/8"],
                                                                  "candidates": [agent["agent"]]}}},
    }


async def test_raven_status_escapes_whatever_a_gateway_sends() -> None:
    """`raven status` may read a gateway of an older release, which kept an agent's strings raw: the CLI's table
    escapes every cell itself, so the terminal gets no control character and no row but the real ones. The
    status page's renderer does the same for its HTML."""
    snap = _hostile_snapshot()
    app = web.Application()

    async def status(_: web.Request) -> web.Response:
        return web.json_response(snap)

    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        out = await asyncio.to_thread(_raven, "status", "--gateway", f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert not CONTROL.search(out.stdout), [line for line in lines if CONTROL.search(line)]
    assert not [line for line in lines if line.startswith(FORGED_ROW)]
    assert len([line for line in lines if "FORGED" in line]) == 4  # the header, the pool, node and layer-3 rows
    assert lines[0].startswith("gateway gw-1") and "\\r\\n" + FORGED_ROW in lines[0]
    page = render_html(snap)
    assert not CONTROL.search(page), [line for line in page.splitlines() if CONTROL.search(line)]
    assert "\\x1b[2J" in page and "raven0\\x1b[2J" in page
