"""Attacks from an agent with a valid certificate of one pool on nodes that belong to another, and names the name
rule refuses asked for while the replica settles: a real gateway and a real agent (processes, TLS, loopback), the
attacker a hand-written agent (tests/support/agentpeer.py).

Pools: ``pool-s`` (tunnel; edge-s-1 served by agent-pool-s-1; agent-pool-s-2's certificate is the attacker's),
``pool-d`` (direct: direct-1 with an address, direct-2 without) and ``pool-l`` (layer3: l3-node-1), both listed in
the gateway's configuration. Without Kubernetes the replica settles only after ``ready_max_wait``, set here to
outlast the module: every request below is made while it is "starting".
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator, Mapping
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

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

HOSTILE = "evil\x1b[2J"
PLACED = {"direct-1": "pool-d", "direct-2": "pool-d", "l3-node-1": "pool-l"}


@dataclass
class Bed:
    cluster: LocalCluster
    port: int

    async def get(self, node: str) -> tuple[int, str, Mapping[str, str]]:
        """A scrape in proxy mode (the way Prometheus sends it through Raven)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(f"http://{node}:{self.port}/metrics", proxy=self.cluster.front_url) as resp:
                return resp.status, await resp.text(), resp.headers

    async def ops(self, path: str) -> str:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(self.cluster.sd_url.removesuffix("/sd") + path) as resp:
                assert resp.status == 200, path
                return await resp.text()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    port = pick_node_port(HOSTS)
    node = SimNode("edge-s-1", HOSTS[0], port)
    exporter = SimExporter([node])
    await exporter.start()
    cluster = LocalCluster(
        tmp_path_factory.mktemp("pool-claims"), [PoolSpec("pool-s", [node], agents=2)], allowed_ports=[port],
        gateway_settings={
            "ready_max_wait": 600,
            "hosts": {"service_addresses": ["192.0.2.10"]},
            "pools": {"pool-d": {"reach": "direct", "nodes": [{"name": "direct-1", "address": "127.0.10.9"},
                                                              {"name": "direct-2"}]},
                      "pool-l": {"reach": "layer3", "nodes": [{"name": "l3-node-1", "address": "127.0.10.10"}]}},
        },
    )
    try:
        cluster.make_pki()
        await cluster.start_gateway()
        await cluster.start_agent(cluster.pools[0], "agent-pool-s-1")  # the well-behaved agent; -2 is the attacker
        await cluster.wait_registered(30, agents_per_node=1)
        yield Bed(cluster, port)
    finally:
        await cluster.close()
        await exporter.close()


