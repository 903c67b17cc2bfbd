"""Live scrapes while the gateway writes a backlog back (issue 32 item 2: within 1.5x of normal).

A real gateway and agent (processes, TLS tunnel), simulated dcgm-exporter nodes, and a remote-write receiver in its
own process that takes every request (204) without decoding it. The agent starts with a backlog already on its
volume (``backfill.directory``): --minutes of --nodes nodes at --interval, dcgm-exporter pages (50 KB), made
here with the agent's own Backlog. A client scrapes --live nodes through the front end at --rate scrapes a second
throughout. The receiver first answers 503 (the gateway holds the first request and retries: no catch-up), then
204 (the catch-up runs), and the run goes on for as long again after the backlog is written. Printed: the live
scrapes' p50/p99/max before, during and after the catch-up, the ratios during/normal, and the catch-up's rate.

    .venv/bin/python -m bench.bench_catchup [--nodes 200] [--minutes 30] [--interval 15] [--rate 20] \\
        [--agent-rate 2097152] [--batch-bytes 1048576] [--concurrency 2] [--samples-per-request N] \\
        [--cpu-share S] [--build-timeout 60]    (the gateway's settings: their defaults unless given)

This is a benchmark, not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from agent.backlog import Backlog
from raven.config.backfill import GatewayBackfill
from raven.demo.dcgm_page import NodeModel
from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.metrics import metric_values

RECEIVER = """
import sys
from aiohttp import web
status = [503]
async def write(request):
    await request.read()
    return web.Response(status=status[0])
async def flip(request):
    status[0] = int(request.query["status"])
    return web.Response(status=204)
app = web.Application(client_max_size=64 << 20)
app.router.add_post("/api/v1/write", write)
app.router.add_post("/status", flip)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def make_backlog(directory: Path, names: list[str], port: int, minutes: float, interval: float) -> int:
    models = [NodeModel(n, interval=interval) for n in names]
    b = Backlog(directory=directory)
    ticks = int(minutes * 60 / interval)
    t0 = time.time() - minutes * 60 - 60
    for tick in range(ticks):
        for name, m in zip(names, models, strict=True):
            b.add(name, port, int((t0 + tick * interval) * 1000), m.render(tick))
    return b.scrapes


def quantiles(ms: list[float]) -> str:
    if len(ms) < 2:
        return f"{len(ms)} scrapes"
    q = statistics.quantiles(ms, n=100)
    return f"{len(ms):5d} scrapes  p50 {q[49]:6.1f} ms  p99 {q[98]:6.1f} ms  max {max(ms):6.1f} ms"


