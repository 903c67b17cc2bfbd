"""Benchmark: a fleet at the real scrape rate, connected as Prometheus connects.

One real gateway (bearer token, as in production), --pools real agents of --nodes-per-pool node names each
(10 x 1,000 by default; each pool's names share one simulated dcgm-exporter process listener), and a load
generator that scrapes every name at a paced --rate (667/s: 10,000 targets every 15 s) for --duration seconds
after --warmup, in two modes:

- ``pool``: Host-header requests over a pool of --pool-size keep-alive connections;
- ``per-node``: one keep-alive connection per node name, as Prometheus holds them in DNS mode (every name
  resolves to the gateway: the client's resolver here answers the gateway's address for every name).

It prints, per mode: achieved rate, failures by status, latency p50/p99/p99.9/max, CPU milliseconds per scrape
of the gateway and of the agents together, the gateway's and the agents' RSS and descriptor slopes over the
run (per minute, from samples every 5 s), and the longest GC pause per process where the services expose
one (any ``raven_gc_*`` metric with ``max`` or ``longest`` in its name).

    .venv/bin/python bench/bench_fleet.py --duration 600

This is a benchmark, not a test: its figures depend on the machine (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import resource
import secrets
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from prometheus_client.parser import text_string_to_metric_families

from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simexporter import SimNode


class EverythingIsTheGateway(AbstractResolver):
    """DNS mode: every node name resolves to the gateway's address."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        return [{"hostname": host, "host": self.address, "port": port, "family": socket.AF_INET, "proto": 0,
                 "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        return None


def proc_stat(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, RSS KiB, open descriptors) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") // 1024
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = -1
    return cpu, rss, fds


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope per minute."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    den = sum((t - mx) ** 2 for t, _ in samples)
    return 60 * sum((t - mx) * (v - my) for t, v in samples) / den if den else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def gc_pauses(port: int) -> float | None:
    """The longest GC pause a service reports (seconds), if it exposes one."""
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name.startswith("raven_gc_") and ("max" in s.name or "longest" in s.name)]
    return max(found) if found else None


@dataclass
class Run:
    mode: str
    latencies: list[float] = field(default_factory=list)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    sent: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    rss: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))
    fds: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))


