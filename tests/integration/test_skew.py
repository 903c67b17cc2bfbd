"""Version skew (docs/skew.md): this release against the previous one, both ways, as real processes.

The previous release is built from git history into its own virtualenv (tests/support/release.py, cached per
commit). Old agent and new gateway, new agent and old gateway: a scrape of a simulated node passes through with
mutual TLS on loopback. An agent that cannot be served is refused with its reason in the agent's log (or its
answer) and in the gateway's log and metric: an agent below the gateway's tunnel.min_agent_version, and an
agent offering only a protocol version no gateway speaks (against either release's gateway).
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from raven import version
from raven.config import TLSConfig
from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from raven.protocol import wire
from raven.transport.tls import client_context
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.metrics import metric_values
from tests.support.polling import eventually
from tests.support.procs import run_to_end
from tests.support.release import BUILD_TIMEOUT, Release, previous_release

# The first test may build the previous release (about 75 s here with PyPI downloads; nothing when cached).
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration,
              pytest.mark.timeout(BUILD_TIMEOUT + 180)]

OLD_POOL, NEW_POOL = "pool-old", "pool-new"
OLD_AGENT, NEW_AGENT = f"agent-{OLD_POOL}-1", f"agent-{NEW_POOL}-1"
UNSPOKEN = 99  # a protocol version neither release speaks
OLD_PROTOCOL = 2  # the newest protocol version 0.1.0 speaks: the terms of a request as x-raven-* headers


@pytest.fixture(scope="module")
def old() -> Release:
    release = previous_release()
    assert release.version != version.RELEASE, "the previous release must differ from this one"
    return release


@dataclass
class Skew:
    cluster: LocalCluster
    port: int  # the simulated nodes' exporter port

    async def scrape(self, node: str) -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            url = f"{self.cluster.front_url}/metrics"
            async with http.get(url, headers={"Host": f"{node}:{self.port}"}) as resp:
                return resp.status, await resp.read()

    async def ops(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.cluster.gateway_metrics_port}{path}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http, http.get(url) as resp:
            assert resp.status == 200, path
            return await (resp.json() if path == "/status" else resp.text())

    def log(self, name: str) -> str:
        return (self.cluster.workdir / f"{name}.log").read_text(errors="replace")

    async def wait_log(self, name: str, text: str, timeout: float = 20) -> None:
        await eventually(lambda: text in self.log(name), timeout, f"{name}'s log to say {text!r}")

    def metrics_port(self, name: str) -> int:
        return self.cluster.gateway_metrics_port if name == "gateway" else self.cluster.agents[name].metrics_port


@contextlib.asynccontextmanager
async def skew_bed(workdir: Path, old: Release, old_processes: set[str],
                   gateway_settings: dict[str, Any] | None = None, wait_for: tuple[str, ...] = (OLD_AGENT, NEW_AGENT),
                   ) -> AsyncIterator[Skew]:
    """A gateway and one agent per pool (pool-old's and pool-new's) in ``workdir`` (which exists), each of the
    release ``old_processes`` says; the agents in ``wait_for`` are waited for until their nodes scrape."""
    port = pick_node_port(HOSTS)
    old_node, new_node = SimNode("edge-old-1", HOSTS[0], port), SimNode("edge-new-1", HOSTS[1], port)
    exporter = SimExporter([old_node, new_node])
    pools = [PoolSpec(OLD_POOL, [old_node], agents=1), PoolSpec(NEW_POOL, [new_node], agents=1)]
    cluster = LocalCluster(workdir, pools, allowed_ports=[port], gateway_settings=gateway_settings or {},
                           commands={name: old.command for name in old_processes})
    bed = Skew(cluster, port)
    try:
        await exporter.start()
        cluster.make_pki()
        await cluster.start_gateway()
        for pool in cluster.pools:
            for name in cluster.agent_names(pool):
                await cluster.start_agent(pool, name, wait=name in wait_for)
        for name, node in ((OLD_AGENT, old_node), (NEW_AGENT, new_node)):
            if name in wait_for:
                async def scraped(node: str = node.name) -> bool:
                    return (await bed.scrape(node))[0] == 200
                await eventually(scraped, 30, f"{node.name} to scrape through {name}",
                                 tolerate=(aiohttp.ClientError, TimeoutError))
        yield bed
    finally:
        await cluster.close()
        await exporter.close()


async def refuse_unspoken_protocol(bed: Skew) -> str:
    """A hand-written agent (a valid certificate of pool-new) offers only protocol 99: the gateway's answer."""
    certs = bed.cluster.certs
    ctx = client_context(TLSConfig(cert=certs / f"{NEW_AGENT}.pem", key=certs / f"{NEW_AGENT}-key.pem",
                                   ca=certs / "ca.pem"))
    ctx.check_hostname = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.ws_connect(f"wss://127.0.0.1:{bed.cluster.tunnel_port}/tunnel", ssl=ctx) as ws:
            await ws.send_bytes(wire.encode(wire.Hello(NEW_AGENT, uuid.uuid4().hex, versions=(UNSPOKEN,))))
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.BINARY, msg
            answer = wire.decode(msg.data)
    assert isinstance(answer, wire.GoAway), answer
    return answer.reason


async def handshake_failures(bed: Skew, label: str) -> float:
    values = await metric_values(bed.cluster.gateway_metrics_port, "raven_gateway_handshake_failures_total")
    return values.get((("reason", label),), 0.0)


