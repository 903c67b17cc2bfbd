"""Layer 3 end to end, in network namespaces (tests/support/l3testbed.py): a cloud pod and edge nodes behind NAT
reach each other only through Raven's tunnel. The real gateway and agents (processes) carry the packets; the
node behind site a's gateway node is routed by ``raven routes``. Ping both ways, 64 MiB over TCP verified by
sha256, a forged source dropped and counted, the active agent killed mid-transfer, layer 7 under a saturated
layer 3, and a clean exit that leaves nothing behind.

The figures (throughput, gaps, latencies) are printed: run with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import statistics
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.support.errors import TestbedError
from tests.support.l3testbed import (
    CLOUD_CIDR,
    CLOUD_NS,
    POD_IP,
    POD_NS,
    TOOLS,
    L3Testbed,
    gaps,
    metric_sum,
)
from tests.support.polling import eventually


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: network namespaces, TUN devices, routes (CI runs as root)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("iperf3", "iperf3"), ("ping", "iputils-ping")):
        if shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
            return f"needs {tool} (Debian package {package}; scripts/system-deps.sh installs it)"
    return None


pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.netns,
    pytest.mark.integration,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]

NOT_YET = (aiohttp.ClientError, TimeoutError, KeyError, ValueError)
STARTING = (*NOT_YET, TestbedError)  # an agent's /metrics before it listens
MiB = 1024 * 1024
NODE_NS, NODE_IP = "r3-a-n1", "10.220.1.11"  # site a's node behind the gateway node, routed by raven routes
DROPS = "raven_gateway_layer3_drops_total"
PACKETS = "raven_gateway_layer3_packets_total"
BYTES = "raven_gateway_layer3_bytes_total"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[L3Testbed]:
    tb = L3Testbed(tmp_path_factory.mktemp("raven-l3-testbed"))
    try:
        await tb.start()
        took = await tb.wait_ready(60)
        print(f"\nlayer 3 ready {took:.1f}s after the processes started")
        yield tb
    finally:
        await tb.close()
        assert not [n for n in await tb._netns_list() if n.startswith("r3-")], "testbed namespaces left behind"


async def test_routes_are_what_the_config_and_certificates_allow(bed: L3Testbed) -> None:
    a, b = bed.site_a, bed.site_b
    # The gateway routes each pool's CIDRs via its device; site b's config also lists 10.222.0.0/16, which its
    # agent's certificate does not: not routed.
    assert await bed.raven_routes(CLOUD_NS) == ["10.220.0.0/16 dev raven0", "10.221.0.0/16 dev raven0"]
    assert "raven0" not in (await bed.sh(CLOUD_NS, "ip", "route", "get", "10.222.0.5")).out
    # Site a's two agents each have a device in the same namespace; only the active one holds the route.
    active = await bed.active_agent(a.pool)
    assert active in {x.name for x in a.agents}
    device = bed.agent(active)[1].device
    assert await bed.tun_devices(a.gw_ns) == ["raven0", "raven1"]
    assert await bed.raven_routes(a.gw_ns) == [f"{CLOUD_CIDR} dev {device}"]
    assert await bed.raven_routes(b.gw_ns) == [f"{CLOUD_CIDR} dev raven0"]
    # raven routes on the node: Raven's table and rule towards the gateway node; nothing on the router.
    assert await bed.raven_routes(NODE_NS) == [f"{CLOUD_CIDR} via {a.next_hop} table 21057"]
    assert await bed.raven_rules(NODE_NS) == ["21057: lookup 21057"]
    assert await bed.raven_routes("r3-a-rtr") == []
    # Each process walked its objects once (the GC's first settle) before it took traffic, not after: done after
    # the session came up, that 250-350 ms pause held the first pings (one was counted lost by ping, whose wait
    # for the last reply is twice the slowest round trip, at least 200 ms).
    for name, first_traffic in (("gateway", "now carries pool"), (active, "chose this agent to carry")):
        log = bed.log(name, tail=1_000_000)
        assert "gc settled with a full walk" in log and first_traffic in log, (name, log[-2000:])
        assert log.index("gc settled with a full walk") < log.index(first_traffic), (name, log[-2000:])
    status = await bed.status()
    assert "layer3" in status, sorted(status)
    print(f"\n/status layer3: {status['layer3']}")


async def test_ping_both_ways(bed: L3Testbed) -> None:
    before = await bed.gateway_metrics()
    results = {
        "cloud pod -> site a node (via raven routes)": await bed.ping(POD_NS, NODE_IP, count=5),
        "cloud pod -> site b gateway node": await bed.ping(POD_NS, bed.site_b.gw_ip, count=5),
        "site a node -> cloud pod": await bed.ping(NODE_NS, POD_IP, count=5),
        "site b gateway node -> cloud pod": await bed.ping(bed.site_b.gw_ns, POD_IP, count=5),
    }
    for what, r in results.items():
        print(f"\n{what}: {r['received']:.0f}/{r['transmitted']:.0f}, RTT avg {r['avg']:.3f} ms")
        assert r["transmitted"] == 5 and r["received"] == 5, (what, r)
    after = await bed.gateway_metrics()
    for pool in ("site-a", "site-b"):
        for direction in ("to_pool", "from_pool"):
            grew = metric_sum(after, PACKETS, pool=pool, direction=direction) - metric_sum(
                before, PACKETS, pool=pool, direction=direction)
            assert grew >= 10, (pool, direction, grew)
    # The routers in front of the sites carry only the tunnel: the cloud has no other way into the LANs.
    assert (await bed.ping(CLOUD_NS, "10.220.1.1", count=1, wait=1))["received"] == 0


async def test_64_mib_over_tcp_both_ways_verified_by_sha256(bed: L3Testbed) -> None:
    before = await bed.gateway_metrics()
    for what, recv_ns, recv_ip, send_ns in (("edge node -> cloud pod", POD_NS, POD_IP, NODE_NS),
                                            ("cloud pod -> edge node", NODE_NS, NODE_IP, POD_NS)):
        sent, got = await bed.transfer(recv_ns, recv_ip, send_ns, 64 * MiB)
        assert got["bytes"] == sent["bytes"] == 64 * MiB
        assert got["sha256"] == sent["sha256"]
        print(f"\n{what}: 64 MiB in {got['seconds']:.2f}s = {64 * MiB * 8 / got['seconds'] / 1e6:.0f} Mbit/s, "
              f"sha256 {got['sha256'][:16]}... on both ends")
    after = await bed.gateway_metrics()
    for direction in ("to_pool", "from_pool"):
        grew = metric_sum(after, BYTES, pool="site-a", direction=direction) - metric_sum(
            before, BYTES, pool="site-a", direction=direction)
        assert grew >= 64 * MiB, (direction, grew)


async def _udp_counter(bed: L3Testbed, port: int, seconds: float) -> asyncio.subprocess.Process:
    proc = await bed.sh_background(POD_NS, *TOOLS, "udp-count", "--listen", f"{POD_IP}:{port}", "--seconds",
                                   str(seconds))
    assert proc.stdout is not None
    assert b"listening" in await asyncio.wait_for(proc.stdout.readline(), 15)
    return proc


async def _received(proc: asyncio.subprocess.Process) -> dict[str, int]:
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    done = [line for line in out.decode().splitlines() if '"done"' in line]
    assert done, err.decode()
    sources: dict[str, int] = json.loads(done[-1])["sources"]
    return sources


async def test_a_compromised_agent_sending_forged_sources_is_dropped_and_counted(bed: L3Testbed) -> None:
    """A rogue agent of site a (a real certificate of site a, packets of its own making) sends UDP to the cloud
    pod from a source outside every CIDR and from one of site b's: the gateway drops both as spoofed and counts
    them; from a source of site a's: delivered."""
    before = metric_sum(await bed.gateway_metrics(), DROPS, reason="spoofed")
    counter = await _udp_counter(bed, 5002, 5)
    report = await bed.rogue(f"{POD_IP}:5002", ["10.99.0.66", "10.221.1.50", "10.220.1.99"], count=10)
    assert report["sent"] == {"10.99.0.66": 10, "10.221.1.50": 10, "10.220.1.99": 10}, report
    assert report["active"] is False  # a standby of site a: the gateway takes its packets all the same
    assert await _received(counter) == {"10.220.1.99": 10}

    async def counted() -> bool:
        return metric_sum(await bed.gateway_metrics(), DROPS, reason="spoofed") - before >= 20

    await eventually(counted, 5, "20 spoofed drops counted", tolerate=NOT_YET)
    after = metric_sum(await bed.gateway_metrics(), DROPS, reason="spoofed")
    assert after - before == 20
    print(f"\ngateway: raven_gateway_layer3_drops_total{{reason=\"spoofed\"}} {before:.0f} -> {after:.0f}")
    # With its own pool's source, to site b: edge to edge is not allowed between them (none is configured).
    denied = metric_sum(await bed.gateway_metrics(), DROPS, reason="edge-to-edge-denied")
    report = await bed.rogue(f"{bed.site_b.gw_ip}:5005", ["10.220.1.99"], count=5)
    assert report["sent"] == {"10.220.1.99": 5}, report

    async def denied_counted() -> bool:
        return metric_sum(await bed.gateway_metrics(), DROPS, reason="edge-to-edge-denied") - denied == 5

    await eventually(denied_counted, 5, "5 edge-to-edge-denied drops counted", tolerate=NOT_YET)