async def paced(cluster: LocalCluster, names: list[str], port: int, token: str, mode: str, rate: float,
                seconds: float, pool_size: int, pids: dict[str, list[int]], run: Run | None) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    if mode == "pool":
        connector = aiohttp.TCPConnector(limit=pool_size, force_close=False, keepalive_timeout=60)
    else:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=1, keepalive_timeout=60,
                                         resolver=EverythingIsTheGateway("127.0.0.1"), ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=10)
    order = names[:]
    random.Random(1).shuffle(order)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as http:
        front = cluster.front_port

        async def one(name: str) -> None:
            start = time.perf_counter()
            if mode == "pool":
                url, extra = f"http://127.0.0.1:{front}/metrics", {"Host": f"{name}:{port}"}
            else:  # Prometheus in DNS mode: http://<node>:<port>/metrics, the Service maps the port to the front end
                url, extra = f"http://{name}:{front}/metrics", {"Host": f"{name}:{port}"}
            try:
                async with http.get(url, headers=extra) as resp:
                    await resp.read()
                    code = str(resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                code = type(exc).__name__
            if run is not None:
                if code == "200":
                    run.latencies.append(time.perf_counter() - start)
                else:
                    run.failures[code] += 1

        tasks: set[asyncio.Task[None]] = set()
        t0 = time.monotonic()
        next_sample = t0
        cpu0 = {k: sum(proc_stat(p)[0] for p in v) for k, v in pids.items()}
        i = 0
        while True:
            now = time.monotonic()
            if now - t0 >= seconds:
                break
            if run is not None and now >= next_sample:
                for kind, group in pids.items():
                    stats = [proc_stat(p) for p in group]
                    run.rss[kind].append((now - t0, sum(s[1] for s in stats)))
                    run.fds[kind].append((now - t0, sum(s[2] for s in stats)))
                next_sample += 5
            due = int((now - t0) * rate)
            while i < due:
                task = asyncio.get_running_loop().create_task(one(order[i % len(order)]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            await asyncio.sleep(0.002)
        if tasks:
            await asyncio.wait(tasks, timeout=15)
        if run is not None:
            run.sent = i
            run.seconds = time.monotonic() - t0
            run.cpu = {k: sum(proc_stat(p)[0] for p in v) - cpu0[k] for k, v in pids.items()}


async def main(args: argparse.Namespace) -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    total = args.pools * args.nodes_per_pool
    if hard < total + 1024:
        print(f"bench: the open-files limit {hard} is too low for {total} connections", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="raven-fleet-"))
    port = free_port("127.0.30.1")
    exporters = [SimNode(f"exporter-{p}", f"127.0.30.{p + 1}", port, size=args.size) for p in range(args.pools)]
    pools = [PoolSpec(f"pool-{p}", [SimNode(f"node-{p}-{k}", exporters[p].host, port)
                                    for k in range(args.nodes_per_pool)], agents=1) for p in range(args.pools)]
    names = [n.name for pool in pools for n in pool.nodes]
    token = secrets.token_hex(32)
    exporter_cmd = [sys.executable, "-m", "raven.demo.simexporter", "--size", str(args.size), "--gpus", "8",
                    "--stats-interval", "3600",
                    *(a for e in exporters for a in ("--node", f"{e.name}={e.host}:{port}"))]
    exporter = await asyncio.create_subprocess_exec(*exporter_cmd, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=(workdir / "exporter.log").open("wb"))
    cluster = LocalCluster(workdir, pools, allowed_ports=[port], front_token=token,
                           gateway_settings={"log_level": "warning", **args.gateway_settings},
                           agent_settings={"log_level": "warning"})
    results: list[Run] = []
    try:
        await asyncio.sleep(1)
        await cluster.start(timeout=120)
        assert cluster.gateway is not None
        pids = {"gateway": [cluster.gateway.process.pid],
                "agents": [a.process.pid for a in cluster.agents.values()]}
        print(f"{total} nodes in {args.pools} pools, {args.size} B pages, {args.rate:g} scrapes/s, "
              f"{args.warmup:g}s warm-up + {args.duration:g}s per mode; one gateway, {args.pools} agents (TLS 1.3)")
        for mode in args.modes:
            await paced(cluster, names, port, token, mode, args.rate, args.warmup, args.pool_size, pids, None)
            run = Run(mode)
            await paced(cluster, names, port, token, mode, args.rate, args.duration, args.pool_size, pids, run)
            results.append(run)
            report(run, args)
        gc = {"gateway": await gc_pauses(cluster.gateway_metrics_port)}
        for name, agent in cluster.agents.items():
            gc[name] = await gc_pauses(agent.metrics_port)
        if any(v is not None for v in gc.values()):
            print("longest GC pause: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in gc.items() if v is not None))
        else:
            print("longest GC pause: the services expose no raven_gc_* metric")
    finally:
        await cluster.close()
        exporter.terminate()
        await exporter.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(not r.failures for r in results) else 2


def report(run: Run, args: argparse.Namespace) -> None:
    ok = len(run.latencies)
    ms = [v * 1000 for v in run.latencies]
    print(f"\n{run.mode}: {run.sent} scrapes sent in {run.seconds:.0f}s, {ok / run.seconds:.0f}/s answered 200 "
          f"(target {args.rate:g}/s); failures: {dict(run.failures) or 'none'}")
    print(f"  latency ms: p50 {pct(ms, 0.5):.1f}  p99 {pct(ms, 0.99):.1f}  p99.9 {pct(ms, 0.999):.1f}  "
          f"max {max(ms, default=float('nan')):.1f}")
    scrapes = max(1, run.sent)
    print(f"  CPU ms per scrape: gateway {run.cpu['gateway'] * 1000 / scrapes:.3f}, "
          f"agents {run.cpu['agents'] * 1000 / scrapes:.3f}")
    for kind in ("gateway", "agents"):
        first_rss = run.rss[kind][0][1] if run.rss[kind] else 0
        first_fds = run.fds[kind][0][1] if run.fds[kind] else 0
        print(f"  {kind}: RSS {first_rss / 1024:.0f} MiB, slope {slope(run.rss[kind]):+.0f} KiB/min; "
              f"descriptors {first_fds:.0f}, slope {slope(run.fds[kind]):+.1f}/min")


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", type=int, default=10, help="pools, one agent each (default 10)")
    parser.add_argument("--nodes-per-pool", type=int, default=1000, help="node names per pool (default 1000)")
    parser.add_argument("--rate", type=float, default=667, help="scrapes per second (default 667)")
    parser.add_argument("--duration", type=float, default=600, help="measured seconds per mode (default 600)")
    parser.add_argument("--warmup", type=float, default=30, help="seconds before measuring (default 30)")
    parser.add_argument("--size", type=int, default=50 * 1024, help="page size in bytes (default 51200)")
    parser.add_argument("--pool-size", type=int, default=200, help="connections in pool mode (default 200)")
    parser.add_argument("--modes", nargs="+", choices=["pool", "per-node"], default=["pool", "per-node"])
    args = parser.parse_args()
    args.gateway_settings = {}
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main(args))
    return int(uvloop.run(main(args)))


if __name__ == "__main__":
    sys.exit(cli())
