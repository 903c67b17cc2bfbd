"""Several gateway replicas: every replica reaches every node, failover and restarts lose no scrape."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import pick_node_port
from tests.support.dnsmasq import Dnsmasq
from tests.support.tcplb import TcpBalancer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

REPLICAS = ["127.0.30.1", "127.0.30.2"]
NODE_HOSTS = ["127.0.31.2", "127.0.31.3", "127.0.31.4"]


class HA:
    def __init__(self, cluster: LocalCluster, exporter: SimExporter, port: int) -> None:
        self.cluster = cluster
        self.exporter = exporter
        self.port = port
        self.nodes = [n.name for p in cluster.pools for n in p.nodes]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ha(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[HA]:
    workdir = tmp_path_factory.mktemp("raven-ha")
    hosts = workdir / "gateway.hosts"
    hosts.write_text("".join(f"{addr} raven-gateway\n" for addr in REPLICAS))
    dns = Dnsmasq(hosts)
    port = pick_node_port(NODE_HOSTS)
    nodes = [SimNode(f"ha-{i}", host, port) for i, host in enumerate(NODE_HOSTS, 1)]
    exporter = SimExporter(nodes)
    cluster = LocalCluster(
        workdir, [PoolSpec("pool-h", nodes, agents=2)], allowed_ports=[port], gateway_hosts=REPLICAS,
        gateway_settings={"limits": {"heartbeat_interval": 0.5, "heartbeat_timeout": 2.5}, "drain_linger": 1.0},
    )
    cluster.gateway_url = f"wss://raven-gateway:{cluster.tunnel_port}/tunnel"
    try:
        await dns.start()
        cluster.agent_settings = {"gateway": {"resolver": dns.server, "resolve_interval": 2}}
        await exporter.start()
        await cluster.start()
        yield HA(cluster, exporter, port)
    finally:
        await cluster.close()
        await exporter.close()
        await dns.close()


async def scrape(http: aiohttp.ClientSession, front: str, node: str, port: int) -> tuple[int, str]:
    try:
        async with http.get(f"http://{node}:{port}/metrics", proxy=front) as resp:
            body = await resp.read()
            ok = resp.status == 200 and f'Hostname="{node}"'.encode() in body
            return (200 if ok else resp.status or 599), resp.headers.get("X-Raven-Agent", "")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, repr(exc)


async def gauge(host: str, port: int, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def test_every_replica_serves_every_node(ha: HA) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for replica in range(len(REPLICAS)):
            for node in ha.nodes:
                status, detail = await scrape(http, ha.cluster.front_url_of(replica), node, ha.port)
                assert status == 200, (replica, node, detail)
    # One session per replica per agent, never two to one replica.
    for proc in ha.cluster.agents.values():
        assert await gauge(proc.host, proc.metrics_port, "raven_agent_sessions") == len(REPLICAS)
    for host in REPLICAS:
        assert await gauge(host, ha.cluster.gateway_metrics_port, "raven_gateway_sessions") == 2


class Scraper:
    """Scrapes every node continuously through whichever replicas are ready (as a Service would route)."""

    def __init__(self, ha: HA) -> None:
        self.ha = ha
        self.results: list[tuple[int, str, str]] = []
        self.ready: set[int] = set()
        self.not_ready: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _watch(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
            while not self._stop.is_set():
                for i, host in enumerate(REPLICAS):
                    try:
                        async with http.get(f"http://{host}:{self.ha.cluster.gateway_metrics_port}/readyz") as r:
                            ok = r.status == 200
                            if not ok:
                                self.not_ready.append(f"gw-{i + 1}: {(await r.text()).strip()}")
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        ok = False
                        self.not_ready.append(f"gw-{i + 1}: {exc!r}")
                    (self.ready.add if ok else self.ready.discard)(i)
                await asyncio.sleep(0.1)

    async def _scrape(self) -> None:
        turn = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            while not self._stop.is_set():
                ready = sorted(self.ready)
                if not ready:
                    self.results.append((0, "none ready", ""))
                    await asyncio.sleep(0.05)
                    continue
                replica = ready[turn % len(ready)]
                node = self.ha.nodes[turn % len(self.ha.nodes)]
                turn += 1
                status, detail = await scrape(http, self.ha.cluster.front_url_of(replica), node, self.ha.port)
                self.results.append((status, f"gw-{replica + 1} {node}", detail))
                await asyncio.sleep(0.02)

    async def __aenter__(self) -> Scraper:
        self._tasks = [asyncio.create_task(self._watch())]
        async with asyncio.timeout(15):  # both replicas ready, as a Service would see them
            while len(self.ready) < len(REPLICAS):  # noqa: ASYNC110 (filled by the watcher task)
                await asyncio.sleep(0.05)
        self._tasks.append(asyncio.create_task(self._scrape()))
        await asyncio.sleep(0.3)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def failures(self) -> list[tuple[int, str, str]]:
        bad = [r for r in self.results if r[0] != 200]
        if bad:
            print("readiness seen:", self.not_ready[:10])
        return bad


async def test_agent_loss_loses_no_scrape(ha: HA) -> None:
    victim = ha.cluster.agents["agent-pool-h-1"]
    async with Scraper(ha) as scraper:
        await ha.cluster.stop(victim, signal.SIGKILL)
        await asyncio.sleep(2)
    assert len(scraper.results) > 20
    assert scraper.failures() == []
    await ha.cluster.start_agent(ha.cluster.pools[0], "agent-pool-h-1")
    await ha.cluster.wait_registered(30)


async def test_rolling_restart_of_every_replica_loses_no_scrape(ha: HA) -> None:
    async with Scraper(ha) as scraper:
        for replica in range(len(REPLICAS)):
            proc = ha.cluster.gateways[replica]
            assert proc is not None
            assert await ha.cluster.stop(proc, signal.SIGTERM, grace=15) == 0
            new = await ha.cluster.start_gateway(replica)
            # Agents come back to the restarted replica by themselves; as a rollout does, the next replica
            # stops only once this one is ready (its agents' reconnect bound, ready_max_wait, has passed).
            await ha.cluster.wait_registered(30, replicas=[replica])
            await ha.cluster.wait_ready(new)
            await asyncio.sleep(0.5)
    assert len(scraper.results) > 20
    assert scraper.failures() == []
    assert {r[1].split()[0] for r in scraper.results} == {"gw-1", "gw-2"}


async def test_scrape_in_flight_finishes_while_its_replica_drains(ha: HA) -> None:
    node = ha.nodes[0]
    ha.exporter.set_mode(node, "slow")
    try:
        proc = ha.cluster.gateways[0]
        assert proc is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(f"http://{node}:{ha.port}/metrics", proxy=ha.cluster.front_url_of(0)) as resp:
                assert resp.status == 200
                proc.process.send_signal(signal.SIGTERM)
                body = await resp.read()
        assert f'Hostname="{node}"'.encode() in body
        assert await asyncio.wait_for(proc.process.wait(), 20) == 0
    finally:
        ha.exporter.set_mode(node, "ok")
        await ha.cluster.start_gateway(0)
        await ha.cluster.wait_registered(30)


async def test_single_balanced_address_reaches_every_replica(ha: HA) -> None:
    """Behind one load-balanced address the agent dials until it holds every replica the WELCOME names."""
    lb_port = free_port("127.0.30.9")
    lb = TcpBalancer(("127.0.30.9", lb_port), [(h, ha.cluster.tunnel_port) for h in REPLICAS])
    await lb.start()
    cluster = ha.cluster
    pool = PoolSpec("pool-h", cluster.pools[0].nodes, agents=1)
    name = "agent-pool-h-lb"
    from raven import pki

    pki.issue(cluster.certs, cluster.certs, "agent", name, pools=["pool-h"], days=1)
    saved = (cluster.gateway_url, cluster.agent_settings)
    cluster.gateway_url = f"wss://127.0.30.9:{lb_port}/tunnel"
    cluster.agent_settings = {}
    try:
        proc = await cluster.start_agent(pool, name)

        async def both() -> bool:
            return await gauge(proc.host, proc.metrics_port, "raven_agent_sessions") == len(REPLICAS)

        for _ in range(150):
            if await both():
                break
            await asyncio.sleep(0.1)
        assert await both()
        await asyncio.sleep(1.0)  # it must stay at one session per replica, not keep adding
        assert await gauge(proc.host, proc.metrics_port, "raven_agent_sessions") == len(REPLICAS)
        for host in REPLICAS:
            assert await gauge(host, cluster.gateway_metrics_port, "raven_gateway_sessions") == 3
        await cluster.stop(proc)
        del cluster.agents[name]
    finally:
        cluster.gateway_url, cluster.agent_settings = saved
        await lb.close()


async def test_a_draining_replica_sends_keep_alive_clients_elsewhere(ha: HA) -> None:
    """SIGTERM: the idle keep-alive connection is closed, a request in the drain window is served on a new
    connection with "Connection: close", and after drain_linger the replica takes no new connection."""
    node, proc = ha.nodes[0], ha.cluster.gateways[0]
    assert proc is not None
    url, front = f"http://{node}:{ha.port}/metrics", ha.cluster.front_url_of(0)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                         timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url, proxy=front) as resp:
                assert resp.status == 200 and resp.headers.get("Connection", "").lower() != "close"
                await resp.read()
            proc.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)  # drain_linger is 1 s here
            async with http.get(url, proxy=front) as resp:
                body = await resp.read()
                assert resp.status == 200 and f'Hostname="{node}"'.encode() in body
                assert resp.headers.get("Connection", "").lower() == "close"
            await asyncio.sleep(1.5)  # past drain_linger: new connections are refused
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(url, proxy=front) as resp:
                    await resp.read()
        assert await asyncio.wait_for(proc.process.wait(), 20) == 0
    finally:
        await ha.cluster.start_gateway(0)
        await ha.cluster.wait_registered(30)
