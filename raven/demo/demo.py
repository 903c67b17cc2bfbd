"""`raven demo`: the whole system on one machine, scraped by node name, with a failover."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode, gpu_util

POOLS = ("factory-a", "factory-b")


@dataclass
class Scrape:
    node: str
    pool: str
    agent: str
    status: int
    size: int
    millis: float
    gpu0: float | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.gpu0 is not None


async def scrape(http: aiohttp.ClientSession, proxy: str, node: str, pool: str, port: int) -> Scrape:
    start = time.monotonic()
    try:
        async with http.get(f"http://{node}:{port}/metrics", proxy=proxy) as resp:
            body = await resp.read()
            millis = (time.monotonic() - start) * 1000
            agent = resp.headers.get("X-Raven-Agent", "-")
            error = "" if resp.status == 200 else body.decode(errors="replace").strip()
            return Scrape(node, pool, agent, resp.status, len(body), millis, gpu_util(body), error)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Scrape(node, pool, "-", 0, 0, (time.monotonic() - start) * 1000, None, repr(exc))


def print_table(rows: list[Scrape]) -> None:
    print(f"  {'NODE':<12} {'POOL':<10} {'SERVED BY':<18} {'STATUS':>6} {'BYTES':>7} {'MS':>7}  GPU0 UTIL")
    for r in rows:
        gpu = f"{r.gpu0:.0f} %" if r.gpu0 is not None else "-"
        print(f"  {r.node:<12} {r.pool:<10} {r.agent:<18} {r.status:>6} {r.size:>7} {r.millis:>7.1f}  {gpu}")
        if r.error:
            print(f"      error: {r.error[:160]}")


def raven_command() -> str:
    """`raven` as a user can type it in any shell: its name when PATH finds this installation's, else its
    absolute path (scripts/demo.sh runs .venv/bin/raven, which is on no PATH), else this Python with -m."""
    beside = Path(sys.executable).with_name("raven")  # the console script of this interpreter's environment
    if beside.is_file() and os.access(beside, os.X_OK):
        on_path = shutil.which("raven")
        with contextlib.suppress(OSError):
            if on_path is not None and os.path.samefile(on_path, beside):
                return "raven"
        return shlex.quote(os.path.abspath(beside))
    return f"{shlex.quote(sys.executable)} -m raven.cli"


async def main(args: argparse.Namespace) -> int:
    per_pool = max(1, args.nodes_per_pool)
    workdir = Path(tempfile.mkdtemp(prefix="raven-demo-"))
    pools = []
    host = 2
    for index, pool_name in enumerate(POOLS):
        nodes = []
        for i in range(per_pool):
            nodes.append(SimNode(f"edge-gpu-{index * per_pool + i + 1}", f"127.0.0.{host}", 9400))
            host += 1
        pools.append(PoolSpec(pool_name, nodes, agents=2))
    exporter = SimExporter([n for p in pools for n in p.nodes])
    # Every edge name resolves to the front end's address (in Kubernetes: the Raven Service's ClusterIP).
    cluster = LocalCluster(workdir, pools, gateway_settings={"hosts": {"service_addresses": ["127.0.0.1"]}})
    failed: list[str] = []
    try:
        print(f"raven demo: work folder {workdir}")
        try:
            await exporter.start()
        except OSError as exc:
            print(f"raven demo: cannot start the simulated GPU nodes on 127.0.0.x:9400: {exc}")
            return 1
        print(f"  {sum(len(p.nodes) for p in pools)} simulated GPU nodes (dcgm-exporter format) on 127.0.0.2-"
              f"{host - 1}, port 9400")
        await cluster.start()
        print(f"  gateway: tunnel wss://127.0.0.1:{cluster.tunnel_port}/tunnel, front end {cluster.front_url}")
        for spec in pools:
            print(f"  pool {spec.name}: agents {', '.join(cluster.agent_names(spec))}; nodes "
                  f"{', '.join(n.name for n in spec.nodes)}")

        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            print("\n1. Scrape every node by name through the tunnel (Prometheus proxy_url mode):")
            rows = [await scrape(http, cluster.front_url, n.name, p.name, 9400) for p in pools for n in p.nodes]
            print_table(rows)
            failed += [f"{r.node}: status {r.status} {r.error}" for r in rows if not r.ok]

            pool = pools[0]
            victim = cluster.agent_names(pool)[0]
            print(f"\n2. Kill agent {victim} (SIGKILL) and scrape pool {pool.name} again:")
            await cluster.stop(cluster.agents[victim], signal.SIGKILL)
            rows = [await scrape(http, cluster.front_url, n.name, pool.name, 9400) for n in pool.nodes]
            print_table(rows)
            failed += [f"{r.node} after failover: status {r.status} {r.error}" for r in rows if not r.ok]
            failed += [f"{r.node} was served by the killed agent" for r in rows if r.agent == victim]

            print("\n3. What the gateway refuses, before any header is sent:")
            checks = [
                ("unknown node", "GET", "http://edge-gpu-99:9400/metrics", 404),
                ("port not allowed", "GET", f"http://{pools[1].nodes[0].name}:22/", 403),
                ("method not allowed", "DELETE", f"http://{pools[1].nodes[0].name}:9400/metrics", 405),
            ]
            for label, method, url, want in checks:
                async with http.request(method, url, proxy=cluster.front_url) as resp:
                    text = (await resp.text()).strip()
                print(f"  {label:<18} -> {resp.status}  {text}")
                if resp.status != want:
                    failed.append(f"{label}: expected {want}, got {resp.status}")

            print("\n4. The hosts file the gateway publishes (CoreDNS's hosts plugin serves it; here from /hosts):")
            async with http.get(f"http://127.0.0.1:{cluster.gateway_metrics_port}/hosts") as resp:
                hosts = await resp.text()
            print("".join(f"  {line}\n" for line in hosts.splitlines()))
            missing = [n.name for p in pools for n in p.nodes if f"\t{n.name}" not in hosts]
            if missing:
                failed.append(f"hosts file lacks {', '.join(missing)}")

        if args.keep_running:
            node = pools[1].nodes[0].name
            print("\nRunning. Try:")
            print(f"  curl -x {cluster.front_url} http://{node}:9400/metrics | head")
            print(f"  curl -H 'Host: {node}:9400' {cluster.front_url}/metrics | head")
            print(f"  curl {cluster.sd_url}          # Prometheus HTTP service discovery")
            print(f"  curl http://127.0.0.1:{cluster.gateway_metrics_port}/metrics | grep raven_")
            print(f"  {raven_command()} status --gateway http://127.0.0.1:{cluster.gateway_metrics_port}   # or open "
                  f"http://127.0.0.1:{cluster.gateway_metrics_port}/status.html")
            print("Press Ctrl-C to stop.")
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
    except RuntimeError as exc:
        failed.append(str(exc))
    finally:
        await cluster.close()
        await exporter.close()
    if failed:
        print("\nraven demo FAILED:")
        for line in failed:
            print(f"  - {line}")
        print(f"  logs kept in {workdir}")
        return 1
    with contextlib.suppress(OSError):
        shutil.rmtree(workdir)
    print("\nraven demo: all scrapes succeeded, failover worked.")
    return 0
