"""The testbed with a busy edge site behind a bad uplink (issue 20): Prometheus scrapes ``count`` simulated
dcgm-exporter nodes of site a (one simexporter process, one address each) through the tunnel over a shaped
uplink, with the product's default tunnel settings (heartbeat, window, the agents' reconnect backoff) rather
than the fast ones the other testbed tests use. Site b keeps its two nodes on a clean link, as a control.

Used by tests/e2e/test_uplinks.py (correctness) and bench/bench_uplink.py (the figures in docs/uplinks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.support.errors import TestbedError
from tests.support.paths import ROOT
from tests.support.testbed import CLOUD_IP, GATEWAY_OPS, PROMETHEUS, Testbed

BUSY_SITE = 0  # site a
LAN_HOST = "rv-a-n1"  # the namespace whose eth0 carries every simulated node's address
BLOB_PORT = 9100  # the first node's other port: incompressible bodies for bulk downloads (tests/support/blobserver.py)
DOWNLOAD_TIMEOUT = 120  # the front end's request_timeout here: a 2 MiB download on a lossy link takes tens of seconds


@dataclass(frozen=True)
class Link:
    name: str
    rtt_ms: int
    loss_pct: float
    rate_kbit: int


LOSSY = Link("lossy", 150, 1.0, 5000)


class LinkBed(Testbed):
    def __init__(self, workdir: Path | None = None, count: int = 50, scrape_interval: float = 5.0) -> None:
        if not 1 <= count <= 100:
            raise TestbedError("count: 1 to 100 simulated nodes")
        super().__init__(workdir, scrape_interval=scrape_interval)
        self.count = count
        site = self.sites[BUSY_SITE]
        site.nodes = {f"gpu-a-{i}": f"10.201.1.{100 + i}" for i in range(1, count + 1)}

    @property
    def busy(self) -> Any:
        return self.sites[BUSY_SITE]

    @property
    def blob_node(self) -> tuple[str, str]:
        """The node whose port ``BLOB_PORT`` serves bulk downloads: (name, address)."""
        name, address = min(self.busy.nodes.items())
        return str(name), str(address)

    async def downloads(self, count: int, until: float) -> list[asyncio.subprocess.Process]:
        """``count`` download loops from the cloud through the tunnel, each fetching 2 MiB again and again until
        ``until`` (Unix time); each prints a JSON line per download."""
        argv = [sys.executable, "-m", "tests.support.blobserver", "get", "--gateway", f"{CLOUD_IP}:{BLOB_PORT}",
                "--host", f"{self.blob_node[0]}:{BLOB_PORT}", "--token-file", str(self.token_file),
                "--until", f"{until:.3f}"]
        procs = []
        for _ in range(count):
            procs.append(await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", "rv-cloud", *argv, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=ROOT))
        return procs

    def make_files(self) -> None:
        super().make_files()
        # The product's defaults where the other tests shorten them: heartbeat and the agents' backoff.
        agents = [self.workdir / f"{a}.yaml" for s in self.sites for a in s.agents]
        for path in [self.workdir / "gateway.yaml", *agents]:
            tree = yaml.safe_load(path.read_text())
            tree.pop("limits", None)
            # This bed has no on-cloud node: only the tunnel sites whose uplinks it shapes.
            tree.pop("pools", None)
            if "gateway" in tree:
                for key in ("backoff_initial", "backoff_max"):
                    tree["gateway"].pop(key, None)
            if "front" in tree:  # scrapes keep Prometheus's own timeout (its header lowers this)
                tree["front"]["request_timeout"] = DOWNLOAD_TIMEOUT
            path.write_text(yaml.safe_dump(tree, sort_keys=False))
        interval = f"{self.scrape_interval:g}s"
        bearer = {"type": "Bearer", "credentials_file": str(self.token_file)}
        self._write("prometheus.yml", {
            "global": {"scrape_interval": interval, "scrape_timeout": f"{min(self.scrape_interval, 10):g}s",
                       "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": "edge-dcgm", "authorization": bearer,
                 "http_sd_configs": [{"url": "http://127.0.0.1:10265/sd?port=9400", "refresh_interval": "5s",
                                      "authorization": bearer}]},
                {"job_name": "raven-gateway", "static_configs": [{"targets": ["127.0.0.1:10265"]}]},
            ],
        })

    def edge_targets(self) -> list[str]:
        return sorted(f"{n}:9400" for s in self.sites for n in s.nodes)

    async def start(self) -> None:
        await self.topology("up")
        self.make_files()
        for address in self.busy.nodes.values():
            await self._ip("-n", LAN_HOST, "addr", "add", f"{address}/24", "dev", "eth0")
        specs = [a for n, addr in sorted(self.busy.nodes.items()) for a in ("--node", f"{n}={addr}:9400")]
        await self.spawn("dcgm-site-a", LAN_HOST, [sys.executable, "-m", "raven.demo.simexporter", "--stats-interval",
                                                  "3600", *specs])
        await self.spawn("blob-site-a", LAN_HOST, [sys.executable, "-m", "tests.support.blobserver", "serve",
                                                  "--listen", f"{self.blob_node[1]}:{BLOB_PORT}"])
        other = self.sites[1 - BUSY_SITE]
        for node, address in other.nodes.items():
            await self.spawn(f"dcgm-{node}", f"rv-{other.name}-n{node[-1]}",
                             [sys.executable, "-m", "raven.demo.simexporter", "--node", f"{node}={address}:9400"])
        dnsmasq = shutil.which("dnsmasq", path="/usr/sbin:/usr/bin:/sbin:/bin")
        prometheus = shutil.which("prometheus")
        if dnsmasq is None or prometheus is None:
            raise TestbedError("dnsmasq (dnsmasq-base) and prometheus (Debian packages) are required")
        await self.spawn("dnsmasq", "rv-cloud", [
            dnsmasq, "--keep-in-foreground", "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv",
            "--no-hosts", f"--hostsdir={self.hosts_dir}", "--user=root", "--group=root", "--pid-file=",
            "--cache-size=0", "--log-facility=-",
        ])
        await self.start_gateway()
        for site in self.sites:
            for agent in site.agents:
                await self.start_agent(site, agent)
        await self.start_prometheus(prometheus)

    @staticmethod
    async def _ip(*args: str) -> None:
        proc = await asyncio.create_subprocess_exec("ip", *args, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise TestbedError(f"ip {' '.join(args)}: {err.decode(errors='replace').strip()}")

    async def wait_all_up(self, timeout: float = 60.0) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            try:
                up = await self.query('up{job="edge-dcgm"}')
                if sorted(up) == self.edge_targets() and all(v == 1 for v in up.values()):
                    return loop.time() - start
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
                pass
            if loop.time() - start > timeout:
                raise TestbedError(f"not every edge target up within {timeout:.0f}s")
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------ measuring

    async def samples(self, metric: str, pool: str, since: float, until: float) -> dict[str, list[tuple[float, float]]]:
        """Every raw sample of ``metric`` for the pool's targets scraped in [since, until] (Unix time)."""
        span = max(1, int(until - since + 1))
        data = await self.get_json(PROMETHEUS + "/api/v1/query", {
            "query": f'{metric}{{job="edge-dcgm", pool="{pool}"}}[{span}s]', "time": f"{until:.3f}"})
        out: dict[str, list[tuple[float, float]]] = {}
        for r in data["data"]["result"]:
            points = [(float(t), float(v)) for t, v in r["values"] if float(t) >= since]
            out[r["metric"]["node"]] = points
        return out

    async def scrape_figures(self, pool: str, since: float, until: float) -> dict[str, float]:
        """Scrapes in the window: how many, how many failed, their duration's p50, p99 and max (seconds)."""
        up = await self.samples("up", pool, since, until)
        durations = await self.samples("scrape_duration_seconds", pool, since, until)
        ups = [v for points in up.values() for _, v in points]
        ok_durations = sorted(d for node, points in durations.items() for (t, d) in points
                              if dict(up.get(node, [])).get(t) == 1.0)
        if not ok_durations:
            return {"scrapes": len(ups), "failed": float(ups.count(0.0)), "p50": float("nan"), "p99": float("nan"),
                    "max": float("nan")}
        q = statistics.quantiles(ok_durations, n=100, method="inclusive") if len(ok_durations) > 1 else \
            [ok_durations[0]] * 99
        return {"scrapes": len(ups), "failed": float(ups.count(0.0)), "p50": q[49], "p99": q[98],
                "max": ok_durations[-1]}

    async def first_up_after(self, pool: str, since: float, until: float) -> dict[str, float]:
        """Per node of the pool: seconds from ``since`` to its first successful scrape (inf if none)."""
        up = await self.samples("up", pool, since, until)
        return {node: next((t - since for t, v in points if v == 1.0), float("inf")) for node, points in up.items()}

    def heartbeat_drops(self) -> dict[str, int]:
        """Sessions ended by the heartbeat, per process, from the logs (both ends of every session)."""
        out = {}
        for name, p in self.processes.items():
            if name == "gateway" or name.startswith("agent-"):
                text = p.log.read_text(errors="replace") if p.log.exists() else ""
                out[name] = len(re.findall(r"heartbeat timeout: peer silent for [0-9.]+s \(deadline", text))
        return out

    async def sessions_of(self, pool: str) -> int:
        status = await self.get_json(GATEWAY_OPS + "/status")
        return sum(len(p["agents"]) for p in status["pools"] if p["pool"] == pool)


