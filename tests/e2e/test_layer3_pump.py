"""Two namespaces, each with a TUN device, joined by the asyncio packet pump in this process (reading a batch
from one device, checking it against the policy, writing the batch to the other: the tunnel's stand-in).
Real ping and real TCP go across; a spoofed source is dropped and counted; the throughput is measured."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from raven.layer3.config import DEFAULT_MTU
from raven.layer3.policy import Drop, ForwardingPolicy
from raven.layer3.routes import MAIN_TABLE, Route, RouteManager
from raven.layer3.tun import TunDevice
from tests.support.layer3 import PYTHON, Namespaces, Netns, namespaces, needs_netns

pytestmark = needs_netns

EDGE_V4, CLOUD_V4 = "10.77.1.1", "10.77.2.1"
EDGE_V6, CLOUD_V6 = "fd77:1::1", "fd77:2::1"
POOL = "site-a"


class Bridge:
    """The tunnel's stand-in: edge → cloud through ``ForwardingPolicy.from_pool``, cloud → edge through
    ``from_cloud``."""

    def __init__(self, edge: TunDevice, cloud: TunDevice, policy: ForwardingPolicy) -> None:
        self.edge, self.cloud, self.policy = edge, cloud, policy
        self.drops: Counter[Drop] = Counter()
        self.batches: Counter[int] = Counter()

    def start(self) -> None:
        self.edge.start(self.from_edge)
        self.cloud.start(self.from_cloud)

    def from_edge(self, packets: list[bytes]) -> None:
        self.batches[len(packets)] += 1
        out = []
        for p in packets:
            v = self.policy.from_pool(POOL, p)
            if v.drop is not None:
                self.drops[v.drop] += 1
            else:
                out.append(p)
        self.cloud.write_batch(out)

    def from_cloud(self, packets: list[bytes]) -> None:
        self.batches[len(packets)] += 1
        out = []
        for p in packets:
            v = self.policy.from_cloud(p)
            if v.drop is not None:
                self.drops[v.drop] += 1
            elif v.target == POOL:
                out.append(p)
        self.edge.write_batch(out)


@dataclass
class Bed:
    edge: Netns
    cloud: Netns
    bridge: Bridge
    nets: Namespaces


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    async with namespaces() as nets:
        edge, cloud = nets.new("edge"), nets.new("cloud")
        policy = ForwardingPolicy(cloud_cidrs=["10.77.2.0/24", "fd77:2::/64"],
                                  pool_cidrs={POOL: ["10.77.1.0/24", "fd77:1::/64"]})
        a = await TunDevice.open("raven0", addresses=[f"{EDGE_V4}/24", f"{EDGE_V6}/64"], mtu=DEFAULT_MTU,
                                 netns=edge.name)
        try:
            b = await TunDevice.open("raven0", addresses=[f"{CLOUD_V4}/24", f"{CLOUD_V6}/64"], mtu=DEFAULT_MTU,
                                     netns=cloud.name)
            try:
                # each side routes the other's CIDRs into its device, as the agent and the gateway will
                await RouteManager({MAIN_TABLE}, netns=edge.name).reconcile(
                    [Route("10.77.2.0/24", device="raven0"), Route("fd77:2::/64", device="raven0")], [])
                await RouteManager({MAIN_TABLE}, netns=cloud.name).reconcile(
                    [Route("10.77.1.0/24", device="raven0"), Route("fd77:1::/64", device="raven0")], [])
                bridge = Bridge(a, b, policy)
                bridge.start()
                yield Bed(edge, cloud, bridge, nets)
            finally:
                await b.close()
        finally:
            await a.close()
        assert edge.links("raven0") == [] and cloud.links("raven0") == []
        assert edge.raven_routes() == [] and cloud.raven_routes() == []  # went with the devices


async def test_ping_both_ways_ipv4_and_ipv6(bed: Bed) -> None:
    await bed.edge.out("ping", "-c", "3", "-i", "0.2", "-W", "2", CLOUD_V4)
    await bed.cloud.out("ping", "-c", "3", "-i", "0.2", "-W", "2", EDGE_V4)
    await bed.edge.out("ping", "-6", "-c", "3", "-i", "0.2", "-W", "2", CLOUD_V6)
    await bed.cloud.out("ping", "-6", "-c", "3", "-i", "0.2", "-W", "2", EDGE_V6)
    assert bed.bridge.edge.stats.tx_packets >= 12 and bed.bridge.cloud.stats.tx_packets >= 12
    assert sum(bed.bridge.drops.values()) == 0


SERVER = """
import hashlib, socket, sys
s = socket.create_server((sys.argv[1], 5001), family=socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET)
print('listening', flush=True)
c, _ = s.accept()
h, n = hashlib.sha256(), 0
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    h.update(b); n += len(b)
c.sendall(h.hexdigest().encode())
c.close()
print(n, h.hexdigest(), flush=True)
"""

CLIENT = """
import hashlib, socket, sys
size = int(sys.argv[2])
h = hashlib.sha256()
c = socket.create_connection((sys.argv[1], 5001), timeout=60)
block = bytearray(1 << 16)
sent, i = 0, 0
while sent < size:
    chunk = hashlib.sha256(i.to_bytes(8, 'big')).digest() * 2048  # 64 KiB that differ per block
    chunk = chunk[:size - sent]
    c.sendall(chunk); h.update(chunk); sent += len(chunk); i += 1
