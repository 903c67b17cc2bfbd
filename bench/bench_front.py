"""Benchmark: the front port's HTTP server alone, lean (raven/http/h1server.py) against aiohttp's, in one run.

Each server runs in a process of its own, wired as the gateway wires it (gateway/frontserver.py, behind the
connection guard, uvloop when installed), and answers every request through the same
:class:`~raven.http.call.ServerCall` handler, as the proxy does: the credentials' vouch, one wait under the
request's deadline, then the head with the whole 50 KiB page (one write) and the end. No tunnel behind it:
what differs between the rows is the HTTP server and its timers only. ``wrk`` drives it with 32 connections
and with one; printed: req/s, p50/p99, and the server process's CPU per request (user + system, /proc). The
rounds interleave the servers; the machine is shared, so compare within one run. With ``--idle N``, each server
then holds N keep-alive connections (one request answered on each, as Prometheus holds one per target) and
the growth of its resident memory per connection is printed.

    PYTHONPATH=. .venv/bin/python bench/bench_front.py --duration 5 --rounds 3 --idle 5000

This is a benchmark, not a test: its figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from raven.config import GatewayFront
from raven.demo.dcgm_page import render_metrics
from raven.demo.launch import free_port
from raven.http.call import ServerCall
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite

SERVERS = ("lean", "aiohttp")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def serve(server: str, port: int) -> None:
    from gateway.frontserver import front_server

    page = render_metrics("bench-node", 8)
    headers = (("Content-Type", "text/plain; version=0.0.4; charset=utf-8"), ("X-Raven-Agent", "bench-agent"))
    guard = ConnectionGuard("bench front", GuardLimits(max_connections=1 << 16, max_per_client=1 << 16))

    async def handle(call: ServerCall) -> None:
        guard.vouch(call)
        async with call.timeout(time.monotonic() + 30):  # the node's answer, under the request's deadline
            await asyncio.sleep(0)
        await call.send(200, "", headers, len(page), page, False, time.monotonic() + 10)
        await call.end(time.monotonic() + 10)

    cfg = GatewayFront.model_validate({"listen": f"127.0.0.1:{port}", "server": server})
    runner = front_server(cfg, guard, handle, lambda: False)
    await runner.setup()
    await GuardedSite(runner, "127.0.0.1", port, guard).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


def wrk(port: int, connections: int, seconds: int) -> tuple[float, float, float]:
    """(req/s, p50 ms, p99 ms)"""
    out = subprocess.run(["wrk", "--latency", "-t", str(min(connections, 2)), "-c", str(connections), "-d",
                          f"{seconds}s", f"http://127.0.0.1:{port}/metrics"], capture_output=True, text=True,
                         check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def pct(p: str) -> float:
        value, unit = re.search(rf"\b{p}%\s+([\d.]+)(us|ms|s)\b", out).groups()  # type: ignore[union-attr]
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    return rps, pct("50"), pct("99")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def hold_idle(port: int, count: int, pid: int) -> float:
    """Bytes of the server's resident memory per keep-alive connection, each after one answered request."""
    request = b"GET /metrics HTTP/1.1\r\nHost: bench-node:9400\r\n\r\n"
    writers: list[asyncio.StreamWriter] = []
    before = rss_bytes(pid)
    try:
        for start in range(0, count, 200):
            batch = [await asyncio.open_connection("127.0.0.1", port) for _ in range(min(200, count - start))]
            for _, writer in batch:
                writer.write(request)
                writers.append(writer)
            for reader, _ in batch:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        await asyncio.sleep(1)
        return (rss_bytes(pid) - before) / count
    finally:
        for writer in writers:
            writer.close()


def measure(server: str, seconds: int, idle: int = 0) -> dict[int, tuple[float, float, float, float]]:
    """{connections: (req/s, p50, p99, CPU µs per request)} for one server process."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", server, "--port", str(port)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {server} server did not start")
        wrk(port, 8, 1)  # warm-up
        results = {}
        for connections in (32, 1):
            before, start = cpu_seconds(proc.pid), time.monotonic()
            rps, p50, p99 = wrk(port, connections, seconds)
            used = cpu_seconds(proc.pid) - before
            requests = rps * (time.monotonic() - start)
            results[connections] = (rps, p50, p99, used / max(requests, 1) * 1e6)
        if idle:
            per = asyncio.run(hold_idle(port, idle, proc.pid))
            print(f"  {server}: {idle} idle keep-alive connections, {per / 1024:.1f} KiB of resident memory each",
                  flush=True)
        return results
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=5, help="seconds per measurement (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the servers interleaved; medians (default 3)")
    p.add_argument("--idle", type=int, default=0, help="then hold this many keep-alive connections (default 0)")
    p.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve(args.serve, args.port))
        else:
            uvloop.run(serve(args.serve, args.port))
        return 0
    if shutil.which("wrk") is None:
        print("bench: wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 1
    runs: dict[str, list[dict[int, tuple[float, float, float, float]]]] = {s: [] for s in SERVERS}
    for round_ in range(1, args.rounds + 1):
        for server in SERVERS:
            result = measure(server, args.duration, args.idle if round_ == 1 else 0)
            runs[server].append(result)
            r32, r1 = result[32], result[1]
            print(f"round {round_} {server:<8} c=32 {r32[0]:>7,.0f} req/s {r32[3]:6.1f} µs CPU/req   "
                  f"c=1 {r1[0]:>6,.0f} req/s p50 {r1[1]:.2f} ms {r1[3]:6.1f} µs CPU/req", flush=True)
    print(f"\n{'server':<8} {'c=32 req/s':>10} {'p50/p99 ms':>13} {'µs CPU/req':>10} {'c=1 req/s':>10} "
          f"{'p50/p99 ms':>13} {'µs CPU/req':>10}   (medians of {args.rounds} rounds)")
    med: dict[str, list[float]] = {}
    for server in SERVERS:
        m = med[server] = [statistics.median(r[c][i] for r in runs[server]) for c in (32, 1) for i in range(4)]
        print(f"{server:<8} {m[0]:>10,.0f} {m[1]:>6.2f}/{m[2]:<6.2f} {m[3]:>10.1f} {m[4]:>10,.0f} "
              f"{m[5]:>6.2f}/{m[6]:<6.2f} {m[7]:>10.1f}")
    lean, aio = med["lean"], med["aiohttp"]
    print(f"lean / aiohttp: c=32 {lean[0] / aio[0]:.2f}x req/s, {lean[3] / aio[3]:.2f}x CPU per request; "
          f"c=1 {lean[4] / aio[4]:.2f}x req/s, p50 {lean[5]:.2f} vs {aio[5]:.2f} ms, {lean[7] / aio[7]:.2f}x CPU "
          "per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