# ------------------------------------------------------------ the two phases (shared by the test and the bench)

async def lossy_phase(bed: LinkBed, link: Link, seconds: float, downloads: int = 0) -> dict[str, Any]:
    """Shape the busy site's uplink, let it settle for two scrape intervals, then scrape through it for
    ``seconds``: the scrape figures, and the sessions the heartbeat dropped although the link was up.

    ``downloads``: that many incompressible 2 MiB downloads from the site's first node run through the same
    tunnel from the start of the settling until the window's end, one after another per loop (issue 29 item 9);
    their figures come back too (completed, bytes, errors)."""
    await bed.shape_uplink(bed.busy, link.rtt_ms, link.loss_pct, link.rate_kbit)
    started = time.time()
    procs = await bed.downloads(downloads, started + 2 * bed.scrape_interval + seconds) if downloads else []
    try:
        await asyncio.sleep(2 * bed.scrape_interval)
        drops_before = bed.heartbeat_drops()
        since = time.time()
        await asyncio.sleep(seconds)
        until = time.time()
        lines = []
        for proc in procs:
            async with asyncio.timeout(30):
                out, _ = await proc.communicate()
            lines += [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    await asyncio.sleep(min(bed.scrape_interval, 10) + 1)  # the last scrapes of the window end and are stored
    figures = await bed.scrape_figures(bed.busy.pool, since, until)
    drops = {k: v - drops_before.get(k, 0) for k, v in bed.heartbeat_drops().items()}
    done = [d for d in lines if d.get("status") == 200]
    return {"link": link, "seconds": until - since, **figures, "heartbeat_drops": sum(drops.values()),
            "drops_by_process": {k: v for k, v in drops.items() if v}, "downloads": len(done),
            "download_bytes": sum(int(d["bytes"]) for d in lines), "download_seconds": until - started,
            "download_errors": [d for d in lines if "error" in d or d.get("status", 200) != 200]}


async def outage_phase(bed: LinkBed, link: Link, seconds: float, bound: float) -> dict[str, Any]:
    """Cut the (shaped) uplink for ``seconds``, restore it, and time the way back: until the gateway holds a
    session of every agent of the site again, and until every node's next scrape succeeded (within ``bound``
    seconds of the return; a node not back by then counts as inf)."""
    loop = asyncio.get_running_loop()
    site = bed.busy
    await bed.shape_uplink(site, link.rtt_ms, 100, link.rate_kbit)
    cut = loop.time()
    sessions_gone = float("inf")
    down_during_cut = -1  # the site's targets Prometheus recorded as up == 0 near the cut's end
    while loop.time() - cut < seconds:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
            if sessions_gone == float("inf"):
                if await bed.sessions_of(site.pool) == 0:
                    sessions_gone = loop.time() - cut
            elif down_during_cut < 0 and loop.time() - cut > seconds - 3:
                up = await bed.query(f'up{{job="edge-dcgm", pool="{site.pool}"}}')
                down_during_cut = sum(1 for v in up.values() if v == 0.0)
        await asyncio.sleep(0.25)
    await bed.shape_uplink(site, link.rtt_ms, link.loss_pct, link.rate_kbit)
    back_at = time.time()
    back = loop.time()
    sessions_back = float("inf")
    while loop.time() - back < bound:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
            if await bed.sessions_of(site.pool) >= len(site.agents):
                sessions_back = loop.time() - back
                break
        await asyncio.sleep(0.1)
    nodes_back: dict[str, float] = {}
    while loop.time() - back < bound:
        await asyncio.sleep(1)
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
            nodes_back = await bed.first_up_after(site.pool, back_at, time.time())
            if len(nodes_back) == len(site.nodes) and max(nodes_back.values()) < float("inf"):
                break
    worst = max(nodes_back.values()) if len(nodes_back) == len(site.nodes) else float("inf")
    return {"link": link, "outage": seconds, "sessions_gone_after": sessions_gone, "sessions_back_after": sessions_back,
            "every_node_up_after": worst, "nodes_back": nodes_back, "down_during_cut": down_during_cut}