c.shutdown(socket.SHUT_WR)
reply = b''
while len(reply) < 64:
    b = c.recv(64)
    if not b:
        break
    reply += b
print(sent, h.hexdigest(), reply.decode(), flush=True)
"""


@pytest.mark.parametrize("address", [CLOUD_V4, CLOUD_V6])
async def test_tcp_transfer_arrives_whole(bed: Bed, address: str) -> None:
    size = 16 * 1024 * 1024
    server = await bed.cloud.spawn(PYTHON, "-c", SERVER, address, stdout=asyncio.subprocess.PIPE)
    assert server.stdout is not None
    assert (await asyncio.wait_for(server.stdout.readline(), 20)).strip() == b"listening"
    sent, digest, echoed = (await bed.edge.out(PYTHON, "-c", CLIENT, address, str(size), timeout=120)).split()
    received, server_digest = (await asyncio.wait_for(server.stdout.readline(), 30)).decode().split()
    assert int(sent) == int(received) == size
    assert digest == server_digest == echoed
    assert bed.bridge.drops[Drop.SPOOFED] == 0


async def test_a_spoofed_source_is_dropped_and_counted(bed: Bed) -> None:
    bed.edge.sh("ip", "addr", "add", "10.66.0.1/32", "dev", "lo")
    delivered = bed.bridge.cloud.stats.tx_packets
    proc = await bed.edge.spawn("ping", "-c", "3", "-i", "0.2", "-W", "1", "-I", "10.66.0.1", CLOUD_V4,
                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    assert await asyncio.wait_for(proc.wait(), 20) != 0  # no reply: nothing reached the cloud
    assert bed.bridge.drops[Drop.SPOOFED] == 3
    assert bed.bridge.cloud.stats.tx_packets == delivered
    await bed.edge.out("ping", "-c", "1", "-W", "2", CLOUD_V4)  # the legitimate source still passes


async def test_a_destination_outside_every_cidr_has_no_route(bed: Bed) -> None:
    bed.cloud.sh("ip", "route", "add", "10.55.0.0/24", "dev", "raven0")
    proc = await bed.cloud.spawn("ping", "-c", "2", "-i", "0.2", "-W", "1", "10.55.0.9",
                                 stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    assert await asyncio.wait_for(proc.wait(), 20) != 0
    assert bed.bridge.drops[Drop.NO_ROUTE] == 2


async def _rtt(ns: Netns, address: str) -> float:
    out = await ns.out("ping", "-q", "-c", "20", "-i", "0.05", "-W", "2", address)
    return float(out.rsplit("=", 1)[1].split("/")[1])  # rtt min/avg/max/mdev = a/b/c/d ms


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="needs iperf3 (scripts/system-deps.sh)")
async def test_throughput_and_rtt_beside_a_direct_veth(bed: Bed) -> None:
    """Figures, printed (pytest -s): TCP throughput and idle RTT through the pump, and over a veth pair
    between the same two namespaces. Asserted only loosely: this is a measurement, not a benchmark gate."""
    bed.nets.veth(bed.edge, "10.78.0.1/24", bed.cloud, "10.78.0.2/24")
    figures = {}
    for path, address in (("pump", CLOUD_V4), ("veth", "10.78.0.2")):
        server = await bed.cloud.spawn("iperf3", "-s", "-1", "-B", address, stdout=asyncio.subprocess.DEVNULL)
        await asyncio.sleep(0.3)
        report = json.loads(await bed.edge.out("iperf3", "-c", address, "-t", "3", "-J", timeout=60))
        await asyncio.wait_for(server.wait(), 10)
        mbit = report["end"]["sum_received"]["bits_per_second"] / 1e6
        figures[path] = (mbit, await _rtt(bed.edge, address))
    batches = bed.bridge.batches
    mean_batch = sum(k * v for k, v in batches.items()) / max(1, sum(batches.values()))
    print(f"\nlayer-3 pump (in-process, {DEFAULT_MTU}-byte MTU): {figures['pump'][0]:.0f} Mbit/s, "
          f"idle RTT {figures['pump'][1]:.3f} ms; direct veth: {figures['veth'][0]:.0f} Mbit/s, "
          f"RTT {figures['veth'][1]:.3f} ms; mean batch {mean_batch:.1f} packets")
    assert figures["pump"][0] > 10
    assert sum(bed.bridge.drops.values()) == 0