async def test_a_forged_source_on_the_gateway_node_is_dropped_by_the_agent(bed: L3Testbed) -> None:
    """Raw packets with forged sources, sent on site a's gateway node into the active agent's device: the agent
    itself does not send them up (counted as spoofed there); its own pool's source goes through."""
    site = bed.site_a
    active = await bed.active_agent(site.pool)
    assert active is not None
    agent_drops = metric_sum(await bed.agent_metrics(active), "raven_agent_layer3_drops_total", reason="spoofed")
    counter = await _udp_counter(bed, 5004, 4)
    for src in ("10.99.0.66", "10.221.1.50", site.gw_ip):
        r = await bed.sh(site.gw_ns, *TOOLS, "spoof", "--src", src, "--to", f"{POD_IP}:5004", "--count", "10")
        assert r.rc == 0, r.err
    assert await _received(counter) == {site.gw_ip: 10}
    grew = metric_sum(await bed.agent_metrics(active), "raven_agent_layer3_drops_total", reason="spoofed") - agent_drops
    assert grew == 20, grew


async def test_layer7_keeps_working_while_layer3_is_saturated(bed: L3Testbed) -> None:
    idle = [(await bed.scrape(n))[1] for _ in range(10) for n in ("gpu-a-1", "gpu-b-1")]
    results: list[tuple[str, int, float]] = []
    load = asyncio.create_task(bed.iperf3(NODE_NS, NODE_IP, POD_NS, seconds=6, parallel=4))
    await asyncio.sleep(1.0)  # let TCP fill the tunnel
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline and not load.done():
        for node in ("gpu-a-1", "gpu-b-1"):  # gpu-a-1's scrapes share the saturated session
            try:
                status, took = await bed.scrape(node, timeout=5)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, took = 599, float("inf")
                print(f"\nscrape of {node} failed: {exc!r}")
            results.append((node, status, took))
        await asyncio.sleep(0.1)
    throughput = await load
    busy = [t for _, _, t in results]
    print(f"\nlayer 3 saturated: iperf3 (4 flows) {throughput['bits_per_second'] / 1e6:.0f} Mbit/s, "
          f"{throughput['retransmits']:.0f} retransmits; {len(results)} scrapes during it: "
          f"p50 {statistics.median(busy) * 1000:.1f} ms, max {max(busy) * 1000:.1f} ms "
          f"(idle: p50 {statistics.median(idle) * 1000:.1f} ms, max {max(idle) * 1000:.1f} ms); p50 per node: "
          + ", ".join(f"{n} {statistics.median([t for m, _, t in results if m == n]) * 1000:.1f} ms"
                      for n in ("gpu-a-1", "gpu-b-1")))
    assert len(results) >= 10
    assert all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200]
    assert max(busy) < 2.0, results
    assert throughput["bits_per_second"] > 10e6