async def build_info(bed: Skew, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return await metric_values(bed.metrics_port(name), "raven_build_info")


THIS_BUILD = {(("protocol", version.protocols()), ("version", version.RELEASE)): 1.0}


async def test_old_agent_new_gateway(tmp_path: Path, old: Release) -> None:
    async with skew_bed(tmp_path, old, {OLD_AGENT}) as bed:
        for node in ("edge-old-1", "edge-new-1"):
            status, body = await bed.scrape(node)
            assert status == 200 and f'Hostname="{node}"'.encode() in body, (status, body[:200])
        # Each process is the release it should be: the old agent has no build-info metric yet.
        assert await build_info(bed, "gateway") == THIS_BUILD
        assert await build_info(bed, NEW_AGENT) == THIS_BUILD
        assert await build_info(bed, OLD_AGENT) == {}
        # The gateway shows each agent's release and the protocol it agreed with it.
        snap = await bed.ops("/status")
        assert (snap["version"], snap["protocols"]) == (version.RELEASE, list(wire.SUPPORTED_VERSIONS))
        agents = {a["agent"]: a for p in snap["pools"] for a in p["agents"]}
        # The old agent speaks 1 and 2: its session is version 2 (the request's terms as x-raven-* headers); the
        # new one's is version 3 (the terms as OPEN's fields). Both scraped above.
        assert (agents[OLD_AGENT]["version"], agents[OLD_AGENT]["protocol"]) == (None, OLD_PROTOCOL)
        assert (agents[NEW_AGENT]["version"], agents[NEW_AGENT]["protocol"]) == (version.RELEASE,
                                                                                 wire.PROTOCOL_VERSION)
        page = await bed.ops("/status.html")
        assert f"{version.UNANNOUNCED} or older (not announced), protocol {OLD_PROTOCOL}" in page
        assert f"{version.RELEASE}, protocol {wire.PROTOCOL_VERSION}" in page
        assert f"release {version.RELEASE}, protocol {wire.PROTOCOL_VERSION}" in bed.log(NEW_AGENT)
        assert f"release {version.UNANNOUNCED} or older (not announced), protocol" in bed.log("gateway")

        reason = await refuse_unspoken_protocol(bed)
        assert f"no common protocol version: agent speaks [{UNSPOKEN}], gateway [1, 2, 3]" in reason, reason
        await bed.wait_log("gateway", reason)
        assert await handshake_failures(bed, "version") >= 1


async def test_new_agent_old_gateway(tmp_path: Path, old: Release) -> None:
    async with skew_bed(tmp_path, old, {"gateway", OLD_AGENT}) as bed:
        for node in ("edge-new-1", "edge-old-1"):
            status, body = await bed.scrape(node)
            assert status == 200 and f'Hostname="{node}"'.encode() in body, (status, body[:200])
        assert await build_info(bed, "gateway") == {}  # the 0.1.0 gateway
        assert await build_info(bed, NEW_AGENT) == THIS_BUILD
        assert "version" not in await bed.ops("/status")
        assert (f"connected to gateway replica gw-1 (1 replica(s), release {version.UNANNOUNCED} or older (not "
                f"announced), protocol {OLD_PROTOCOL})") in bed.log(NEW_AGENT)
        # This release's `raven status` reads the older gateway's status.
        url = f"http://127.0.0.1:{bed.cluster.gateway_metrics_port}"
        code, out, err = await run_to_end(sys.executable, "-m", "raven.cli", "status", "--gateway", url)
        assert code == 0, err.decode()
        text = out.decode()
        assert f"release {version.UNANNOUNCED} or older (not announced)" in text and NEW_AGENT in text, text

        reason = await refuse_unspoken_protocol(bed)
        assert f"no common protocol version: agent speaks [{UNSPOKEN}], gateway [1, 2]" in reason, reason
        await bed.wait_log("gateway", reason)
        assert await handshake_failures(bed, "version") >= 1


async def test_agent_below_min_agent_version_is_refused(tmp_path: Path, old: Release) -> None:
    floor = version.RELEASE
    async with skew_bed(tmp_path, old, {OLD_AGENT}, {"tunnel": {"min_agent_version": floor}},
                        wait_for=(NEW_AGENT,)) as bed:
        why = (f"agent {OLD_AGENT} runs release {version.UNANNOUNCED} or older (not announced), older than this "
               f"gateway's tunnel.min_agent_version {floor}: upgrade the agent")
        await bed.wait_log(OLD_AGENT, f"gateway refused the session: {why}")
        await bed.wait_log("gateway", why)
        assert await handshake_failures(bed, "agent-version") >= 1
        assert (await bed.scrape("edge-new-1"))[0] == 200  # an agent of this release is served
        assert (await bed.scrape("edge-old-1"))[0] != 200
        snap = await bed.ops("/status")
        assert {a["agent"] for p in snap["pools"] for a in p["agents"]} == {NEW_AGENT}


async def test_previous_release_runs_isolated(old: Release) -> None:
    """The old processes import the old release, not this checkout (the tests run from the checkout's directory,
    which ``python -m`` would otherwise put first on the path)."""
    code, out, _ = await run_to_end(*old.command, "--version")
    assert code == 0
    assert out.decode().strip() == f"raven {old.version}"
