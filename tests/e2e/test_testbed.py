"""End to end across network namespaces: Debian's Prometheus in the cloud namespace scrapes edge GPU
nodes by name through the tunnel. Every assertion is on what Prometheus itself recorded."""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.support.polling import eventually
from tests.support.testbed import CLOUD_NODES, CLOUD_POOL, GATEWAY_OPS, HEARTBEAT_TIMEOUT, SCRAPE_INTERVAL, Testbed

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

NOT_YET = (aiohttp.ClientError, TimeoutError, KeyError, ValueError)  # Prometheus busy or restarting
poll = functools.partial(eventually, interval=0.25, tolerate=NOT_YET)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Testbed]:
    tb = Testbed(tmp_path_factory.mktemp("raven-testbed"))
    try:
        await tb.start()
        await tb.wait_all_up(90)
        yield tb
    finally:
        await tb.close()





def window(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


async def test_every_edge_target_is_up_with_the_right_labels(bed: Testbed) -> None:
    up = await bed.query('up{job=~"edge-.*"}')
    assert sorted(up) == bed.edge_targets()
    assert set(up.values()) == {1.0}
    series = await bed.get_json("http://10.199.0.2:9090/api/v1/query",
                                {"query": 'DCGM_FI_DEV_GPU_UTIL{job="edge-dcgm", gpu="0"}'})
    metrics = [r["metric"] for r in series["data"]["result"]]
    assert sorted(m["node"] for m in metrics) == ["gpu-a-1", "gpu-a-2", "gpu-b-1", "gpu-b-2"]
    for m in metrics:
        assert m["Hostname"] == m["node"], m  # the node's own exporter answered, through its own site
        assert m["pool"] == f"site-{m['node'][4]}"
        assert m["instance"] == f"{m['node']}:9400"
    node_exporter = await bed.query('node_exporter_build_info{job="edge-node"}')
    assert len(node_exporter) == 4


async def test_an_on_cloud_pool_is_scraped_directly_beside_the_tunnel_pools(bed: Testbed) -> None:
    """One Prometheus, one discovery: the tunnel pools through Raven, the on-cloud pool (reach: direct) directly."""
    up = await bed.query('up{job=~"edge-.*|direct-.*"}')
    assert sorted(up) == sorted(bed.edge_targets() + bed.direct_targets()) and set(up.values()) == {1.0}, up
    targets = (await bed.get_json("http://10.199.0.2:9090/api/v1/targets"))["data"]["activeTargets"]
    direct = [t for t in targets if t["labels"]["job"].startswith("direct-")]
    assert sorted(t["labels"]["instance"] for t in direct) == bed.direct_targets()
    for t in direct:
        assert t["labels"]["pool"] == CLOUD_POOL and t["health"] == "up"
        # By name, which the hosts file maps to the node's own address (hosts.direct: internal-ip): no proxy.
        assert t["scrapeUrl"].startswith(f"http://{t['labels']['node']}:"), t["scrapeUrl"]
    hosts = (bed.hosts_dir / "tunnel-nodes").read_text()
    for name, address in CLOUD_NODES.items():
        assert f"{address}\t{name}\n" in hosts
    series = await bed.query('DCGM_FI_DEV_GPU_UTIL{job="direct-dcgm", gpu="0"}')
    assert sorted(series) == [f"{n}:9400" for n in sorted(CLOUD_NODES)]
    # The gateway relayed nothing for the direct pool: Prometheus never sent it a request for those nodes.
    relayed = await bed.query(f'raven_gateway_requests_total{{job="raven-gateway", pool="{CLOUD_POOL}"}}')
    assert not relayed, relayed
    sd = await bed.get_json(GATEWAY_OPS + "/sd")
    reach = {g["labels"]["node"]: g["labels"]["__meta_raven_reach"] for g in sd}
    assert {n: reach[n] for n in CLOUD_NODES} == dict.fromkeys(CLOUD_NODES, "direct")
    assert {reach[n] for s in bed.sites for n in s.nodes} == {"tunnel"}


async def test_prometheus_needs_credentials_in_both_modes(bed: Testbed) -> None:
    """The jobs above scrape with the token (Host-header mode and proxy mode); the same targets without it
    are refused: 401 in Host-header mode, 407 in proxy mode, as Prometheus itself reports."""

    async def refused() -> bool:
        targets = (await bed.get_json("http://10.199.0.2:9090/api/v1/targets"))["data"]["activeTargets"]
        errors: dict[str, set[str]] = {"noauth-dcgm": set(), "noauth-proxy": set()}
        for t in targets:
            job = t["labels"]["job"]
            if job in errors:
                if t["health"] != "down":
                    return False
                errors[job].add(t["lastError"])
        return (len(errors["noauth-dcgm"]) == 1 and "401" in next(iter(errors["noauth-dcgm"]))
                and len(errors["noauth-proxy"]) == 1 and "407" in next(iter(errors["noauth-proxy"])))

    await poll(refused, 30, "unauthenticated jobs refused with 401 and 407")
    up = await bed.query('up{job=~"edge-.*"}')  # and the authenticated ones (both modes) are up
    assert sorted(up) == bed.edge_targets() and set(up.values()) == {1.0}, up


async def test_a_stalled_exporter_fails_alone_within_its_timeout(bed: Testbed) -> None:
    bed.signal("dcgm-gpu-b-1", signal.SIGSTOP)  # accepts connections (kernel backlog), never answers
    try:
        async def down() -> bool:
            return (await bed.query('up{job="edge-dcgm", node="gpu-b-1"}'))["gpu-b-1:9400"] == 0

        await poll(down, 4 * SCRAPE_INTERVAL + 5, "stalled target down")
        await asyncio.sleep(2 * SCRAPE_INTERVAL)
        # The failed scrapes ended at the scrape timeout (1.5 s), not later.
        durations = await bed.query(
            f'max_over_time(scrape_duration_seconds{{job="edge-dcgm", node="gpu-b-1"}}[{window(2 * SCRAPE_INTERVAL)}])'
        )
        assert durations["gpu-b-1:9400"] <= 2.0
        others = await bed.query(f'min_over_time(up{{job=~"edge-.*"}}[{window(3 * SCRAPE_INTERVAL)}])')
        assert {k: v for k, v in others.items() if k != "gpu-b-1:9400"} == {
            t: 1.0 for t in bed.edge_targets() if t != "gpu-b-1:9400"
        }
    finally:
        bed.signal("dcgm-gpu-b-1", signal.SIGCONT)
    await bed.wait_all_up(30)


async def test_losing_one_agent_of_a_site_misses_no_scrape(bed: Testbed) -> None:
    site = bed.sites[0]
    await bed.stop(site.agents[0], signal.SIGKILL)
    start = time.monotonic()
    await asyncio.sleep(5 * SCRAPE_INTERVAL)
    span = window(time.monotonic() - start)
    worst = await bed.query(f'min_over_time(up{{job=~"edge-.*", pool="{site.pool}"}}[{span}])')
    scrapes = await bed.query(f'count_over_time(up{{job=~"edge-.*", pool="{site.pool}"}}[{span}])')
    assert worst and set(worst.values()) == {1.0}, worst
    assert all(n >= 4 for n in scrapes.values()), scrapes
    await bed.start_agent(site, site.agents[0])


async def test_an_uplink_outage_takes_its_site_down_and_back(bed: Testbed) -> None:
    site = bed.sites[1]
    await bed.topology("uplink", site.name, "down")
    try:
        async def site_down() -> bool:
            up = await bed.query(f'up{{job=~"edge-.*", pool="{site.pool}"}}')
            return bool(up) and set(up.values()) == {0.0}

        took = await poll(site_down, HEARTBEAT_TIMEOUT + SCRAPE_INTERVAL + 10, "site down")
        assert took <= HEARTBEAT_TIMEOUT + SCRAPE_INTERVAL + 10
        other = await bed.query(f'up{{job=~"edge-.*", pool="{bed.sites[0].pool}"}}')
        assert set(other.values()) == {1.0}
    finally:
        await bed.topology("uplink", site.name, "up")

    async def site_up() -> bool:
        up = await bed.query(f'up{{job=~"edge-.*", pool="{site.pool}"}}')
        return bool(up) and set(up.values()) == {1.0}

    await poll(site_up, 30, "site back up")


async def test_a_gateway_restart_recovers_within_two_scrape_intervals(bed: Testbed) -> None:
    assert await bed.stop("gateway", signal.SIGTERM) == 0
    stopped = time.monotonic()
    await bed.start_gateway()

    async def ready() -> bool:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            async with http.get(GATEWAY_OPS + "/readyz") as resp:
                return resp.status == 200

    await poll(ready, 30, "gateway ready")
    ready_at = time.monotonic()
    await asyncio.sleep(3 * SCRAPE_INTERVAL)
    # Failed scrapes per target, as samples (all of them minus those that are 1). From the stop: the process's
    # own start counts, and it is the machine's (a loaded 2-core CI machine takes seconds to import a Python
    # service), so it is printed; from the moment the gateway is ready (its agents' sessions are back), a target
    # fails at most the one scrape that was already on its way: recovery within one more interval.
    def misses_since(t: float) -> str:
        sel = f'up{{job=~"edge-.*"}}[{window(time.monotonic() - t)}]'
        return f"count_over_time({sel}) - sum_over_time({sel})"

    since_stop = await bed.query(misses_since(stopped - SCRAPE_INTERVAL))
    since_ready = await bed.query(misses_since(ready_at))
    print(f"\ngateway restart: ready {ready_at - stopped:.1f} s after the stop; failed scrapes per target since the "
          f"stop {sorted(since_stop.values())}, since ready {sorted(since_ready.values())}")
    assert since_stop and all(v <= 1 for v in since_ready.values()), (since_ready, since_stop)
    assert all(v <= 2 + (ready_at - stopped) / SCRAPE_INTERVAL for v in since_stop.values()), since_stop
    await bed.wait_all_up(10)


async def test_a_node_that_leaves_leaves_dns_and_discovery(bed: Testbed) -> None:
    site = bed.sites[0]
    del site.nodes["gpu-a-2"]
    for i, agent in enumerate(site.agents):
        bed.write_agent_config(site, agent, 10266 + i)
        await bed.stop(agent)
        await bed.start_agent(site, agent)
    hosts = bed.hosts_dir / "tunnel-nodes"

    async def gone_from_dns_and_sd() -> bool:
        sd = await bed.get_json(GATEWAY_OPS + "/sd")
        return "gpu-a-2" not in hosts.read_text() and all(g["labels"]["node"] != "gpu-a-2" for g in sd)

    await poll(gone_from_dns_and_sd, 30, "gpu-a-2 removed from the hosts file and discovery")

    async def gone_from_prometheus() -> bool:
        targets = (await bed.get_json("http://10.199.0.2:9090/api/v1/targets"))["data"]["activeTargets"]
        nodes = {t["labels"].get("node") for t in targets if t["labels"]["job"].startswith("edge-")}
        return nodes == {"gpu-a-1", "gpu-b-1", "gpu-b-2"}

    await poll(gone_from_prometheus, 30, "Prometheus dropped gpu-a-2")