async def test_an_agent_of_another_pool_cannot_take_over_configured_nodes(bed: Bed) -> None:
    """Issue 29 item 1: agent-pool-s-2 (certificate for tunnel pool pool-s) registers the direct and layer-3
    nodes the configuration lists. Each is refused with its reason, logged, counted and shown; the front end never
    sends their scrapes to the attacker; /sd lists each once, as direct or layer3; the hosts file does not map
    them to the gateway; pool-s's own node is scraped as before."""
    before = await metric_values(bed.cluster.gateway_metrics_port, "raven_gateway_registration_refusals_total")
    async with Peer(bed.cluster, "agent-pool-s-2") as peer:
        assert isinstance(await peer.connect(), wire.Welcome)
        claims = [wire.NodeInfo(name, "10.66.0.1", "pool-s") for name in PLACED]
        # And a name that would drive a terminal: refused as always, shown escaped.
        await peer.send(wire.encode(wire.Register((*claims, wire.NodeInfo("rogue-s-1", "10.66.0.2", "pool-s"),
                                                   wire.NodeInfo(HOSTILE, "10.66.0.2", "pool-s")))))
        answer = await peer.control()
        assert isinstance(answer, wire.Registered)
        assert answer.accepted == ("rogue-s-1",)
        refused = dict(answer.refused)
        assert "RFC 1123" in refused.pop(HOSTILE)
        assert refused == {
            name: f"the gateway's configuration lists it under pool {pool!r} (pools.{pool}.nodes), not 'pool-s'"
            for name, pool in PLACED.items()}

        for name, pool in PLACED.items():
            status, body, _ = await bed.get(name)
            assert status == 421, (name, status, body)
            assert f"node {name!r} of pool {pool!r} is reached" in body
        with pytest.raises(TimeoutError):  # no OPEN reached the attacker
            frame = await peer.control(timeout=1.5)
            pytest.fail(f"the attacker was sent {frame!r}")

        groups = await bed.cluster.sd()
        listed = [(g["labels"]["node"], g["labels"]["__meta_raven_reach"]) for g in groups]
        assert sorted(listed) == [("direct-1", "direct"), ("direct-2", "direct"), ("edge-s-1", "tunnel"),
                                  ("l3-node-1", "layer3"), ("rogue-s-1", "tunnel")]
        hosts = await bed.ops("/hosts")
        assert "192.0.2.10\tedge-s-1\n" in hosts
        assert not [name for name in PLACED if name in hosts], hosts

        after = await metric_values(bed.cluster.gateway_metrics_port, "raven_gateway_registration_refusals_total")
        key = (("pool", "pool-s"), ("reason", "config-pool"))
        assert after.get(key, 0.0) - before.get(key, 0.0) == 3

        snap = await bed.ops("/status")
        page = await bed.ops("/status.html")
        agents = {a["agent"]: a for p in json.loads(snap)["pools"] for a in p["agents"]}
        rogue = agents["agent-pool-s-2"]
        assert rogue["refused"] == 4
        assert {n["node"]: n["reason"] for n in rogue["refused_nodes"]} == {
            **dict.fromkeys(PLACED, "config-pool"), "evil\\x1b[2J": "invalid-name"}
        assert agents["agent-pool-s-1"]["refused"] == 0
        assert "4 node(s) refused, e.g. direct-1: the gateway&#x27;s configuration lists it under pool" in page
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "raven.cli", "status", "--gateway", bed.cluster.sd_url.removesuffix("/sd"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        text = out.decode()
        assert proc.returncode == 0, text
        assert "agent agent-pool-s-2 (session " in text and "): 4 node(s) refused\n" in text
        assert "  l3-node-1: the gateway's configuration lists it under pool 'pool-l'" in text
        assert "\x1b" not in text and "  evil\\x1b[2J: not a valid RFC 1123 node name" in text

        status, body, _ = await bed.get("edge-s-1")
        assert status == 200 and "DCGM_FI_DEV_GPU_UTIL" in body, (status, body[:200])
    gateway = bed.cluster.gateway
    assert gateway is not None
    assert ("refused registration of node 'direct-1' (pool 'pool-s') from agent agent-pool-s-2: the gateway's "
            "configuration lists it under pool 'pool-d'") in gateway.log.read_text()


async def test_a_reload_that_lists_a_node_under_its_pool_takes_it_from_another_pool(bed: Bed) -> None:
    """A node claimed by pool-s's agent, then listed under pool-d in the gateway's configuration: the reload
    (SIGHUP) evaluates the registration again; the agent is told the refusal, it is counted, and the front end
    answers the node as pool-d's."""
    gateway = bed.cluster.gateway
    assert gateway is not None
    async with Peer(bed.cluster, "agent-pool-s-2") as peer:
        assert isinstance(await peer.connect(), wire.Welcome)
        await peer.send(wire.encode(wire.Register((wire.NodeInfo("later-1", "10.66.0.3", "pool-s"),))))
        answer = await peer.control()
        assert isinstance(answer, wire.Registered) and answer.accepted == ("later-1",)
        before = await metric_values(bed.cluster.gateway_metrics_port, "raven_gateway_registration_refusals_total")
        bed.cluster.gateway_settings["pools"]["pool-d"]["nodes"].append({"name": "later-1"})
        bed.cluster.gateway_config()  # the same file, rewritten
        gateway.process.send_signal(signal.SIGHUP)
        async with asyncio.timeout(15):  # PINGs come meanwhile: control() alone would wait for ever
            answer = await peer.control()
        assert isinstance(answer, wire.Registered) and answer.accepted == ()
        assert answer.refused == (("later-1", "the gateway's configuration lists it under pool 'pool-d' "
                                   "(pools.pool-d.nodes), not 'pool-s'"),)
        after = await metric_values(bed.cluster.gateway_metrics_port, "raven_gateway_registration_refusals_total")
        key = (("pool", "pool-s"), ("reason", "config-pool"))
        assert after.get(key, 0.0) - before.get(key, 0.0) == 1
        status, body, _ = await bed.get("later-1")
        assert status == 421 and "of pool 'pool-d'" in body, (status, body)
        assert (await bed.get("edge-s-1"))[0] == 200


@pytest.mark.parametrize("name", [
    "localhost", "kubernetes.default.svc", "kubernetes", "metadata.google.internal", "169.254.169.254",
    "10.0.0.1", "2130706433", "0x7f000001", "gpu-1.cluster.local", "edge.svc", "printer.local",
])
async def test_a_settling_replica_answers_names_the_rule_refuses_for_ever_at_once(bed: Bed, name: str) -> None:
    """Issue 29 item 6: while the replica settles, a name the name rule refuses for ever gets its final answer
    (404, with the rule's reason), not "this replica is starting, retry"."""
    status, body, headers = await bed.get(name)
    assert status == 404, (name, status, body)
    assert f"node {name!r} is never served by this gateway" in body
    assert "Retry-After" not in headers


async def test_a_settling_replica_still_asks_to_retry_for_a_name_it_may_yet_learn(bed: Bed) -> None:
    """The settling answer stands for a valid name that an agent may still register (and the IP literal that
    is no node name at all is a bad request, as always); a registered node is scraped meanwhile."""
    # A punycode name (what a client sends for a non-ASCII host) is a valid node name Kubernetes allows, so an
    # agent may yet register it: it waits like any other.
    for name in ("edge-s-9", "xn--bcher-kva"):
        status, body, headers = await bed.get(name)
        assert status == 503 and headers.get("Retry-After") == "2", (status, body)
        assert "this gateway replica is starting" in body
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        url = f"http://127.0.0.1:{bed.cluster.front_port}/metrics"
        for host in ("[::1]", "[fe80::1]"):
            async with http.get(url, headers={"Host": f"{host}:{bed.port}"}) as resp:
                assert resp.status == 400, (host, await resp.text())
    assert (await bed.get("edge-s-1"))[0] == 200
