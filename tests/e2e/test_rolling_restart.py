"""A rolling restart of every gateway replica, then of every agent, loses no scrape (issue 19, item 4).

Two gateway replicas behind a Service (tests/support/servicelb.py: random among the ready replicas per new
connection, as kube-proxy), two agents per pool dialling both replicas, and Debian's Prometheus scraping every
edge node every 2 s (bench/bench_restart.py does it every second; the test leaves a busy CI machine room)
through the Service address, both in Host-header mode and in proxy mode. One at a time,
as a DaemonSet or a Deployment would: SIGTERM, wait for the exit, start again, wait until ready, next. The
verdict is Prometheus's own: ``up`` never 0 over the whole run, a scrape recorded every interval, no failed
connection in its dialer counters, no error on any target.
"""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.support.polling import eventually
from tests.support.testbed import PROMETHEUS, REPLICA_IPS, Testbed

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

INTERVAL = 2.0  # scrape interval and timeout: 2 s leaves room for a busy CI machine while processes start
NOT_YET = (aiohttp.ClientError, TimeoutError, KeyError, ValueError)
poll = functools.partial(eventually, interval=0.25, tolerate=NOT_YET)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(request: pytest.FixtureRequest) -> AsyncIterator[Testbed]:
    tb = Testbed(replicas=2, scrape_interval=INTERVAL)  # its own folder: kept (logs) unless all went well
    failed_before = request.session.testsfailed
    ok = False
    try:
        await tb.start()
        await tb.wait_all_up(90)
        yield tb
        # A failed test does not raise here: the session's count of failures says whether all went well.
        ok = request.session.testsfailed == failed_before
    finally:
        await tb.close()
        if ok:
            shutil.rmtree(tb.workdir, ignore_errors=True)
        else:
            print(f"testbed logs kept in {tb.workdir}")
            print_log_tails(tb)


def print_log_tails(tb: Testbed, lines: int = 40) -> None:
    """What every process logged about draining, endpoints and failures, in the test's output: on CI the kept
    folder cannot be read afterwards."""
    notable = re.compile(r"warn|error|drain|refus|fail|ready|closed|sigterm", re.IGNORECASE)
    for log in sorted(tb.workdir.glob("*.log")):
        try:
            found = [line for line in log.read_text(errors="replace").splitlines() if notable.search(line)]
        except OSError as exc:
            print(f"--- {log.name}: {exc}")
            continue
        print(f"--- {log.name} ({len(found)} notable lines, the last {min(lines, len(found))})",
              *(line[:300] for line in found[-lines:]), sep="\n")


async def failed_scrapes(bed: Testbed, since: float) -> list[tuple[float, str]]:
    """Every failed scrape of an edge target since ``since`` (wall clock), from Prometheus's raw samples."""
    span = f"{max(1, round(time.time() - since + 1))}s"
    data = await bed.get_json(PROMETHEUS + "/api/v1/query", {"query": f'up{{job=~"edge-.*"}}[{span}]'})
    return sorted((float(t), f"{r['metric']['job']} {r['metric'].get('node')}") for r in data["data"]["result"]
                  for t, v in r["values"] if float(v) == 0 and float(t) >= since)


async def _both_replicas_ready(bed: Testbed) -> bool:
    return await bed.endpoints() == dict.fromkeys(REPLICA_IPS, True)


async def _all_agents_ready(bed: Testbed) -> bool:
    return all([await bed.agent_ready(site, agent) for site in bed.sites for agent in site.agents])


async def _scrape_errors(bed: Testbed) -> dict[str, str]:
    targets = (await bed.get_json(PROMETHEUS + "/api/v1/targets"))["data"]["activeTargets"]
    return {t["scrapeUrl"]: t["lastError"] for t in targets
            if t["labels"]["job"].startswith("edge-") and (t["health"] != "up" or t["lastError"])}


async def test_rolling_restarts_of_gateways_and_agents_lose_no_scrape(bed: Testbed) -> None:
    await poll(lambda: _both_replicas_ready(bed), 30, "both replicas are endpoints of the Service")
    await poll(lambda: _all_agents_ready(bed), 30, "every agent holds a session to both replicas")
    failed_dials = 'sum(net_conntrack_dialer_conn_failed_total{dialer_name=~"edge-.*"})'
    dials_before = sum((await bed.query(failed_dials)).values())
    await asyncio.sleep(3 * INTERVAL)  # Prometheus has scraped every target since all was ready
    start, wall = time.monotonic(), time.time()
    steps: list[str] = []

    for replica in (1, 2):
        name = f"gateway-{replica}"
        t0 = time.monotonic()
        steps.append(f"{time.time() - wall:5.1f}s SIGTERM {name}")
        assert await bed.stop(name, signal.SIGTERM, grace=30) == 0, f"{name} did not drain and exit 0"
        stopped = time.monotonic() - t0
        await bed.start_gateway(replica)
        took = await poll(lambda: _both_replicas_ready(bed), 60, f"{name} ready again after its restart")
        steps.append(f"{name}: drained and exited in {stopped:.1f}s, ready {took:.1f}s after its start")
    for site in bed.sites:
        for agent in site.agents:
            t0 = time.monotonic()
            steps.append(f"{time.time() - wall:5.1f}s SIGTERM {agent}")
            assert await bed.stop(agent, signal.SIGTERM, grace=30) == 0, f"{agent} did not drain and exit 0"
            stopped = time.monotonic() - t0
            await bed.start_agent(site, agent)
            took = await poll(lambda site=site, agent=agent: bed.agent_ready(site, agent), 60,  # type: ignore[misc]
                              f"{agent} holds sessions to both replicas again")
            steps.append(f"{agent}: drained and exited in {stopped:.1f}s, ready {took:.1f}s after its start")

    await asyncio.sleep(3 * INTERVAL)  # the scrapes that were in flight at the end are recorded
    span = f"{round(time.monotonic() - start + 2 * INTERVAL)}s"
    print(f"rolling restart over {span}:", *steps, sep="\n  ")
    worst = await bed.query(f'min_over_time(up{{job=~"edge-.*"}}[{span}])')
    count = await bed.query(f'count_over_time(up{{job=~"edge-.*"}}[{span}])')
    failed = await bed.query(f'count_over_time((up{{job=~"edge-.*"}} == 0)[{span}:{INTERVAL:g}s])')
    print(f"scrapes per target: {sorted(count.values())}; failed: {failed or 'none'}")
    for at, target in await failed_scrapes(bed, wall):
        print(f"  failed scrape at {at - wall:5.1f}s: {target}")
    assert sorted(worst) == bed.edge_targets()
    assert set(worst.values()) == {1.0}, f"failed scrapes during the rolling restart: {failed}"
    # A scrape was recorded (successfully) in nearly every interval: none was skipped or hung.
    expected = (time.monotonic() - start) / INTERVAL
    assert all(n >= 0.8 * expected for n in count.values()), (expected, count)
    dials_after = sum((await bed.query(failed_dials)).values())
    assert dials_after == dials_before, "Prometheus failed to connect to the Service during the restarts"
    assert await _scrape_errors(bed) == {}
