"""The ops port under a flood of held connections: the kubelet's probes and a Prometheus keep working.

Found by issue 29 item 3: 9 source addresses × 64 keep-alive connections (one ``/healthz`` each, then held)
filled the ops listener's 512 connections, and ``/healthz``, ``/readyz`` and ``/metrics`` answered everyone
else ``503`` until the guard closed the idle ones ~11 s later, when the attacker simply opened them again: the
kubelet's probes failed throughout and Kubernetes would restart a healthy gateway.

A real gateway process runs; the attacker is its own process (tests/support/opsflood.py) holding 9 × 64
connections from 127.0.30.1-9 and reopening whatever is closed. Meanwhile, from addresses of their own, a
kubelet opens a new connection for each of ``/healthz``, ``/readyz`` and ``/metrics`` every half second (the
three at once), and a Prometheus scrapes ``/metrics`` every second over one keep-alive connection. Every one of
those requests must be answered ``200`` within the probe timeout (1 s) for 15 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from raven.aio import stop_process
from raven.demo.launch import LocalCluster
from raven.ops.server import OPS_LIMITS

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

ATTACKERS = [f"127.0.30.{i}" for i in range(1, 10)]
PER_ADDRESS = 64
KUBELET = "127.0.31.1"
PROMETHEUS = "127.0.31.2"
PROBE_TIMEOUT = 1.0  # the kubelet's default timeoutSeconds
PROBE_PERIOD = 0.5
WINDOW = 15.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("ops-flood"), [])
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.close()


class Flood:
    """The attacker process and the last counts it printed."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.counts: dict[str, int] = {}
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            text = line.decode().strip()
            self.lines.append(text)
            with contextlib.suppress(ValueError):
                self.counts = {k: int(v) for k, v in (item.split("=") for item in text.split())}

    async def stop(self) -> None:
        await stop_process(self.process, 15, 10.0)
        await asyncio.wait_for(self._reader, 10)


@pytest_asyncio.fixture(loop_scope="module")
async def flood(cluster: LocalCluster) -> AsyncIterator[Flood]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.opsflood", "127.0.0.1", str(cluster.gateway_metrics_port),
        "--sources", ",".join(ATTACKERS), "--per", str(PER_ADDRESS),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )
    flood = Flood(process)
    try:
        yield flood
    finally:
        await flood.stop()


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, float, str]:
    """(status, seconds, what went wrong); status 0 when no answer came within the probe timeout."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)) as resp:
            body = await resp.read()
            return resp.status, loop.time() - start, body[:80].decode(errors="replace").strip()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, loop.time() - start, f"{type(exc).__name__}: {exc}"


async def test_probes_are_answered_while_the_ops_port_is_flooded(cluster: LocalCluster, flood: Flood) -> None:
    assert len(ATTACKERS) * PER_ADDRESS > OPS_LIMITS.max_connections  # the attack fills the listener
    base = f"http://127.0.0.1:{cluster.gateway_metrics_port}"
    loop = asyncio.get_running_loop()
    # The attack is on once it holds (nearly) the whole listener.
    end = loop.time() + 30
    while flood.counts.get("held", 0) < OPS_LIMITS.max_connections - 8:
        assert loop.time() < end, f"the attacker never filled the ops listener: {flood.lines[-3:]}"
        await asyncio.sleep(0.1)
    before = dict(flood.counts)

    kubelet = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, local_addr=(KUBELET, 0)))
    prometheus = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, local_addr=(PROMETHEUS, 0)))
    probes: list[tuple[str, int, float, str]] = []
    scrapes: list[tuple[int, float, str]] = []
    held: list[int] = []

    async def kubelet_probes() -> None:
        start = loop.time()
        while loop.time() - start < WINDOW:
            tick = loop.time()
            paths = ("/healthz", "/readyz", "/metrics")
            results = await asyncio.gather(*(_get(kubelet, base + path) for path in paths))
            probes.extend((path, *result) for path, result in zip(paths, results, strict=True))
            held.append(flood.counts.get("held", 0))
            await asyncio.sleep(max(0.0, PROBE_PERIOD - (loop.time() - tick)))

    async def prometheus_scrapes() -> None:
        start = loop.time()
        while loop.time() - start < WINDOW:
            tick = loop.time()
            scrapes.append(await _get(prometheus, base + "/metrics"))
            await asyncio.sleep(max(0.0, 1.0 - (loop.time() - tick)))

    try:
        await asyncio.gather(kubelet_probes(), prometheus_scrapes())
    finally:
        await kubelet.close()
        await prometheus.close()
    after = dict(flood.counts)

    # The attack held on throughout: the listener stayed (nearly) full of the attacker's connections.
    assert held and min(held) >= OPS_LIMITS.max_connections - 64, (held, flood.lines[-3:])
    assert after["opened"] > before["opened"], (before, after)
    failed = [p for p in probes if p[1] != 200 or p[2] >= PROBE_TIMEOUT]
    assert len(probes) >= 3 * int(WINDOW / PROBE_PERIOD) * 0.8, len(probes)
    assert not failed, f"{len(failed)} of {len(probes)} probes failed, e.g. {failed[:5]}; attacker {after}"
    bad_scrapes = [s for s in scrapes if s[0] != 200 or s[1] >= PROBE_TIMEOUT]
    assert len(scrapes) >= WINDOW * 0.8, len(scrapes)
    assert not bad_scrapes, f"{len(bad_scrapes)} of {len(scrapes)} scrapes failed, e.g. {bad_scrapes[:5]}"
    slowest = max(p[2] for p in probes)
    print(f"{len(probes)} probes, slowest {slowest * 1000:.0f} ms; {len(scrapes)} scrapes, slowest "
          f"{max(s[1] for s in scrapes) * 1000:.0f} ms; attacker before {before}, after {after}")
