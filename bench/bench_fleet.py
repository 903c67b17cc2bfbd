"""Benchmark: a fleet at the real scrape rate, connected as Prometheus connects.

One real gateway (bearer token, as in production), --pools real agents of --nodes-per-pool node names each
(10 x 1,000 by default; each pool's names share one simulated dcgm-exporter process listener), and a load
generator of --workers processes (bench/loadgen.py: each owns a slice of the names and of the connections and
paces its share) that scrapes every name at --rate (667/s: 10,000 targets every 15 s) for --duration seconds
after --warmup, in these modes:

- ``pool``: Host-header requests over a pool of --pool-size keep-alive connections;
- ``per-node``: one keep-alive connection per node name, as Prometheus holds them in DNS mode (each opened at
  its name's first scrape, in the warm-up);
- ``direct``: the generator straight to the simulated exporter (no Raven), over a pool: what the generator and
  the exporter themselves add to a scrape.

It prints, per mode: achieved rate, failures by status, latency p50/p99/p99.9/max (from the request's write to
its last byte) and the worst one-second windows, the generator's own lag (how late scrapes were sent after they
were due) and CPU per scrape, CPU milliseconds per scrape of the gateway and of the agents, the gateway's and
the agents' RSS and descriptor slopes over the run (per minute, from samples every 5 s), the garbage
collections of each process during the measured window (from ``raven_gc_pause_seconds``), and the machine's
load average. With --read-metrics N a reader fetches the gateway's and every agent's /metrics every N seconds
(as Prometheus scraping both services would) in alternate --phase-seconds windows, and the p99 of those windows
is compared with the others' (goal: within 1.2x). With --views N the same windows read, every N seconds, what
Prometheus and an operator read from the gateway: ``/sd?port=P&group=pool`` (``--sd-group node``: one group per
node) and ``/metrics`` (as Prometheus, with ``Accept-Encoding: gzip``), every agent's ``/metrics`` (Prometheus
scrapes both services) and the status page ``/status.html`` (as a browser left open on it, gzip too); the scrapes'
p99 and max with and without those reads (and their ratios) are printed, and the reads' own sizes and times. /sd is
read once more at the warm-up's start, uncounted: Prometheus reads it before it scrapes the targets it lists.

    .venv/bin/python bench/bench_fleet.py --duration 600

This is a benchmark, not a test: its figures depend on the machine (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import functools
import json
import os
import resource
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simexporter import SimNode

LOADGEN = Path(__file__).with_name("loadgen.py")


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


async def fetch_metrics(http: aiohttp.ClientSession, port: int) -> str:
    try:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


def gc_buckets(text: str) -> dict[tuple[str, float], float]:
    """(generation, le) -> cumulative count of ``raven_gc_pause_seconds``."""
    return {(s.labels["generation"], float(s.labels["le"])): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "raven_gc_pause_seconds_bucket"}


def sample(text: str, name: str) -> float | None:
    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return found[0] if found else None


def gc_window(before: dict[tuple[str, float], float], after: dict[tuple[str, float], float]) -> str:
    """Collections between two readings, per generation, and the bucket of the longest one."""
    out = []
    for gen in ("0", "1", "2"):
        les = sorted(le for g, le in after if g == gen)
        delta = {le: after[(gen, le)] - before.get((gen, le), 0.0) for le in les}
        total = delta[les[-1]] if les else 0
        longest = next((le for le in les if delta[le] == total), float("nan")) if total else 0.0
        out.append(f"gen{gen} {total:.0f} (longest <= {longest * 1000:g} ms)")
    return ", ".join(out)


@dataclass
class Run:
    mode: str
    records: list[tuple[float, float, float, str]] = field(default_factory=list)  # due, lag, latency, status
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    rss: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))
    fds: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))
    load: list[float] = field(default_factory=list)
    gc: dict[str, str] = field(default_factory=dict)
    frozen: dict[str, float | None] = field(default_factory=dict)
    reading: list[tuple[float, float]] = field(default_factory=list)  # windows with the metrics reader on
    views: dict[str, list[tuple[int, int, float]]] = field(  # path -> (status, bytes on the wire, seconds)
        default_factory=lambda: collections.defaultdict(list))


async def fetch_view(http: aiohttp.ClientSession, url: str, headers: dict[str, str], run: Run, path: str) -> None:
    """One read as Prometheus or a browser makes it (gzip asked, the body read whole); its size and time kept."""
    started = time.monotonic()
    try:
        async with http.get(url, headers={"Accept-Encoding": "gzip", **headers}) as resp:
            size = len(await resp.read())
            run.views[path].append((resp.status, size, time.monotonic() - started))
    except (aiohttp.ClientError, TimeoutError):
        run.views[path].append((0, 0, time.monotonic() - started))


async def read_loop(reads: list[Callable[[aiohttp.ClientSession], Awaitable[Any]]], every: float, phase: float,
                    start: float, end: float, run: Run, at_once: bool = False) -> None:
    """Alternate windows of ``phase`` seconds: odd ones make ``reads`` every ``every`` seconds. Each read has its own
    offset in the interval, as Prometheus spreads its targets' scrapes over their interval (by a hash of each
    target); ``at_once`` makes them all at the same instant instead (a burst no scraper makes: the worst case)."""
    # auto_decompress off: the reader takes the gzipped bytes as they come (their size is what crossed the wire).
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), auto_decompress=False) as http:
        k = 0
        while start + k * phase < end:
            w0, w1 = start + k * phase, min(end, start + (k + 1) * phase)
            if k % 2:
                run.reading.append((w0, w1))
                n = 1 if at_once else len(reads)
                due = sorted((w0 + m * every + i * every / n, i) for m in range(int((w1 - w0) / every + 0.999))
                             for i in range(n))
                for t, i in due:
                    if t >= w1:
                        break
                    await asyncio.sleep(max(0.0, t - time.monotonic()))
                    await asyncio.gather(*(read(http) for read in (reads if at_once else [reads[i]])))
            await asyncio.sleep(max(0.0, w1 - time.monotonic()))
            k += 1


async def one_mode(cluster: LocalCluster, args: argparse.Namespace, mode: str, port: int, token: str,
                   exporter_host: str, pids: dict[str, list[int]], metrics_ports: dict[str, int]) -> Run:
    run = Run(mode)
    total = args.pools * args.nodes_per_pool
    start = time.monotonic() + 3.0  # the workers' start-up
    measured = start + args.warmup
    end = measured + args.duration
    target = (exporter_host, port) if mode == "direct" else ("127.0.0.1", cluster.front_port)
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, str(LOADGEN), "--index", str(k), "--workers", str(args.workers), "--total", str(total),
        "--per-pool", str(args.nodes_per_pool), "--host", target[0], "--target-port", str(target[1]),
        "--port", str(port), "--token", token, "--mode", mode, "--rate", str(args.rate),
        "--pool-size", str(args.pool_size), "--start", repr(start), "--seconds", str(args.warmup + args.duration),
        *(["--identity"] if args.identity else []), stdout=asyncio.subprocess.PIPE) for k in range(args.workers)]
    try:
        return await measure(args, mode, procs, pids, metrics_ports, run, measured, end, port, token)
    finally:
        for p in procs:  # on every path: a cancelled run does not leave generators scraping
            if p.returncode is None:
                p.kill()
                await p.wait()


async def measure(args: argparse.Namespace, mode: str, procs: list[asyncio.subprocess.Process],
                  pids: dict[str, list[int]], metrics_ports: dict[str, int], run: Run, measured: float,
                  end: float, port: int, token: str) -> Run:
    outputs = [asyncio.ensure_future(p.communicate()) for p in procs]
    reader = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        ops = f"http://127.0.0.1:{metrics_ports['gateway']}"
        bearer = {"Authorization": f"Bearer {token}"}
        sd = f"/sd?port={port}" + ("&group=pool" if args.sd_group == "pool" else "")
        if args.views and mode != "direct":
            # Prometheus reads /sd before it scrapes anything (that is where its targets come from): once here, at
            # the warm-up's start, not counted. The gateway makes that page again after each registration since.
            async with http.get(ops + sd, headers=bearer) as resp:
                await resp.read()
        await asyncio.sleep(max(0.0, measured - time.monotonic()))
        gc0 = {k: gc_buckets(await fetch_metrics(http, p)) for k, p in metrics_ports.items()}
        if args.read_metrics and mode != "direct":
            ports = list(metrics_ports.values())
            reader = asyncio.ensure_future(read_loop([functools.partial(fetch_metrics, port=p) for p in ports],
                                                     args.read_metrics, args.phase_seconds, measured, end, run,
                                                     args.reads_at_once))
        elif args.views and mode != "direct":
            browser = {"Authorization": "Basic " + base64.b64encode(f"operator:{token}".encode()).decode()}
            views = [(ops, "/sd", sd, bearer), (ops, "/metrics", "/metrics", {}),
                     (ops, "/status.html", "/status.html", browser)]
            # Both services' /metrics, as Prometheus scrapes them: every agent's too (they share the machine).
            views += [(f"http://127.0.0.1:{p}", "/metrics (agents)", "/metrics", {})
                      for name, p in metrics_ports.items() if name != "gateway"]
            reader = asyncio.ensure_future(read_loop(
                [functools.partial(fetch_view, url=base + url, headers=headers, run=run, path=path)
                 for base, path, url, headers in views],
                args.views, args.phase_seconds, measured, end, run, args.reads_at_once))
        pids = {**pids, "generator": [p.pid for p in procs]}
        cpu0 = {k: sum(proc_stat(p)[0] for p in v) for k, v in pids.items()}
        while (now := time.monotonic()) < end:
            for kind, group in pids.items():
                stats = [proc_stat(p) for p in group]
                run.rss[kind].append((now - measured, sum(s[1] for s in stats)))
                run.fds[kind].append((now - measured, sum(s[2] for s in stats)))
            run.load.append(os.getloadavg()[0])
            await asyncio.sleep(min(5.0, max(0.0, end - time.monotonic())))
        run.cpu = {k: sum(proc_stat(p)[0] for p in v) - cpu0[k] for k, v in pids.items()}
        run.seconds = time.monotonic() - measured
        pages = {k: await fetch_metrics(http, p) for k, p in metrics_ports.items()}
        run.gc = {k: gc_window(gc0[k], gc_buckets(text)) for k, text in pages.items()}
        run.frozen = {k: sample(text, "raven_gc_frozen_objects") for k, text in pages.items()}
    if reader is not None:
        await reader
    for out in await asyncio.gather(*outputs):
        data = json.loads(out[0])
        run.records += [tuple(r) for r in data["records"] if r[0] >= args.warmup]
    run.reading = [(a - measured, b - measured) for a, b in run.reading]
    return run


async def main(args: argparse.Namespace) -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    total = args.pools * args.nodes_per_pool
    if hard < total + 1024:
        print(f"bench: the open-files limit {hard} is too low for {total} connections", file=sys.stderr)
        return 1
    main_task = asyncio.current_task()
    assert main_task is not None
    # SIGTERM (kill, a CI timeout) ends the run like Ctrl-C: the cluster, the exporter and the generators stop.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    workdir = Path(tempfile.mkdtemp(prefix="raven-fleet-"))
    port = free_port("127.0.30.1")
    exporters = [SimNode(f"exporter-{p}", f"127.0.30.{p + 1}", port, size=args.size) for p in range(args.pools)]
    pools = [PoolSpec(f"pool-{p}", [SimNode(f"node-{p}-{k}", exporters[p].host, port)
                                    for k in range(args.nodes_per_pool)], agents=1) for p in range(args.pools)]
    token = secrets.token_hex(32)
    exporter_cmd = [sys.executable, "-m", "raven.demo.simexporter", "--size", str(args.size), "--gpus", "8",
                    "--stats-interval", "3600",
                    *(a for e in exporters for a in ("--node", f"{e.name}={e.host}:{port}"))]
    exporter = await asyncio.create_subprocess_exec(*exporter_cmd, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=(workdir / "exporter.log").open("wb"))
    env = {"RAVEN_GC_TUNING": "off"} if args.no_gc_tuning else {}
    cluster = LocalCluster(workdir, pools, allowed_ports=[port], front_token=token, env=env,
                           gateway_settings={"log_level": "warning"}, agent_settings={"log_level": "warning"})
    results: list[Run] = []
    try:
        await asyncio.sleep(1)
        await cluster.start(timeout=120)
        assert cluster.gateway is not None
        pids = {"gateway": [cluster.gateway.process.pid],
                "agents": [a.process.pid for a in cluster.agents.values()],
                "exporter": [exporter.pid]}
        metrics_ports = {"gateway": cluster.gateway_metrics_port,
                         **{name: agent.metrics_port for name, agent in cluster.agents.items()}}
        print(f"{total} nodes in {args.pools} pools, {args.size} B pages, {args.rate:g} scrapes/s from "
              f"{args.workers} generator processes, {args.warmup:g}s warm-up + {args.duration:g}s per mode; "
              f"one gateway, {args.pools} agents (TLS 1.3); GC tuning {'off' if args.no_gc_tuning else 'on'}",
              flush=True)
        for mode in args.modes:
            run = await one_mode(cluster, args, mode, port, token, exporters[0].host, pids, metrics_ports)
            results.append(run)
            report(run, args)
    finally:
        await cluster.close()
        exporter.terminate()
        await exporter.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(all(r[3] == "200" for r in run.records) for run in results) else 2


def latency_line(records: list[tuple[float, float, float, str]]) -> str:
    ms = [r[2] * 1000 for r in records if r[3] == "200"]
    return (f"p50 {pct(ms, 0.5):.1f}  p99 {pct(ms, 0.99):.1f}  p99.9 {pct(ms, 0.999):.1f}  "
            f"max {max(ms, default=float('nan')):.1f}")


def report(run: Run, args: argparse.Namespace) -> None:
    recs = run.records
    ok = [r for r in recs if r[3] == "200"]
    failures = collections.Counter(r[3] for r in recs if r[3] != "200")
    print(f"\n{run.mode}: {len(recs)} scrapes in {run.seconds:.0f}s, {len(ok) / run.seconds:.0f}/s answered 200 "
          f"(target {args.rate:g}/s); failures: {dict(failures) or 'none'}")
    print(f"  latency ms (write to last byte): {latency_line(recs)}")
    lag = [r[1] * 1000 for r in recs]
    print(f"  generator lag ms (sent after due): p50 {pct(lag, 0.5):.1f}  p99 {pct(lag, 0.99):.1f}  "
          f"max {max(lag, default=float('nan')):.1f}")
    by_second: dict[int, list[float]] = collections.defaultdict(list)
    for r in ok:
        by_second[int(r[0] - args.warmup)].append(r[2] * 1000)
    worst = sorted(by_second.items(), key=lambda kv: -max(kv[1]))[:5]
    print("  worst seconds (t: max ms / p99 ms): " + ", ".join(
        f"{t}s: {max(v):.0f}/{pct(v, 0.99):.0f}" for t, v in sorted(worst)))
    scrapes = max(1, len(recs))
    print("  CPU ms per scrape: " + ", ".join(f"{k} {v * 1000 / scrapes:.3f}" for k, v in run.cpu.items()))
    for kind in ("gateway", "agents"):
        first_rss = run.rss[kind][0][1] if run.rss[kind] else 0
        first_fds = run.fds[kind][0][1] if run.fds[kind] else 0
        print(f"  {kind}: RSS {first_rss / 1024:.0f} MiB, slope {slope(run.rss[kind]):+.0f} KiB/min; "
              f"descriptors {first_fds:.0f}, slope {slope(run.fds[kind]):+.1f}/min")
    print(f"  GC during the measured window: gateway {run.gc.get('gateway')}; objects frozen at the end: "
          f"{run.frozen.get('gateway')}")
    agents = {k: v for k, v in run.gc.items() if k != "gateway"}
    if agents:
        longest = max(agents.items(), key=lambda kv: kv[1])
        print(f"  GC agents (one shown, of {len(agents)}): {longest[0]} {longest[1]}")
    if run.reading:
        def inside(t: float) -> bool:
            return any(a <= t - args.warmup < b for a, b in run.reading)
        read = [r for r in recs if inside(r[0])]
        quiet = [r for r in recs if not inside(r[0])]
        p_read = pct([r[2] for r in read if r[3] == "200"], 0.99)
        p_quiet = pct([r[2] for r in quiet if r[3] == "200"], 0.99)
        m_read = max((r[2] for r in read if r[3] == "200"), default=float("nan"))
        m_quiet = max((r[2] for r in quiet if r[3] == "200"), default=float("nan"))
        what = (f"reading /metrics every {args.read_metrics:g}s" if args.read_metrics else
                f"reading /sd, both services' /metrics and /status.html every {args.views:g}s (gzip)")
        print(f"  {what}: {latency_line(read)}; without: {latency_line(quiet)}; p99 ratio {p_read / p_quiet:.2f}, "
              f"max ratio {m_read / m_quiet:.2f}")
        windows: dict[int, list[float]] = collections.defaultdict(list)
        for r in ok:
            windows[int((r[0] - args.warmup) // args.phase_seconds)].append(r[2] * 1000)
        print("  per window (R: reads in it), p99 / max ms: " + ", ".join(
            f"{k * args.phase_seconds:g}s{' R' if k % 2 else ''} {pct(v, 0.99):.0f}/{max(v):.0f}"
            for k, v in sorted(windows.items())))
        for path, reads in sorted(run.views.items()):
            ok = [r for r in reads if r[0] == 200]
            ms = [r[2] * 1000 for r in ok]
            print(f"    {path}: {len(ok)}/{len(reads)} answered 200, {max((r[1] for r in ok), default=0)} bytes "
                  f"on the wire, read in p50 {pct(ms, 0.5):.1f} / max {max(ms, default=float('nan')):.1f} ms")
    print(f"  machine load average (1 min) during the run: {min(run.load, default=0):.1f}-"
          f"{max(run.load, default=0):.1f}", flush=True)


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", type=int, default=10, help="pools, one agent each (default 10)")
    parser.add_argument("--nodes-per-pool", type=int, default=1000, help="node names per pool (default 1000)")
    parser.add_argument("--rate", type=float, default=667, help="scrapes per second (default 667)")
    parser.add_argument("--duration", type=float, default=600, help="measured seconds per mode (default 600)")
    parser.add_argument("--warmup", type=float, default=30, help="seconds before measuring (default 30)")
    parser.add_argument("--size", type=int, default=50 * 1024, help="page size in bytes (default 51200)")
    parser.add_argument("--pool-size", type=int, default=200, help="connections in pool mode (default 200)")
    parser.add_argument("--workers", type=int, default=2, help="load generator processes (default 2)")
    parser.add_argument("--modes", nargs="+", choices=["direct", "pool", "per-node"],
                        default=["direct", "pool", "per-node"])
    parser.add_argument("--read-metrics", type=float, default=0.0, metavar="SECONDS",
                        help="read every service's /metrics this often in alternate windows (0: never)")
    parser.add_argument("--views", type=float, default=0.0, metavar="SECONDS",
                        help="read the gateway's /sd, /metrics and /status.html and the agents' /metrics (gzip) "
                        "this often in alternate windows, as Prometheus and an operator's open status page do "
                        "(0: never; not with --read-metrics)")
    parser.add_argument("--sd-group", choices=["pool", "node"], default="pool",
                        help="with --views: read /sd?group=pool (the shipped scrape configs) or one group per node "
                        "(what configs written before read; a gateway before issue 34 knows only that)")
    parser.add_argument("--reads-at-once", action="store_true",
                        help="with --views or --read-metrics: make every read of a round at the same instant (a burst "
                        "no scraper makes) instead of each at its own offset in the interval, as Prometheus does")
    parser.add_argument("--phase-seconds", type=float, default=30.0,
                        help="window length for --read-metrics and --views")
    parser.add_argument("--identity", action="store_true",
                        help="ask for uncompressed pages (default: gzip, as Prometheus asks; the page is ~3 KiB then)")
    parser.add_argument("--no-gc-tuning", action="store_true", help="run the services with RAVEN_GC_TUNING=off")
    args = parser.parse_args()
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(main(args))
        return int(uvloop.run(main(args)))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("bench: stopped before the end; the cluster and the generators were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