async def live(cluster: LocalCluster, nodes: list[SimNode], rate: float, stop: asyncio.Event,
               out: list[tuple[float, float, int]]) -> None:
    """Scrape the live nodes round robin at ``rate`` a second, each scrape on its own (as Prometheus's targets)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

        async def one(node: SimNode) -> None:
            start = time.perf_counter()
            status = 0
            try:
                async with http.get(f"{cluster.front_url}/metrics", headers={
                        "Host": f"{node.name}:{node.port}", "Accept": "text/plain;version=0.0.4"}) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            out.append((time.time(), (time.perf_counter() - start) * 1000, status))

        tasks: set[asyncio.Task[None]] = set()
        k = 0
        begin = time.perf_counter()
        while not stop.is_set():
            task = asyncio.get_running_loop().create_task(one(nodes[k % len(nodes)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
            await asyncio.sleep(max(0.0, begin + k / rate - time.perf_counter()))
        await asyncio.gather(*tasks)


async def backlog_scrapes(cluster: LocalCluster) -> float:
    total = 0.0
    for agent in cluster.agents.values():
        total += sum((await metric_values(agent.metrics_port, "raven_agent_backfill_backlog_scrapes")).values())
    return total


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="raven-catchup-"))
    hosts = [f"127.0.10.{2 + i}" for i in range(args.live)]
    port = free_port(hosts[0], tuple(hosts[1:]))
    live_nodes = [SimNode(f"live-{i + 1}", host, port) for i, host in enumerate(hosts)]
    kept_nodes = [SimNode(f"kept-{i + 1}", "127.0.0.1", port) for i in range(args.nodes)]
    start = time.perf_counter()
    scrapes = make_backlog(work / "backlog", [n.name for n in kept_nodes], port, args.minutes, args.interval)
    print(f"backlog: {scrapes} scrapes ({args.minutes:g} minutes of {args.nodes} nodes at {args.interval:g} s), "
          f"made in {time.perf_counter() - start:.0f} s")
    rw_port = free_port()
    receiver = await asyncio.create_subprocess_exec(sys.executable, "-c", RECEIVER, str(rw_port),
                                                    stdout=asyncio.subprocess.DEVNULL)
    exporter = SimExporter(live_nodes, serve_gzip=False)
    cluster = LocalCluster(
        work, [PoolSpec("pool-c", live_nodes + kept_nodes, agents=1)], allowed_ports=[port],
        gateway_settings={"backfill": {"receivers": [{"url": f"http://127.0.0.1:{rw_port}/api/v1/write"}],
                                       "jobs": {port: "edge-dcgm"}, "poll_interval": 1, "retry_max": 2,
                                       "concurrency": args.concurrency,
                                       "samples_per_request": args.samples_per_request,
                                       "cpu_share": args.cpu_share, "build_timeout": args.build_timeout}},
        agent_settings={"backfill": {"directory": str(work / "backlog"), "rate": args.agent_rate,
                                     "batch_bytes": args.batch_bytes}},
    )
    samples: list[tuple[float, float, int]] = []
    stop = asyncio.Event()
    try:
        await exporter.start()
        await cluster.start()
        scraper = asyncio.get_running_loop().create_task(live(cluster, live_nodes, args.rate, stop, samples))
        await asyncio.sleep(args.normal)
        async with aiohttp.ClientSession() as http:
            await http.post(f"http://127.0.0.1:{rw_port}/status?status=204")
        began = time.time()
        while await backlog_scrapes(cluster) > 0:
            await asyncio.sleep(0.5)
            if time.time() - began > args.max_catchup:
                print(f"the catch-up did not end within {args.max_catchup:g} s: stopped there")
                break
        ended = time.time()
        await asyncio.sleep(args.normal)
        stop.set()
        await scraper
    finally:
        await cluster.close()
        await exporter.close()
        receiver.terminate()
        await receiver.wait()
        shutil.rmtree(work, ignore_errors=True)
    took = ended - began
    before = [ms for at, ms, st in samples if at < began and st == 200 and at > samples[0][0] + 2]
    during = [ms for at, ms, st in samples if began + 2 < at < ended and st == 200]
    after = [ms for at, ms, st in samples if at > ended + 1 and st == 200]
    failed = sum(1 for _, _, st in samples if st != 200)
    print(f"catch-up: {scrapes} scrapes in {took:.0f} s ({scrapes / took:.0f} scrapes/s); live scrapes failed: "
          f"{failed}")
    print(f"live before: {quantiles(before)}")
    print(f"live during: {quantiles(during)}")
    print(f"live after:  {quantiles(after)}")
    normal = before + after
    if len(normal) > 2 and len(during) > 2:
        qn, qd = statistics.quantiles(normal, n=100), statistics.quantiles(during, n=100)
        print(f"during / normal: p50 {qd[49] / qn[49]:.2f}x  p99 {qd[98] / qn[98]:.2f}x  "
              f"max {max(during) / max(normal):.2f}x  (the goal: within 1.5x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=200, help="nodes in the backlog")
    ap.add_argument("--minutes", type=float, default=30, help="minutes of outage in the backlog")
    ap.add_argument("--interval", type=float, default=15, help="their scrape interval (s)")
    ap.add_argument("--live", type=int, default=4, help="nodes scraped live (at most 10)")
    ap.add_argument("--rate", type=float, default=20, help="live scrapes a second")
    ap.add_argument("--normal", type=float, default=20, help="seconds of live scrapes before and after")
    ap.add_argument("--max-catchup", type=float, default=600, help="stop the catch-up after this long (s)")
    ap.add_argument("--agent-rate", type=float, default=2 * 1024 * 1024, help="agent backfill.rate (bytes/s)")
    ap.add_argument("--batch-bytes", type=int, default=1024 * 1024, help="agent backfill.batch_bytes")
    ap.add_argument("--concurrency", type=int, default=2, help="gateway backfill.concurrency")
    defaults = GatewayBackfill()
    ap.add_argument("--samples-per-request", type=int, default=defaults.samples_per_request,
                    help="gateway backfill.samples_per_request")
    ap.add_argument("--cpu-share", type=float, default=defaults.cpu_share, help="gateway backfill.cpu_share")
    ap.add_argument("--build-timeout", type=float, default=defaults.build_timeout,
                    help="gateway backfill.build_timeout (s)")
    args: Any = ap.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
