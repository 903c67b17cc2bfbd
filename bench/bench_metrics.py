"""Benchmark: what reading Raven's own /metrics costs the tunnel, and the longest GC pause of each process.

One gateway and one agent (real processes, TLS 1.3 tunnel) in front of --nodes simulated dcgm-exporters (one
listener each, on 127.1.x.y), every node scraped once to warm the agent's connections. Then a paced load of
--rate scrapes/s over all node names through the front end (bearer token, Host mode, a pool of keep-alive
connections), in phases of --duration seconds that alternate:

- quiet: nothing else;
- read: a reader also fetches the gateway's and the agent's /metrics every --interval seconds (as Prometheus
  scraping both services would).

It prints, per kind of phase: scrapes, failures, p50/p99/max latency, and the ratio of the p99s (goal: read within
1.2x of quiet); the size and fetch time of each /metrics page; the agent's open descriptors; and the longest
garbage-collector pause of each process by generation (``raven_gc_pause_max_seconds``).

    .venv/bin/python bench/bench_metrics.py --nodes 1000 --rate 100 --duration 60 --rounds 2

With --no-gc-tuning the services run with RAVEN_GC_TUNING=off (pauses timed, no freeze, default thresholds):
the "before" figure for the GC pauses. This is a benchmark, not a test: numbers depend on the machine and on
what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from raven.demo.launch import LocalCluster, PoolSpec, Proc, free_port
from raven.demo.simexporter import SimExporter, SimNode


@dataclass
class Phase:
    kind: str
    latencies: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)


@dataclass
class Page:
    sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def node_address(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(http: aiohttp.ClientSession, cluster: LocalCluster, names: list[str], port: int, rate: float,
               seconds: float, phase: Phase, token: str) -> None:
    """Paced scrapes: one every 1/rate seconds, round robin over the names, each in its own task."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: set[asyncio.Task[None]] = set()

    async def one(name: str) -> None:
        t = time.perf_counter()
        try:
            async with http.get(cluster.front_url + "/metrics",
                                headers={"Host": f"{name}:{port}", "Authorization": f"Bearer {token}"}) as r:
                await r.read()
                if r.status != 200:
                    phase.failures[str(r.status)] = phase.failures.get(str(r.status), 0) + 1
                    return
        except (aiohttp.ClientError, TimeoutError) as exc:
            phase.failures[type(exc).__name__] = phase.failures.get(type(exc).__name__, 0) + 1
            return
        phase.latencies.append(time.perf_counter() - t)

    i = 0
    while (now := loop.time()) < start + seconds:
        due = start + i / rate
        if due > now:
            await asyncio.sleep(due - now)
        task = asyncio.ensure_future(one(names[i % len(names)]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    await asyncio.gather(*tasks)


async def fetch(http: aiohttp.ClientSession, url: str, page: Page) -> str:
    t = time.perf_counter()
    async with http.get(url) as r:
        body = await r.read()
    page.seconds.append(time.perf_counter() - t)
    page.sizes.append(len(body))
    return body.decode()


async def reader(http: aiohttp.ClientSession, urls: dict[str, str], pages: dict[str, Page], interval: float,
                 stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.gather(*(fetch(http, url, pages[name]) for name, url in urls.items()))
        try:
            async with asyncio.timeout(interval):
                await stop.wait()
        except TimeoutError:
            pass


def gc_max(text: str) -> dict[str, float]:
    return {s.labels["generation"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "raven_gc_pause_max_seconds"}


def gc_buckets(text: str) -> dict[tuple[str, float], float]:
    """(generation, le) -> cumulative count of ``raven_gc_pause_seconds``."""
    return {(s.labels["generation"], float(s.labels["le"])): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "raven_gc_pause_seconds_bucket"}


def gc_window(before: dict[tuple[str, float], float], after: dict[tuple[str, float], float]) -> str:
    """Collections during the measured phases, per generation, and the bucket of the longest one."""
    out = []
    for gen in ("0", "1", "2"):
        les = sorted(le for g, le in after if g == gen)
        delta = {le: after[(gen, le)] - before.get((gen, le), 0.0) for le in les}
        total = delta[les[-1]] if les else 0
        longest = next((le for le in les if delta[le] == total), float("nan")) if total else 0.0
        out.append(f"gen {gen}: {total:.0f} collections, longest <= {longest * 1000:g} ms")
    return "; ".join(out)


def descriptors(proc: Proc) -> int:
    return len(os.listdir(f"/proc/{proc.process.pid}/fd"))


async def main(args: argparse.Namespace) -> int:
    port = free_port("127.1.0.1")
    nodes = [SimNode(f"edge-gpu-{i}", node_address(i), port, size=args.size) for i in range(args.nodes)]
    exporter = SimExporter(nodes, refresh=3600.0)  # pages rendered once: the bench's CPU is the client's
    await exporter.start()
    workdir = Path(tempfile.mkdtemp(prefix="raven-bench-metrics-"))
    token = secrets.token_hex(32)
    env = {"RAVEN_GC_TUNING": "off"} if args.no_gc_tuning else {}
    cluster = LocalCluster(workdir, [PoolSpec("bench", nodes, agents=1)], allowed_ports=[port], front_token=token,
                           env=env, gateway_settings={"log_level": "warning"},
                           agent_settings={"log_level": "warning"})
    names = [n.name for n in nodes]
    phases: list[Phase] = []
    pages = {"gateway": Page(), "agent": Page()}
    finished = False
    try:
        await cluster.start(timeout=120)
        assert cluster.gateway is not None
        agent = next(iter(cluster.agents.values()))
        urls = {"gateway": f"http://127.0.0.1:{cluster.gateway_metrics_port}/metrics",
                "agent": f"http://127.0.0.1:{agent.metrics_port}/metrics"}
        connector = aiohttp.TCPConnector(limit=args.connections)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http:
            warm = Phase("warm-up")
            await load(http, cluster, names, port, max(args.rate, 200), args.nodes / max(args.rate, 200), warm, token)
            print(f"{args.nodes} nodes, {args.size} B pages, {args.rate:g} scrapes/s, {args.connections} keep-alive "
                  f"connections, phases of {args.duration:g}s; warm-up: {len(warm.latencies)} ok, failures "
                  f"{warm.failures or 'none'}; GC tuning {'off' if args.no_gc_tuning else 'on'}", flush=True)
            gc_before = {name: gc_buckets(await fetch(http, url, Page())) for name, url in urls.items()}
            for _ in range(args.rounds):
                for kind in ("quiet", "read"):
                    phase = Phase(kind)
                    stop = asyncio.Event()
                    task = (asyncio.ensure_future(reader(http, urls, pages, args.interval, stop))
                            if kind == "read" else None)
                    await load(http, cluster, names, port, args.rate, args.duration, phase, token)
                    stop.set()
                    if task is not None:
                        await task
                    phases.append(phase)
                    print(f"  {kind:<5} p50 {pct(phase.latencies, 0.5) * 1000:6.2f} ms  p99 "
                          f"{pct(phase.latencies, 0.99) * 1000:6.2f} ms  max {max(phase.latencies) * 1000:7.1f} ms  "
                          f"({len(phase.latencies)} ok, failures {phase.failures or 'none'})", flush=True)
            ends = {name: await fetch(http, url, Page()) for name, url in urls.items()}
            gc_pauses = {name: gc_max(text) for name, text in ends.items()}
            gc_during = {name: gc_window(gc_before[name], gc_buckets(text)) for name, text in ends.items()}
        fds = descriptors(agent)
        finished = True
    finally:
        await cluster.close()
        await exporter.close()
        if finished:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir}", file=sys.stderr)

    print()
    summary: dict[str, float] = {}
    for kind in ("quiet", "read"):
        lat = [x for p in phases if p.kind == kind for x in p.latencies]
        failed = sum(n for p in phases if p.kind == kind for n in p.failures.values())
        summary[kind] = pct(lat, 0.99)
        print(f"{kind:<5}: {len(lat)} scrapes, {failed} failed, p50 {pct(lat, 0.5) * 1000:.2f} ms, "
              f"p99 {pct(lat, 0.99) * 1000:.2f} ms, max {max(lat) * 1000:.1f} ms")
    print(f"p99 while reading /metrics every {args.interval:g}s / p99 quiet: {summary['read'] / summary['quiet']:.2f} "
          "(goal <= 1.2)")
    for name, page in pages.items():
        if page.sizes:
            print(f"{name} /metrics: {max(page.sizes)} bytes, fetched in median "
                  f"{statistics.median(page.seconds) * 1000:.1f} ms, max {max(page.seconds) * 1000:.1f} ms "
                  f"({len(page.sizes)} reads)")
    print(f"agent open descriptors at the end: {fds}")
    for name, by_gen in gc_pauses.items():
        shown = ", ".join(f"gen {g}: {v * 1000:.1f} ms" for g, v in sorted(by_gen.items()))
        print(f"longest GC pause since start (start-up included), {name}: {shown}")
        print(f"GC during the measured phases, {name}: {gc_during[name]}")
    return 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="simulated nodes behind the agent (default 1000)")
    parser.add_argument("--size", type=int, default=8 * 1024, help="page size in bytes (default 8192)")
    parser.add_argument("--rate", type=float, default=100.0, help="scrapes per second (default 100)")
    parser.add_argument("--connections", type=int, default=64, help="keep-alive connections to the front end")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase (default 60)")
    parser.add_argument("--rounds", type=int, default=2, help="quiet/read pairs (default 2)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between /metrics reads (default 5)")
    parser.add_argument("--no-gc-tuning", action="store_true", help="run the services with RAVEN_GC_TUNING=off")
    args = parser.parse_args()
    if args.nodes > 250 * 250:
        parser.error("--nodes: at most 62500 (loopback addresses 127.1.x.y)")
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main(args))
    return int(uvloop.run(main(args)))


if __name__ == "__main__":
    sys.exit(cli())