async def test_a_clean_stop_of_either_agent_leaves_the_other_forwarding(bed: L3Testbed) -> None:
    site = bed.site_a
    # The agent that found forwarding off and turned it on (the first to start), active or not.
    setter = next(x.name for x in site.agents if "set sysctl net.ipv4.ip_forward=1" in bed.log(x.name, 10**6))
    other = next(x.name for x in site.agents if x.name != setter)
    was_active = await bed.active_agent(site.pool)
    try:
        assert await bed.stop(setter, signal.SIGTERM, grace=15) == 0
        await eventually(lambda: _is_active(bed, site.pool, other), 5, f"{other} active", tolerate=NOT_YET)
        device = bed.agent(other)[1].device
        await eventually(lambda: _routes_are(bed, site.gw_ns, [f"{CLOUD_CIDR} dev {device}"]), 5,
                         f"{other}'s route", tolerate=NOT_YET)
        assert (await bed.ping(POD_NS, site.gw_ip, count=3))["received"] == 3  # the gateway node itself
        forward = (await bed.sh(site.gw_ns, "sysctl", "-n", "net.ipv4.ip_forward")).out.strip()
        ping = await bed.ping(NODE_NS, POD_IP, count=3)  # the node behind it: needs forwarding on
        print(f"\nclean stop of {setter} (active: {was_active}); {other} carries site a: ip_forward on the "
              f"gateway node is {forward}; node -> cloud pod {ping['received']:.0f}/3")
        assert forward == "1" and ping["received"] == 3
    finally:
        # Whatever happened, the next tests start from two agents and forwarding on.
        await bed.sh(site.gw_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        await bed.start_agent(setter)
        old_device = bed.agent(setter)[1].device

        async def back() -> bool:
            return old_device in await bed.tun_devices(site.gw_ns)

        await eventually(back, 20, f"{setter} back", tolerate=NOT_YET)
        await asyncio.sleep(1.0)


async def _is_active(bed: L3Testbed, pool: str, agent: str) -> bool:
    return await bed.active_agent(pool) == agent


async def _routes_are(bed: L3Testbed, ns: str, routes: list[str]) -> bool:
    return await bed.raven_routes(ns) == routes


async def test_the_active_agent_killed_mid_transfer_another_takes_over(bed: L3Testbed) -> None:
    site = bed.site_a
    active = await bed.active_agent(site.pool)
    assert active is not None
    standby = next(x.name for x in site.agents if x.name != active)
    # A ping every 20 ms from the cloud pod to the node measures the gap, beside a paced 64 MiB transfer.
    pinger = await bed.sh_background(POD_NS, "ping", "-n", "-D", "-i", "0.02", "-W", "1", "-w", "20", NODE_IP)
    receiver = await bed.start_receiver(NODE_NS, NODE_IP, 5003)
    sender = await bed.sh_background(POD_NS, *TOOLS, "send", "--to", f"{NODE_IP}:5003", "--bytes",
                                     str(64 * MiB), "--rate", str(12 * MiB), "--progress", str(4 * MiB))
    try:
        assert sender.stdout is not None
        while True:  # a quarter of the way: kill the active agent
            line = await asyncio.wait_for(sender.stdout.readline(), 30)
            if not line:
                _, err = await sender.communicate()
                state = (await bed.active_agent(site.pool), await bed.raven_routes(site.gw_ns),
                         await bed.tun_devices(site.gw_ns))
                raise AssertionError(f"the sender ended early: {err.decode()[-1500:]}; active agent, routes and "
                                     f"devices on the gateway node: {state}")
            if b'"progress"' in line and json.loads(line)["bytes"] >= 16 * MiB:
                break
        killed_at = time.time()
        await bed.stop(active, signal.SIGKILL)

        async def switched() -> bool:
            return await bed.active_agent(site.pool) == standby

        took = await eventually(switched, 10, f"{standby} active", interval=0.05, tolerate=NOT_YET)
        switch = time.time() - killed_at
        out, err = await asyncio.wait_for(sender.communicate(), 120)
        assert sender.returncode == 0, err.decode()[-2000:]
        rout, rerr = await asyncio.wait_for(receiver.communicate(), 30)
        assert receiver.returncode == 0, rerr.decode()[-2000:]
        sent = json.loads([x for x in out.decode().splitlines() if '"done"' in x][-1])
        got = json.loads([x for x in rout.decode().splitlines() if '"done"' in x][-1])
        assert got["bytes"] == sent["bytes"] == 64 * MiB and got["sha256"] == sent["sha256"]
        pinger.send_signal(signal.SIGINT)
        pout, _ = await asyncio.wait_for(pinger.communicate(), 10)
    finally:
        for p in (sender, receiver, pinger):
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await p.wait()
    replies = [float(m[1]) for m in re.finditer(r"^\[(\d+\.\d+)\] \d+ bytes from", pout.decode(), re.M)]
    after_kill = [t for t in replies if t >= killed_at - 0.5]
    gap = gaps(after_kill)
    print(f"\nfailover: killed {active} (SIGKILL) at a quarter of a 64 MiB transfer; the gateway made {standby} "
          f"active {switch * 1000:.0f} ms later (seen within {took * 1000:.0f} ms of polling); longest gap between "
          f"ping replies (every 20 ms) {gap * 1000:.0f} ms; transfer completed in {got['seconds']:.1f}s, "
          f"sha256 equal")
    assert switch < 3.0
    assert after_kill and gap < 5.0, gap
    # The killed agent's device went with it (and its route with the device); the new one holds the route.
    new_device = bed.agent(standby)[1].device
    assert await bed.tun_devices(site.gw_ns) == [new_device]
    assert await bed.raven_routes(site.gw_ns) == [f"{CLOUD_CIDR} dev {new_device}"]
    # The killed agent comes back as the standby: its device, no route; the active one stays active.
    await bed.start_agent(active)
    old_device = bed.agent(active)[1].device

    async def back() -> bool:
        return old_device in await bed.tun_devices(site.gw_ns)

    await eventually(back, 20, f"{active} back with its device", tolerate=NOT_YET)
    await asyncio.sleep(1.5)
    assert await bed.active_agent(site.pool) == standby
    assert await bed.raven_routes(site.gw_ns) == [f"{CLOUD_CIDR} dev {new_device}"]
    assert (await bed.ping(POD_NS, NODE_IP, count=3))["received"] == 3


async def _neighbour_mac(bed: L3Testbed, namespace: str, address: str) -> str | None:
    entries = await bed.ip_json(namespace, "neigh", "show", address)
    mac = entries[0].get("lladdr") if entries else None
    return str(mac) if mac else None


async def _mac(bed: L3Testbed, namespace: str, device: str = "eth0") -> str:
    return str((await bed.ip_json(namespace, "link", "show", device))[0]["address"])


async def test_the_floating_lan_address_follows_the_active_agent_to_another_node(bed: L3Testbed) -> None:
    """Site a's agents share 10.220.1.100 (layer3.lan_address); the node behind them routes through it. The
    active agent's node holds it: when the carrying agent moves to the second gateway node, the address and
    the node's neighbour entry (gratuitous ARP) move with it, and the node keeps reaching the cloud."""
    site = bed.site_a
    vip = site.next_hop
    spare = site.spare_agents[0]
    gw2 = site.namespace_of(spare)
    assert await bed.holders(vip) == [site.gw_ns]
    gw_mac, gw2_mac = await _mac(bed, site.gw_ns), await _mac(bed, gw2)

    async def sessions_up(name: str) -> bool:
        return metric_sum(await bed.agent_metrics(name), "raven_agent_sessions") >= 1

    async def holders_are(*namespaces: str) -> bool:
        return sorted(await bed.holders(vip)) == sorted(namespaces)

    async def neighbour_is(mac: str) -> bool:
        return await _neighbour_mac(bed, NODE_NS, vip) == mac

    # raven routes on the second gateway node as well (a 30 s interval: the kernel's address notifications, not
    # the interval, must make it notice the address coming and going): while its agent is a standby, its own
    # traffic goes through the holder.
    via_vip, own_device = [f"{CLOUD_CIDR} via {vip} table 21057"], [f"{CLOUD_CIDR} dev {spare.device}"]
    await bed.spawn("routes-a-gw2", gw2, bed.raven("routes", "--gateway", vip, "--cidr", CLOUD_CIDR,
                                                  "--interval", "30"))
    await eventually(lambda: _routes_are(bed, gw2, via_vip), 10, f"{gw2} routes via {vip}", tolerate=NOT_YET)
    await bed.start_agent(spare.name)
    await eventually(lambda: sessions_up(spare.name), 20, f"{spare.name} connected", tolerate=STARTING)
    assert await bed.holders(vip) == [site.gw_ns]  # a standby agent leaves the address alone
    assert await bed.raven_routes(gw2) == via_vip
    assert (await bed.ping(gw2, POD_IP, count=3))["received"] == 3  # the standby's node, through the holder
    pinger = await bed.sh_background(POD_NS, "ping", "-n", "-D", "-i", "0.02", "-W", "1", "-w", "12", NODE_IP)
    try:
        await asyncio.sleep(0.5)
        # Both agents of the first gateway node stop cleanly: the pool's traffic moves to the second node.
        stopped_at = time.time()
        codes = await asyncio.gather(*(bed.stop(x.name, signal.SIGTERM, grace=15) for x in site.agents))
        assert codes == [0, 0], codes
        await eventually(lambda: _is_active(bed, site.pool, spare.name), 10, f"{spare.name} active",
                         tolerate=NOT_YET)
        await eventually(lambda: holders_are(gw2), 10, f"{vip} on {gw2} only", tolerate=NOT_YET)
        await eventually(lambda: neighbour_is(gw2_mac), 5, f"{NODE_NS}'s neighbour {vip} at {gw2_mac}",
                         tolerate=NOT_YET)
        moved = time.time() - stopped_at
        assert (await bed.ping(NODE_NS, POD_IP, count=3))["received"] == 3
        # The second node holds the address now: raven routes there withdrew its routes through it (notified by
        # the kernel), so the node's own traffic, and what it forwards, takes its agent's device.
        await eventually(lambda: _routes_are(bed, gw2, own_device), 5, f"{gw2}: only {spare.name}'s route",
                         tolerate=NOT_YET)
        assert (await bed.ping(gw2, POD_IP, count=3))["received"] == 3
        pinger.send_signal(signal.SIGINT)
        pout, _ = await asyncio.wait_for(pinger.communicate(), 15)
    finally:
        if pinger.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pinger.pid, signal.SIGKILL)
            await pinger.wait()
        for x in site.agents:  # whatever happened, the first node's agents come back (as standbys)
            p = bed.processes.get(x.name)
            if p is None or p.proc is None or p.proc.returncode is not None:
                await bed.start_agent(x.name)
    replies = [float(m[1]) for m in re.finditer(r"^\[(\d+\.\d+)\] \d+ bytes from", pout.decode(), re.M)]
    gap = gaps([t for t in replies if t >= stopped_at - 0.5])
    print(f"\nfloating address: {vip} moved from {site.gw_ns} to {gw2} with the active agent "
          f"{moved * 1000:.0f} ms after the first node's agents were stopped; longest gap between ping replies "
          f"(cloud pod -> node behind, every 20 ms) {gap * 1000:.0f} ms")
    assert gap < 5.0, gap

    # A crash: the second node's agent is SIGKILLed while it holds the address. One of the first node's agents
    # takes the pool and the address, and its gratuitous ARP moves the node's neighbour entry back at once; the
    # dead agent's address stays on its node until it restarts, which removes it (its label says whose it is).
    for x in site.agents:
        await eventually(functools.partial(sessions_up, x.name), 20, f"{x.name} back", tolerate=STARTING)
    await bed.stop(spare.name, signal.SIGKILL)
    await eventually(lambda: holders_are(site.gw_ns, gw2), 10, f"{vip} on {site.gw_ns} (and left on {gw2})",
                     tolerate=NOT_YET)
    await eventually(lambda: neighbour_is(gw_mac), 5, f"{NODE_NS}'s neighbour {vip} at {gw_mac}", tolerate=NOT_YET)
    assert (await bed.ping(NODE_NS, POD_IP, count=3))["received"] == 3
    await bed.start_agent(spare.name)
    await eventually(lambda: holders_are(site.gw_ns), 20, f"{spare.name}'s leftover removed at its start",
                     tolerate=NOT_YET)
    assert "left there by this agent's previous run" in bed.log(spare.name, 10**6)
    await eventually(lambda: sessions_up(spare.name), 20, f"{spare.name} connected", tolerate=STARTING)
    assert await bed.stop(spare.name, signal.SIGTERM, grace=15) == 0
    assert await bed.holders(vip) == [site.gw_ns]  # a standby's clean exit leaves the active one's address
    assert (await bed.ping(POD_NS, NODE_IP, count=3))["received"] == 3
    await eventually(lambda: _routes_are(bed, gw2, via_vip), 10, f"{gw2} routes via {vip} again", tolerate=NOT_YET)
    assert await bed.stop("routes-a-gw2", signal.SIGTERM, grace=15) == 0
    assert await bed.raven_routes(gw2) == []


async def test_a_clean_exit_leaves_no_device_route_or_rule(bed: L3Testbed) -> None:
    forward = {ns: (await bed.sh(ns, "sysctl", "-n", "net.ipv4.ip_forward")).out.strip()
               for ns in (CLOUD_NS, bed.site_b.gw_ns)}
    assert forward == {CLOUD_NS: "1", bed.site_b.gw_ns: "1"}  # turned on by Raven (the topology leaves them 0)
    codes = {}
    for name in ["routes-a", *(x.name for s in bed.sites for x in s.agents), "gateway"]:
        codes[name] = await bed.stop(name, signal.SIGTERM, grace=15)
    assert codes == dict.fromkeys(codes, 0), codes
    assert await bed.leftovers() == {}
    forward = {ns: (await bed.sh(ns, "sysctl", "-n", "net.ipv4.ip_forward")).out.strip()
               for ns in (CLOUD_NS, bed.site_b.gw_ns)}
    assert forward == {CLOUD_NS: "0", bed.site_b.gw_ns: "0"}, "ip_forward not restored on a clean exit"
