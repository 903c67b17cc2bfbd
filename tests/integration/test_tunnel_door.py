"""The tunnel port against a peer that holds a valid agent certificate: caps per identity and in total,
churn limits, bounded logs, and frames at the exact size limit. A normal agent's scrape goes on beside."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

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

MAX_FRAME = 256 * 1024


@dataclass
class Port:
    cluster: LocalCluster
    port: int
    # An identity of pool-t with no running agent: the attacker's certificate.
    rogue: str = "agent-pool-t-2"

    async def scrape(self) -> None:
        url = f"http://127.0.0.1:{self.cluster.front_port}/metrics"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url, headers={"Host": f"tun-1:{self.port}"}) as resp:
                assert resp.status == 200, await resp.text()

    async def failures(self, reason: str) -> float:
        values = await metric_values(self.cluster.gateway_metrics_port, "raven_gateway_handshake_failures_total")
        return values.get((("reason", reason),), 0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tport(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Port]:
    port = pick_node_port(HOSTS)
    node = SimNode("tun-1", HOSTS[0], port)
    exporter = SimExporter([node])
    await exporter.start()
    cluster = LocalCluster(
        # Four agent identities of pool-t; only the first runs (the well-behaved agent), the others are for
        # the hand-written attacker.
        tmp_path_factory.mktemp("tunnel-door"), [PoolSpec("pool-t", [node], agents=4)], allowed_ports=[port],
        gateway_settings={"max_sessions_per_agent": 3, "max_nodes_per_agent": 5, "session_burst": 6,
                          "session_rate": 0.2, "register_burst": 3, "register_rate": 0.2,
                          "limits": {"max_frame": MAX_FRAME}},
    )
    try:
        cluster.make_pki()
        await cluster.start_gateway()
        await cluster.start_agent(cluster.pools[0], "agent-pool-t-1")  # the well-behaved agent
        await cluster.wait_registered(30, agents_per_node=1)
        yield Port(cluster, port)
    finally:
        await cluster.close()
        await exporter.close()


def register(names: list[str]) -> bytes:
    return wire.encode(wire.Register(tuple(wire.NodeInfo(n, "10.1.0.1", "pool-t") for n in names)))


async def test_the_tunnel_port_answers_only_its_path_and_get(tport: Port) -> None:
    """The tunnel port serves one path: another path is 404, another method 405, and a plain GET without the
    WebSocket upgrade is refused; none of them counts as a session."""
    async with Peer(tport.cluster, "agent-pool-t-2") as peer:
        assert peer.http is not None
        base = f"https://127.0.0.1:{tport.cluster.tunnel_port}"
        async with peer.http.get(base + "/not-the-tunnel", ssl=peer.ctx) as resp:
            assert resp.status == 404
        async with peer.http.post(base + "/tunnel", ssl=peer.ctx, data=b"x") as resp:
            assert resp.status == 405
        async with peer.http.get(base + "/tunnel", ssl=peer.ctx) as resp:
            assert resp.status == 400  # no upgrade: no session


async def test_sessions_per_agent_identity_are_capped(tport: Port) -> None:
    before = await tport.failures("agent-session-cap")
    peers = [Peer(tport.cluster, tport.rogue) for _ in range(4)]
    async with contextlib.AsyncExitStack() as stack:
        answers = []
        for peer in peers:
            await stack.enter_async_context(peer)
            answers.append(await peer.connect())
        assert [type(a).__name__ for a in answers] == ["Welcome", "Welcome", "Welcome", "GoAway"]
        goaway = answers[3]
        assert isinstance(goaway, wire.GoAway)
        assert f"agent {tport.rogue} already holds 3 sessions" in goaway.reason
        await tport.scrape()
    assert await tport.failures("agent-session-cap") >= before + 1


async def test_registered_names_are_capped_per_identity_across_sessions(tport: Port) -> None:
    async with Peer(tport.cluster, tport.rogue) as one, Peer(tport.cluster, tport.rogue) as two:
        assert isinstance(await one.connect(), wire.Welcome)
        assert isinstance(await two.connect(), wire.Welcome)
        await one.send(register([f"rogue-a-{i}" for i in range(4)]))
        first = await one.control()
        assert isinstance(first, wire.Registered) and len(first.accepted) == 4
        await two.send(register([f"rogue-b-{i}" for i in range(4)]))
        second = await two.control()
        assert isinstance(second, wire.Registered)
        assert len(second.accepted) == 1 and len(second.refused) == 3
        assert "may register at most 5 nodes" in second.refused[0][1]
        await tport.scrape()


async def test_registration_churn_is_rate_limited_and_the_newest_list_wins(tport: Port) -> None:
    async with Peer(tport.cluster, tport.rogue) as peer:
        assert isinstance(await peer.connect(), wire.Welcome)
        for i in range(8):  # burst 3, then 0.2/s: the others wait, and only the newest of them is applied
            await peer.send(register([f"churn-{i}"]))
        answers: list[wire.Registered] = []
        async with asyncio.timeout(30):  # at 0.2/s the held one waits up to 5 s
            while not answers or answers[-1].accepted != ("churn-7",):
                frame = await peer.control(timeout=15)
                if isinstance(frame, wire.Registered):
                    answers.append(frame)
        # The first ones as the burst allows (earlier tests spent part of it), then only the newest.
        assert 2 <= len(answers) <= 4, answers
        assert [a.accepted for a in answers[:-1]] == [(f"churn-{i}",) for i in range(len(answers) - 1)]
        await tport.scrape()
        with pytest.raises(TimeoutError):  # nothing more comes: the lists in between were replaced
            async with asyncio.timeout(6):
                frame = await peer.control(timeout=6)
                while not isinstance(frame, wire.Registered):
                    frame = await peer.control(timeout=6)
    assert await tport.failures("register-rate") >= 4


async def test_session_churn_is_rate_limited(tport: Port) -> None:
    await asyncio.sleep(0.1)
    refused = 0
    for _ in range(10):
        async with Peer(tport.cluster, tport.rogue) as peer:
            answer = await peer.connect()
            if isinstance(answer, wire.GoAway) and "opens sessions too often" in answer.reason:
                refused += 1
    assert refused >= 1
    await tport.scrape()


async def test_frames_for_unknown_streams_cannot_grow_the_log(tport: Port) -> None:
    gateway = tport.cluster.gateway
    assert gateway is not None
    log_before = gateway.log.read_text().count("unknown stream")
    # A fresh identity: the earlier tests spent this one's session budget.
    async with Peer(tport.cluster, "agent-pool-t-4") as peer:
        answer = await peer.connect()
        assert isinstance(answer, wire.Welcome), answer
        for i in range(5000):
            await peer.send(wire.encode_data(2 * i + 1, b"x"))
            await peer.send(wire.encode(wire.Window(2 * i + 1, 10)))
        await tport.scrape()
    lines = gateway.log.read_text().count("unknown stream") - log_before
    assert 1 <= lines <= 3, lines
    await tport.scrape()


async def test_a_frame_of_exactly_max_frame_is_accepted_and_one_byte_more_is_not(tport: Port) -> None:
    names = [f"big-{i}" for i in range(3)]
    frame = register(names)
    body = frame[:-1] + b" " * (MAX_FRAME - len(frame)) + frame[-1:]  # JSON allows the padding
    assert len(body) == MAX_FRAME
    async with Peer(tport.cluster, "agent-pool-t-3") as peer:
        assert isinstance(await peer.connect(), wire.Welcome)
        await peer.send(body)
        answer = await peer.control()
        assert isinstance(answer, wire.Registered) and sorted(answer.accepted) == names
        await peer.send(body[:-1] + b" }")  # one byte more
        with pytest.raises(ConnectionError):
            while True:
                await peer.control(timeout=5)
    await tport.scrape()


async def test_a_real_agent_copes_with_an_answer_in_several_frames(tport: Port) -> None:
    """A real agent process listing 3000 nodes, 2995 over max_nodes_per_agent: the answer comes as several
    REGISTERED frames, and the agent keeps its one session."""
    cluster = tport.cluster
    many = [SimNode(f"many-{i:04d}-{'m' * 50}", HOSTS[1], tport.port) for i in range(3000)]
    proc = await cluster.start_agent(PoolSpec("pool-t", many, agents=1), "agent-pool-t-4")
    try:
        async def answered() -> bool:  # ~2995 refusals of ~130 bytes: several frames of at most 128 KiB
            return await metric_values(proc.metrics_port, "raven_agent_nodes_refused") == {(): 2995.0}

        await eventually(answered, 20, "every part of the answer taken by the agent")
        await asyncio.sleep(2)  # several heartbeats: a session ended by a bad frame would show by now
        text = proc.log.read_text(errors="replace")
        assert "accepted 5 node(s)" in text and "session to gateway" not in text
        assert await metric_values(proc.metrics_port, "raven_agent_sessions") == {(): 1.0}
        await tport.scrape()
    finally:
        await cluster.stop(proc)
        cluster.agents.pop("agent-pool-t-4", None)


async def test_a_large_registration_is_answered_in_frames_any_agent_accepts(tport: Port) -> None:
    """A REGISTERED answer never exceeds what an agent accepts: it is split into frames of 128 KiB at most."""
    answer_frames = wire.split_registered([f"{'n' * 60}-{i:05d}" for i in range(5000)],
                                          [(f"r-{i}", "x" * 1000) for i in range(500)])
    sizes = [len(wire.encode(f)) for f in answer_frames]
    assert len(answer_frames) > 2 and max(sizes) <= 128 * 1024 < MAX_FRAME
    assert sum(len(f.accepted) for f in answer_frames) == 5000
    assert sum(len(f.refused) for f in answer_frames) == 500
    assert all(len(reason) <= wire.MAX_REFUSAL_REASON for f in answer_frames for _, reason in f.refused)
    # A huge refused name (a peer's) comes back cut: no answer frame grows with it.
    huge = wire.split_registered([], [("x" * (1 << 20), "not a valid RFC 1123 node name")])
    assert len(huge) == 1 and len(huge[0].refused[0][0]) == 253 and len(wire.encode(huge[0])) < 1024
